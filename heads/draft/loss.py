"""The draft kind's training hook (DistillSpec, Zhou et al. 2024): what the generic distillation
trainer (:mod:`training.trainer`) calls.

The target stays frozen; the draft model itself is trained, every weight or a peft LoRA injected
into it (``TrainConfig.draft_lora``, with ``lora_r``, ``lora_alpha``, ``lora_targets``). Per
micro-batch, one target forward without gradients gives the teacher logits at every position and
one draft forward the student's; the loss is the configured divergence between the two token
distributions at the configured temperature (the serving temperature), averaged over the real
positions::

    loss = mean_t D(p_target(. | x_<=t) || q_draft(. | x_<=t))     D: one of training.config.DIVERGENCES

The sequences are the target's own continuations (off-policy) and, with ``on_policy_ratio > 0``,
continuations the draft samples itself at the serving temperature (:meth:`DraftLoss.on_policy_model`
tells the trainer to sample from the draft, not from speculative generation, whose output would
follow the target): DistillSpec's on-policy data, re-scored by the target here.

The divergences come from the trainer (``context.losses``): this package does not import ``training``.
"""

from __future__ import annotations

import torch


class DraftLoss:
    """The draft kind's training hook (``KIND.loss``); ``context``: see :class:`training.trainer.LossContext`.
    Refuses settings that belong to other kinds."""

    description = "distilling draft model"

    def __init__(self, context) -> None:
        config = context.config
        if config.hard_label_weight:
            raise ValueError("hard_label_weight applies to Medusa training only; the draft model is trained on the "
                             "divergence alone")
        if config.unroll_steps != 1:
            raise ValueError("unroll_steps applies to EAGLE training only")
        if getattr(config, "draft_lora", False) and context.spec.heads.lora is None:
            from .. import lora

            lora.check_targets(context.spec.heads.model, config.lora_targets)  # before any step: named modules
        self.context = context
        self.spec = context.spec
        self.config = config

    def prepare(self) -> None:
        """Make the draft trainable: a LoRA (``draft_lora``) or every weight."""
        draft, config = self.spec.heads, self.config
        if getattr(config, "draft_lora", False):
            if draft.lora is None:  # a second run on the same spec keeps training its LoRA
                draft.add_lora(config.lora_r, config.lora_alpha, config.lora_targets)
        else:
            if draft.lora is not None:
                raise ValueError("the draft model carries a LoRA: train it with draft_lora=True")
            draft.train_all_weights()

    def on_policy_model(self):
        """The model on-policy data is sampled from: the draft itself (its LoRA active)."""
        return self.spec.heads.model

    @torch.no_grad()
    def _teacher(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The target's logits ``[B, T, V]`` (float), one forward without gradients."""
        target = self.spec.target
        outputs = target.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return target.logits(outputs.last_hidden_state).float()

    def micro_loss(self, heads, input_ids: torch.Tensor, attention_mask: torch.Tensor, indices: list[int],
                   step: int) -> tuple[torch.Tensor, list[float]]:
        losses, config = self.context.losses, self.config
        teacher = self._teacher(input_ids, attention_mask)
        with self.context.accelerator.autocast():
            student = heads(input_ids, attention_mask)  # (B, T, V)
        student = student.float()
        valid = attention_mask.bool()
        loss = losses.divergence(config.divergence, student, teacher, config.temperature, config.jsd_beta, valid)
        with torch.no_grad():
            agreement = float(losses.masked_mean((student.argmax(-1) == teacher.argmax(-1)).float(), valid))
        return loss, [agreement]

    def finish(self, accuracy: list[list[float]]) -> None:
        """Nothing to update: the draft's trees are grown from its own distribution."""

    @torch.no_grad()
    def rank_accuracy(self, max_rank: int = 10) -> list[list[float]]:
        """On held-out sequences: the share of positions where the target's greedy token is the
        draft's rank-r candidate, r < ``max_rank`` (one row: the draft's next-token ranks)."""
        heads = self.spec.heads
        counts, total = torch.zeros(max_rank), 0
        validation = self.context.validation_sequences
        for start in range(0, len(validation), 4):
            input_ids, attention_mask = self.context.collate(validation[start:start + 4])
            teacher = self._teacher(input_ids, attention_mask)
            student = heads(input_ids, attention_mask).float()
            valid = attention_mask.bool()
            ranked = student.topk(min(max_rank, student.shape[-1]), dim=-1).indices  # (B, T, R)
            hits = ranked == teacher.argmax(-1, keepdim=True)
            counts[:hits.shape[-1]] += hits[valid].float().sum(0).cpu()
            total += int(valid.sum())
        return [(counts / total).tolist()] if total else []
