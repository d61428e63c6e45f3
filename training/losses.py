"""Distillation losses between a drafter (student) and the frozen target (teacher).

Conventions used by every function here:

- Logits have shape ``[..., V]``; the distributions are ``p = softmax(teacher_logits / T)``
  (teacher) and ``q = softmax(student_logits / T)`` (student), computed in float32 whatever the
  input dtype.
- Per-position functions return losses of shape ``[...]`` (no reduction) so that callers can mask;
  `divergence` and `feature_regression` return the masked mean as a scalar.
- The teacher is detached inside: gradients flow only into the student.
- Teacher probabilities that are exactly zero (``-inf`` logits, e.g. after top-k masking) are
  handled without ``nan``: terms ``p * log(p / r)`` with ``p == 0`` are exactly 0. Where a loss
  needs ``log p`` at such a token (reverse KL), ``log p`` is floored at ``log(finfo.tiny)``
  (about -87.3 in float32), so mass the student puts there costs a large finite penalty instead
  of ``inf``.
- No ``T**2`` factor is applied; callers that want Hinton's scaling multiply themselves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import DIVERGENCES  # noqa: F401 (the names `divergence` accepts; declared without torch)


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, bool) or not math.isfinite(float(temperature)) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            "student_logits and teacher_logits must have the same shape [..., V], got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    if student_logits.dim() == 0:
        raise ValueError("logits must have at least one dimension (the vocabulary)")


def _log_probs(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(log q, log p)``, both float32 ``[..., V]``; the teacher's is detached."""
    _check_pair(student_logits, teacher_logits)
    _check_temperature(temperature)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    return log_q, log_p


def _weighted_log_ratio(
    weight: torch.Tensor, log_weight: torch.Tensor, log_other: torch.Tensor
) -> torch.Tensor:
    """``sum_v w * (log w - log r)`` over the last dim, with terms where ``w == 0`` set to 0.

    Shapes: all inputs ``[..., V]``, output ``[...]``.
    """
    terms = weight * (log_weight - log_other)
    return torch.where(weight > 0, terms, torch.zeros_like(terms)).sum(dim=-1)


def forward_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(p_teacher || q_student) = sum_v p log(p / q) per position.

    Args: logits ``[..., V]``. Returns ``[...]``, >= 0, in nats. Mode-covering.
    """
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return _weighted_log_ratio(log_p.exp(), log_p, log_q)


def reverse_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(q_student || p_teacher) = sum_v q log(q / p) per position.

    Teacher log-probabilities are floored at ``log(finfo.tiny)`` so tokens the teacher rules out
    cost a large finite penalty. Args: logits ``[..., V]``. Returns ``[...]``, >= 0. Mode-seeking.
    """
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    log_p = log_p.clamp(min=math.log(torch.finfo(log_p.dtype).tiny))
    return _weighted_log_ratio(log_q.exp(), log_q, log_p)


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence per position.

    With teacher ``p``, student ``q`` and mixture ``m = beta * p + (1 - beta) * q``::

        JSD_beta = beta * KL(p || m) + (1 - beta) * KL(q || m)

    so ``beta`` is the weight of the TEACHER ``p`` (in the mixture and in the sum). ``beta = 0.5``
    is the symmetric JSD, bounded by ``log 2``. This is not TRL's GKD convention (there beta -> 0
    / 1 tends to a KL); here beta = 0 or 1 would make the loss identically zero, so ``beta`` must
    lie in the open interval (0, 1). Args: logits ``[..., V]``. Returns ``[...]``, >= 0.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in the open interval (0, 1), got {beta!r}")
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    log_m = torch.logsumexp(
        torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0
    )
    kl_p_m = _weighted_log_ratio(log_p.exp(), log_p, log_m)
    kl_q_m = _weighted_log_ratio(log_q.exp(), log_q, log_m)
    return beta * kl_p_m + (1.0 - beta) * kl_q_m


def total_variation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Total variation distance 0.5 * sum_v |p - q| per position.

    Equals ``1 - sum_v min(p, q)``: the probability that speculative sampling rejects a token
    drafted from ``q`` (see `acceptance_overlap`), the quantity acceptance training minimises.
    Its gradient shrinks with the overlap (see `negative_log_acceptance`, `lk_hybrid`).
    Args: logits ``[..., V]``. Returns ``[...]`` in [0, 1]. Symmetric.
    """
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(dim=-1)


def acceptance_overlap(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``alpha = sum_v min(p_v, q_v)`` per position: the probability that speculative sampling
    accepts a token drafted from ``q`` against the target's ``p`` (Leviathan et al. 2023).

    ``1 - alpha`` equals `total_variation`. Args: logits ``[..., V]``. Returns ``[...]`` in [0, 1].
    """
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    return torch.minimum(log_p.exp(), log_q.exp()).sum(dim=-1)


def negative_log_acceptance(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``-log(alpha)`` per position, ``alpha`` the `acceptance_overlap`.

    The same optimum as total variation (``alpha = 1``), with the gradient of ``1 - alpha`` scaled
    by ``1 / alpha``, so that a drafter far from the target (small overlap) still gets a strong
    signal (Samarin et al. 2026, "LK Losses"). ``alpha`` is floored at ``finfo.tiny``, so disjoint
    supports cost about 87.3 nats instead of ``inf``. Args: logits ``[..., V]``. Returns ``[...]``, >= 0.
    """
    alpha = acceptance_overlap(student_logits, teacher_logits, temperature)
    return -alpha.clamp(min=torch.finfo(alpha.dtype).tiny).log()


LK_ETA = 3.0
"""`lk_hybrid`'s decay rate ``eta``: the blend weight of KL is ``exp(-eta * mean alpha)``, so KL
leads while the drafter's overlap with the target is small (about 0.74 of the loss at alpha 0.1)
and total variation once it is large (KL about 0.05 at alpha 1). The value of the LK losses paper
and of vllm-project/speculators' ``lk_hybrid``."""


def lk_hybrid(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    eta: float = LK_ETA,
) -> torch.Tensor:
    """Adaptive blend ``lam * KL(p || q) + (1 - lam) * TV(p, q)`` per position.

    ``lam = exp(-eta * alpha_bar)``, one weight for the call: ``alpha_bar`` is the masked mean of
    `acceptance_overlap` over the positions (``mask`` ``[...]`` or None for all), detached, so it
    steers the mix without being optimised itself. Call it once per drafting depth: a depth the
    drafter predicts well trains mostly on total variation (the rejection probability), a poor one
    mostly on forward KL, whose gradient does not vanish at small overlap. ``eta = 0`` is pure
    forward KL. The blend comes from the positions of this call (one micro-batch of one process;
    no reduction across processes). Args: logits ``[..., V]``. Returns ``[...]``, >= 0 (masked positions included,
    for the caller to mask).
    """
    if isinstance(eta, bool) or not math.isfinite(float(eta)) or eta < 0:
        raise ValueError(f"eta must be a finite number >= 0, got {eta!r}")
    kl = forward_kl(student_logits, teacher_logits, temperature)
    alpha = acceptance_overlap(student_logits, teacher_logits, temperature)
    weight = torch.exp(-eta * masked_mean(alpha.detach(), mask))
    return weight * kl + (1.0 - weight) * (1.0 - alpha)


def soft_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Cross entropy to the teacher distribution, -sum_v p log q, per position.

    Equals ``forward_kl + H(p)``: same gradient as forward KL, not zero at ``q == p``.
    Args: logits ``[..., V]``. Returns ``[...]``, >= 0.
    """
    log_q, log_p = _log_probs(student_logits, teacher_logits, temperature)
    p = log_p.exp()
    terms = -p * log_q
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(dim=-1)


def hard_cross_entropy(
    student_logits: torch.Tensor, target_ids: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Cross entropy to hard targets, -log q[target], per position (temperature 1).

    Args: student_logits ``[..., V]``, target_ids ``[...]`` (long; ``ignore_index`` marks
    positions to skip). Returns float32 ``[...]``, 0 at ignored positions.
    """
    if student_logits.dim() == 0 or target_ids.shape != student_logits.shape[:-1]:
        raise ValueError(
            "target_ids must have the shape of student_logits without its last dim, got "
            f"logits {tuple(student_logits.shape)} and targets {tuple(target_ids.shape)}"
        )
    vocab = student_logits.shape[-1]
    losses = F.cross_entropy(
        student_logits.float().reshape(-1, vocab),
        target_ids.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction="none",
    )
    return losses.reshape(target_ids.shape)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true; 0 if none is.

    Args: values ``[...]``, mask ``[...]`` (bool or 0/1) or None for all positions.
    Masked-out positions are dropped with ``where`` so an ``inf`` there cannot leak in.
    """
    if mask is None:
        return values.mean()
    if mask.shape != values.shape:
        raise ValueError(
            f"mask must have the per-position shape {tuple(values.shape)}, got {tuple(mask.shape)}"
        )
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros_like(values)).sum()
    return total / keep.sum().clamp(min=1)


def divergence(
    kind: str,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    beta: float = 0.5,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked mean of the divergence named ``kind`` (one of `DIVERGENCES`) over positions.

    Args: logits ``[..., V]``; mask ``[...]`` or None; ``beta`` is used by "jsd" only. "lk_hybrid"
    blends with one weight per call, from the mean overlap over the masked positions: call this
    once per drafting depth (head, unrolled step), as the kinds' loss hooks do.
    Returns a float32 scalar.
    """
    if kind == "fkl":
        losses = forward_kl(student_logits, teacher_logits, temperature)
    elif kind == "rkl":
        losses = reverse_kl(student_logits, teacher_logits, temperature)
    elif kind == "jsd":
        losses = jsd(student_logits, teacher_logits, beta=beta, temperature=temperature)
    elif kind == "tvd":
        losses = total_variation(student_logits, teacher_logits, temperature)
    elif kind == "ce":
        losses = soft_cross_entropy(student_logits, teacher_logits, temperature)
    elif kind == "nla":
        losses = negative_log_acceptance(student_logits, teacher_logits, temperature)
    elif kind == "lk_hybrid":
        losses = lk_hybrid(student_logits, teacher_logits, temperature, mask)
    else:
        raise ValueError(f"kind must be one of {DIVERGENCES}, got {kind!r}")
    return masked_mean(losses, mask)


def head_loss_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """Medusa's per-head loss weights: ``decay ** i`` for head ``i = 0 .. num_heads - 1``."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay!r}")
    return [decay**i for i in range(num_heads)]


def feature_regression(
    predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """EAGLE's feature loss: smooth L1 (beta 1) between predicted and target features.

    Args: predicted and target ``[..., H]`` (target detached inside), mask ``[...]`` or None.
    The loss is averaged over ``H`` per position, then masked-mean over positions.
    Returns a float32 scalar.
    """
    if predicted.shape != target.shape or predicted.dim() == 0:
        raise ValueError(
            "predicted and target must have the same shape [..., H], got "
            f"{tuple(predicted.shape)} and {tuple(target.shape)}"
        )
    per_element = F.smooth_l1_loss(
        predicted.float(), target.detach().float(), reduction="none", beta=1.0
    )
    return masked_mean(per_element.mean(dim=-1), mask)
