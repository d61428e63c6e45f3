"""Medusa's training hook: what the generic distillation trainer (:mod:`training.trainer`) calls.

Head ``k`` at position ``t`` is trained towards the target's distribution for token ``t + k + 2``
(the target's logits at ``t + k + 1``) with the configured divergence at the configured
temperature, weighted ``head_decay ** k`` (Medusa-1), plus ``hard_label_weight`` times plain cross
entropy to the target's tokens. After training the per-head, per-rank accuracy on held-out
sequences rebuilds the default tree.

The divergences come from the trainer (``context.losses``): this package does not import
``training``.

**Medusa-2** (``TrainConfig.joint``): a LoRA is put on the backbone when the hook is built
(:func:`heads.lora.add_lora`; targets that name no module are refused then) and trained with the
heads. The first ``joint_heads_only_steps`` train the heads alone, exactly as above (the fresh LoRA
leaves the backbone unchanged). After that each step runs the tuned backbone with gradients and the
original model (the same backbone with the adapter disabled) without, and minimises

    KL(original || tuned) per token  +  heads' loss against the tuned backbone's distribution,

where the heads' parameters get the heads' loss gradient in full and the backbone gets it scaled by
lambda, which rises linearly from 0 to ``joint_lambda`` over ``joint_lambda_warmup_steps``. For the
backbone this is Medusa-2's ``L_LM + lambda L_heads`` with self-distillation as ``L_LM``; for the
heads it is that loss with a 1/lambda learning-rate multiplier, so that warming lambda up does not
starve them (Adam's step size would otherwise lag a shrinking gradient). The LoRA has its own
learning rate (``lora_learning_rate``). After training the drift of the tuned backbone from the
original on the held-out sequences is recorded (:func:`heads.lora.measure_drift`).
"""

from __future__ import annotations

import torch

from .. import lora
from ..draft_vocab import frequent_tokens, vocabulary_swaps
from ..backbone import target_fingerprint


def head_losses(head_logits: torch.Tensor, teacher_logits: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, config, token_map: torch.Tensor | None = None, *,
                losses) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over heads and each head's top-1 agreement with the target.

    ``head_logits`` ``[K, B, T, V']``, ``teacher_logits`` ``[B, T, V]``: head k at t against the
    target at t + k + 1 (both predict token t + k + 2). ``token_map`` ``[V']``: the target ids the
    heads score (None: the whole vocabulary); the teacher is then restricted to them and positions
    whose target token lies outside are left out, as EAGLE's draft vocabulary does. ``config``: the
    trainer's ``TrainConfig``; ``losses``: the namespace of divergences (``training.losses``).
    """
    weights = losses.head_loss_weights(head_logits.shape[0], config.head_decay)
    total = head_logits.new_zeros((), dtype=torch.float32)
    agreement = []
    length = input_ids.shape[1]
    # What every head reads of the teacher, computed once: its greedy token (target ids [B, T]) and,
    # with a draft vocabulary, its logits over the draft ids [B, T, V'] and which tokens lie inside.
    teacher_tokens = teacher_logits.argmax(-1)
    inside = None
    if token_map is not None:  # target id -> draft id, -100 outside the draft vocabulary
        draft_ids = torch.full((teacher_logits.shape[-1],), -100, dtype=torch.long, device=teacher_logits.device)
        draft_ids[token_map] = torch.arange(token_map.numel(), device=teacher_logits.device)
        inside = draft_ids[teacher_tokens] >= 0
        teacher_logits = teacher_logits[..., token_map]
        teacher_tokens = teacher_logits.argmax(-1)  # in draft ids, as the heads' argmax
    per_head = head_logits.unbind(0)  # one gradient buffer for all heads in backward, not one per head
    for k, weight in enumerate(weights):
        shift = k + 1
        if length <= shift:
            agreement.append(0.0)
            continue
        student = per_head[k][:, : length - shift]
        teacher = teacher_logits[:, shift:]
        valid = attention_mask[:, shift:].bool()
        if inside is not None:
            valid = valid & inside[:, shift:]
        loss = losses.divergence(config.divergence, student, teacher, config.temperature, config.jsd_beta, valid)
        if config.hard_label_weight and length > shift + 1:
            labels = input_ids[:, shift + 1:].masked_fill(~attention_mask[:, shift + 1:].bool(), -100)
            if token_map is not None:
                labels = torch.where(labels >= 0, draft_ids[labels.clamp(min=0)], labels)
            hard = losses.hard_cross_entropy(student[:, :-1], labels)
            loss = loss + config.hard_label_weight * losses.masked_mean(hard, labels != -100)
        total = total + weight * loss
        with torch.no_grad():
            agree = (student.argmax(-1) == teacher_tokens[:, shift:]).float()
            agreement.append(float(losses.masked_mean(agree, valid)))
    return total, agreement


class MedusaLoss:
    """The Medusa training hook (``KIND.loss``); ``context``: see :class:`training.trainer.LossContext`."""

    description = "distilling heads"

    def __init__(self, context) -> None:
        self.context = context
        self.spec = context.spec
        self.config = config = context.config
        self.joint = config.joint
        if self.joint:
            if self.spec.backbone_lora is not None:
                raise ValueError("joint training puts its own LoRA on the plain base model; this spec's backbone "
                                 "already carries peft adapters")
            base = target_fingerprint(self.spec.backbone)
            self.spec.backbone_lora = lora.add_lora(self.spec.backbone, config.lora_r, config.lora_alpha,
                                                    config.lora_targets, base)
        self.heads_only_steps = (config.steps // 4 if config.joint_heads_only_steps is None
                                 else config.joint_heads_only_steps)
        self.lambda_warmup_steps = (config.steps // 4 if config.joint_lambda_warmup_steps is None
                                    else config.joint_lambda_warmup_steps)

    def prepare(self) -> None:
        """With a draft vocabulary, choose it (the most frequent target tokens in the training data)
        and restart the projections from the output head's rows of those tokens."""
        heads = self.spec.heads
        if heads.token_map is not None:
            heads.set_token_map(frequent_tokens(self.context.train_sequences, self.spec.target.vocab_size,
                                                heads.draft_vocab_size), self.spec.target.output_head)

    def swap_vocabulary(self, counts: torch.Tensor, limit: int) -> int:
        """Online learning: with a draft vocabulary, swap in up to ``limit`` tokens frequent in served
        traffic (``counts`` ``[V]`` of its predicted tokens) that the heads cannot score, in place of
        their rarest (:func:`heads.draft_vocab.vocabulary_swaps`); the tokens swapped (0 without one)."""
        heads = self.spec.heads
        if heads.token_map is None or heads.projections is None:
            return 0
        positions, token_ids = vocabulary_swaps(heads.token_map, counts, limit)
        if positions.numel():
            heads.replace_tokens(positions, token_ids, self.spec.target.output_head)
        return int(positions.numel())

    def joint_weight(self, step: int) -> float | None:
        """Lambda at optimizer step ``step``: None while the heads train alone, then rising linearly
        to ``joint_lambda`` over ``lambda_warmup_steps``."""
        if not self.joint or step < self.heads_only_steps:
            return None
        progress = (step - self.heads_only_steps + 1) / max(1, self.lambda_warmup_steps)
        return self.config.joint_lambda * min(1.0, progress)

    def parameter_groups(self) -> list[dict]:
        """The LoRA's tensors, at ``lora_learning_rate`` (None: a quarter of the heads' rate)."""
        if not self.joint:
            return []
        rate = self.config.lora_learning_rate or self.config.learning_rate / 4
        return [{"params": self.spec.backbone_lora.parameters(), "lr": rate}]

    def backbone_state(self) -> dict[str, torch.Tensor]:
        return self.spec.backbone_lora.tensors()

    def load_backbone_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.spec.backbone_lora.load_tensors(tensors)

    def _shared_logits(self):
        return self.spec.shared_logits if self.spec.config.share_lm_head else None

    @torch.no_grad()
    def _backbone(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        """The backbone's top features ``([B, T, d],)``: what a memo may keep per sequence."""
        outputs = self.spec.target.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return (outputs.last_hidden_state,)

    def _features_and_teacher(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keys=None):
        """Top features ``[B, T, d]`` (one backbone forward without gradients, or the context's memo
        for rows whose ``keys`` it holds) and teacher logits ``[B, T, V]``."""
        memo = getattr(self.context, "backbone_memo", None)
        if memo is None or keys is None:
            (features,) = self._backbone(input_ids, attention_mask)
        else:
            (features,) = memo.outputs(keys, input_ids, attention_mask, self._backbone)
        with torch.no_grad():
            teacher = self.spec.target.logits(features).float()
        return features, teacher

    def micro_loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor, indices: list[int],
                   step: int) -> tuple[torch.Tensor, list[float]]:
        weight = self.joint_weight(step)
        if weight is not None:
            return self._joint_loss(heads, input_ids, attention_mask, weight)
        features, teacher = self._features_and_teacher(input_ids, attention_mask, indices)
        with self.context.accelerator.autocast():
            head_logits = heads(features, self._shared_logits())
        return head_losses(head_logits.float(), teacher, input_ids, attention_mask, self.config,
                           self.spec.heads.token_map, losses=self.context.losses)

    def _joint_loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    weight: float) -> tuple[torch.Tensor, list[float]]:
        """Medusa-2's step (see the module docstring): KL(original || tuned) + the heads' loss, whose
        gradient reaches the backbone scaled by ``weight`` (lambda)."""
        target, autocast = self.spec.target, self.context.accelerator.autocast
        with autocast():
            features = target.base(input_ids=input_ids, attention_mask=attention_mask,
                                   use_cache=False).last_hidden_state  # (B, T, d), through the LoRA
            tuned = target.logits(features).float()  # (B, T, V)
        with torch.no_grad(), self.spec.backbone_lora.disabled(), autocast():
            original = target.logits(target.base(input_ids=input_ids, attention_mask=attention_mask,
                                                 use_cache=False).last_hidden_state).float()
        backbone_loss = self.context.losses.divergence("fkl", tuned, original, 1.0, mask=attention_mask.bool())
        scaled = features.detach() + weight * (features - features.detach())  # value: features; gradient x lambda
        with autocast():
            head_logits = heads(scaled, self._shared_logits())
        head_loss, agreement = head_losses(head_logits.float(), tuned.detach(), input_ids, attention_mask,
                                           self.config, self.spec.heads.token_map, losses=self.context.losses)
        return head_loss + backbone_loss, agreement

    def finish(self, accuracy: list[list[float]]) -> None:
        """The measured accuracy table shapes the default tree from now on; a jointly trained
        backbone's drift from the original is measured on the held-out sequences."""
        self.spec.accuracy = accuracy
        self.spec.set_tree(None)
        if self.joint:
            validation = self.context.validation_sequences
            batches = [self.context.collate(validation[start:start + 4]) for start in range(0, len(validation), 4)]
            self.spec.backbone_lora.drift = lora.measure_drift(self.spec.backbone, self.spec.backbone_lora, batches)

    @torch.no_grad()
    def rank_accuracy(self, max_rank: int = 10) -> list[list[float]]:
        """On held-out sequences: per head, the share of positions where the target's token is
        the head's rank-r candidate, r < ``max_rank`` (the table default trees are built from)."""
        heads = self.spec.heads
        max_rank = min(max_rank, heads.draft_vocab_size)
        counts = None
        total = 0
        shared = self._shared_logits()
        validation = self.context.validation_sequences
        keys = getattr(self.context, "validation_keys", None)
        for start in range(0, len(validation), 4):
            input_ids, attention_mask = self.context.collate(validation[start:start + 4])
            features, teacher = self._features_and_teacher(input_ids, attention_mask,
                                                           keys[start:start + 4] if keys else None)
            logits = heads(features, shared).float()  # (K, B, T, V)
            K, _, T, _ = logits.shape
            if counts is None:
                counts = torch.zeros(K, max_rank)
            target_token = teacher.argmax(-1)  # (B, T) the target's greedy token after t
            for k in range(K):
                shift = k + 1
                if T <= shift:
                    continue
                valid = attention_mask[:, shift:].bool()
                top = heads.target_ids(logits[k][:, : T - shift].topk(max_rank, dim=-1).indices)  # (B, T', R)
                hits = top == target_token[:, shift:, None]
                counts[k] += hits[valid].float().sum(0).cpu()
                if k == 0:
                    total += int(valid.sum())
        if counts is None or total == 0:
            return []
        return (counts / total).tolist()
