"""Medusa's training hook: what the generic distillation trainer (:mod:`training.trainer`) calls.

Head ``k`` at position ``t`` is trained towards the target's distribution for token ``t + k + 2``
(the target's logits at ``t + k + 1``) with the configured divergence at the configured
temperature, weighted ``head_decay ** k`` (Medusa-1), plus ``hard_label_weight`` times plain cross
entropy to the target's tokens. After training the per-head, per-rank accuracy on held-out
sequences rebuilds the default tree.

The divergences come from the trainer (``context.losses``): this package does not import
``training``.
"""

from __future__ import annotations

import torch


def head_losses(head_logits: torch.Tensor, teacher_logits: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, config, *, losses) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over heads and each head's top-1 agreement with the target.

    ``head_logits`` ``[K, B, T, V]``, ``teacher_logits`` ``[B, T, V]``: head k at t against the
    target at t + k + 1 (both predict token t + k + 2). ``config``: the trainer's ``TrainConfig``;
    ``losses``: the namespace of divergences (``training.losses``).
    """
    weights = losses.head_loss_weights(head_logits.shape[0], config.head_decay)
    total = head_logits.new_zeros((), dtype=torch.float32)
    agreement = []
    length = input_ids.shape[1]
    for k, weight in enumerate(weights):
        shift = k + 1
        if length <= shift:
            agreement.append(0.0)
            continue
        student = head_logits[k][:, : length - shift]
        teacher = teacher_logits[:, shift:]
        valid = attention_mask[:, shift:].bool()
        loss = losses.divergence(config.divergence, student, teacher, config.temperature, config.jsd_beta, valid)
        if config.hard_label_weight and length > shift + 1:
            labels = input_ids[:, shift + 1:].masked_fill(~attention_mask[:, shift + 1:].bool(), -100)
            hard = losses.hard_cross_entropy(student[:, :-1], labels)
            loss = loss + config.hard_label_weight * losses.masked_mean(hard, labels != -100)
        total = total + weight * loss
        with torch.no_grad():
            agree = (student.argmax(-1) == teacher.argmax(-1)).float()
            agreement.append(float(losses.masked_mean(agree, valid)))
    return total, agreement


class MedusaLoss:
    """The Medusa training hook (``KIND.loss``); ``context``: see :class:`training.trainer.LossContext`."""

    description = "distilling heads"

    def __init__(self, context) -> None:
        self.context = context
        self.spec = context.spec
        self.config = context.config

    def prepare(self) -> None:
        """Nothing to set up from the data."""

    def _shared_logits(self):
        return self.spec.shared_logits if self.spec.config.share_lm_head else None

    def _features_and_teacher(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """One backbone forward without gradients: top features ``[B, T, d]``, teacher logits ``[B, T, V]``."""
        target = self.spec.target
        with torch.no_grad():
            outputs = target.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            features = outputs.last_hidden_state
            teacher = target.logits(features).float()
        return features, teacher

    def micro_loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor, indices: list[int],
                   step: int) -> tuple[torch.Tensor, list[float]]:
        features, teacher = self._features_and_teacher(input_ids, attention_mask)
        with self.context.accelerator.autocast():
            head_logits = heads(features, self._shared_logits())
        return head_losses(head_logits.float(), teacher, input_ids, attention_mask, self.config,
                           losses=self.context.losses)

    def finish(self, accuracy: list[list[float]]) -> None:
        """The measured accuracy table shapes the default tree from now on."""
        self.spec.accuracy = accuracy
        self.spec.set_tree(None)

    @torch.no_grad()
    def rank_accuracy(self, max_rank: int = 10) -> list[list[float]]:
        """On held-out sequences: per head, the share of positions where the target's token is
        the head's rank-r candidate, r < ``max_rank`` (the table default trees are built from)."""
        heads = self.spec.heads
        counts = None
        total = 0
        shared = self._shared_logits()
        validation = self.context.validation_sequences
        for start in range(0, len(validation), 4):
            input_ids, attention_mask = self.context.collate(validation[start:start + 4])
            features, teacher = self._features_and_teacher(input_ids, attention_mask)
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
                top = logits[k][:, : T - shift].topk(max_rank, dim=-1).indices  # (B, T', R)
                hits = top == target_token[:, shift:, None]
                counts[k] += hits[valid].float().sum(0).cpu()
                if k == 0:
                    total += int(valid.sum())
        if counts is None or total == 0:
            return []
        return (counts / total).tolist()
