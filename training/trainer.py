"""Self-distillation of a drafter against its frozen backbone, on accelerate.

One loop serves every drafter kind (:class:`DistillationTrainer`): each optimizer step takes
``batch_size`` sequences (the target's own continuations of prompts, or original text), runs
**one** backbone forward over them without gradients to get the features and the target's
distribution at every position, and asks the kind's loss hook (``micro_loss``) for the loss.
Only the drafter gets gradients and optimizer state (the backbone is frozen). Warm-up + cosine
schedule, gradient accumulation, clipping, checkpoints with exact resume and a progress bar are
shared; :func:`make_trainer` picks the trainer of ``spec.kind``.

:class:`MedusaTrainer` trains head ``k`` at position ``t`` towards the target's distribution for
token ``t + k + 2`` (the target's logits at ``t + k + 1``) with the chosen divergence at the
chosen temperature, weighted ``decay ** k`` (Medusa-1). The EAGLE loss lives in
:mod:`training.eagle_trainer`.

Runs unchanged under ``accelerate launch`` (DDP): the global batch of a step is split across
processes and gradients are averaged. Batches are a pure function of ``(seed, step)``, so a run
resumed from a checkpoint sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from torch import nn

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from .data import collate
from .losses import DIVERGENCES, divergence, hard_cross_entropy, head_loss_weights, masked_mean

logger = logging.getLogger(__name__)
_STATE_FILE = "trainer_state.json"


@dataclass
class TrainConfig:
    """Hyper-parameters of a distillation run (the recipe recorded in the adapter)."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 8
    """Sequences per optimizer step, over all processes and accumulation micro-steps."""
    gradient_accumulation: int = 1
    """Micro-steps per optimizer step (the per-process micro-batch is batch_size / (processes x this))."""
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    """Linear warm-up, then cosine decay to 0 at ``steps``."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"
    """"no" (fp32) or "bf16" (autocast)."""
    divergence: str = "fkl"
    """Divergence between head and target distributions: fkl, rkl, jsd, tvd or ce."""
    temperature: float = 1.0
    """Temperature of both distributions in the divergence (follow the serving temperature)."""
    jsd_beta: float = 0.5
    head_decay: float = 0.8
    """Loss weight of head k (Medusa) or of unrolled drafting step k + 1 (EAGLE) is head_decay ** k."""
    hard_label_weight: float = 0.0
    """Medusa: weight of plain cross-entropy to the target's tokens, added to the divergence."""
    feature_weight: float = 1.0
    """EAGLE: weight of the smooth-L1 regression of the next feature (EAGLE-1: 1.0)."""
    token_weight: float = 0.1
    """EAGLE: weight of the divergence between drafter and target token distributions (EAGLE-1: 0.1)."""
    feature_noise: float = 0.1
    """EAGLE: half-width a of the uniform noise U(-a, a) added to the drafter's input features."""
    unroll_steps: int = 1
    """EAGLE: drafting steps unrolled on the drafter's own predicted features (training-time test;
    1: teacher forcing only, as EAGLE-1)."""
    seed: int = 0
    checkpoint_every: int = 0
    """Save a resumable checkpoint every N steps (0: never)."""
    validation_fraction: float = 0.05
    """Share of sequences held out to measure per-head, per-rank accuracy (which shapes the tree)."""

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}; got {self.divergence!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; got {self.temperature!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision must be 'no' or 'bf16'; got {self.mixed_precision!r}")
        for name in ("steps", "batch_size", "gradient_accumulation", "unroll_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        for name in ("feature_weight", "token_weight", "feature_noise", "hard_label_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0; got {value!r}")
        if self.feature_weight == 0 and self.token_weight == 0:
            raise ValueError("feature_weight and token_weight are both 0: the EAGLE loss would be empty")


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    agreement: list[list[float]] = field(default_factory=list)  # per step, per head (draft step) top-1 agreement
    accuracy: list[list[float]] = field(default_factory=list)  # per head (draft step), per rank (validation)
    tokens_per_second: float = 0.0
    peak_memory_mb: float = 0.0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _schedule(config: TrainConfig):
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def batch_indices(step: int, batch_size: int, count: int, seed: int) -> list[int]:
    """Sequence indices of optimizer step ``step``: epochs of seeded permutations, no state."""
    indices = []
    position = step * batch_size
    while len(indices) < batch_size:
        epoch, offset = divmod(position, count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        take = min(batch_size - len(indices), count - offset)
        indices.extend(order[offset:offset + take].tolist())
        position += take
    return indices


def head_losses(head_logits: torch.Tensor, teacher_logits: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, config: TrainConfig) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over heads and each head's top-1 agreement with the target.

    ``head_logits`` ``[K, B, T, V]``, ``teacher_logits`` ``[B, T, V]``: head k at t against the
    target at t + k + 1 (both predict token t + k + 2).
    """
    weights = head_loss_weights(head_logits.shape[0], config.head_decay)
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
        loss = divergence(config.divergence, student, teacher, config.temperature, config.jsd_beta, valid)
        if config.hard_label_weight and length > shift + 1:
            labels = input_ids[:, shift + 1:].masked_fill(~attention_mask[:, shift + 1:].bool(), -100)
            hard = hard_cross_entropy(student[:, :-1], labels)
            loss = loss + config.hard_label_weight * masked_mean(hard, labels != -100)
        total = total + weight * loss
        with torch.no_grad():
            agree = (student.argmax(-1) == teacher.argmax(-1)).float()
            agreement.append(float(masked_mean(agree, valid)))
    return total, agreement


class DistillationTrainer(ABC):
    """The shared loop; subclasses supply the loss (:meth:`micro_loss`) and optional hooks
    :meth:`prepare` (before the optimizer is built) and :meth:`finish` (after the last step).

    Trains ``spec.heads`` against ``spec.backbone`` on token sequences ``[L]``; the last
    ``validation_fraction`` of them are held out for :meth:`finish`.
    """

    description = "distilling drafter"

    def __init__(self, spec, sequences: Sequence[torch.Tensor], config: TrainConfig, pad_id: int = 0,
                 checkpoint_dir: str | Path | None = None, progress: bool = True,
                 accelerator: Accelerator | None = None) -> None:
        if len(sequences) < 2:
            raise ValueError(f"need at least 2 training sequences; got {len(sequences)}")
        self.spec = spec
        self.config = config
        self.pad_id = pad_id
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.progress = progress
        self.accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available())
        held_out = max(1, int(len(sequences) * config.validation_fraction))
        self.train_sequences = list(sequences[:-held_out])
        self.validation_sequences = list(sequences[-held_out:])
        world = self.accelerator.num_processes
        if config.batch_size % (world * config.gradient_accumulation):
            raise ValueError(
                f"batch_size {config.batch_size} must be divisible by processes ({world}) x "
                f"gradient_accumulation ({config.gradient_accumulation})"
            )

    def prepare(self) -> None:
        """Hook: set up the drafter from the training data before the optimizer is built."""

    @abstractmethod
    def micro_loss(self, heads: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   indices: list[int], step: int) -> tuple[torch.Tensor, list[float]]:
        """Hook: loss of one micro-batch ``[B, T]`` (sequences ``indices`` of optimizer step ``step``)
        and the per-head (per-step) top-1 agreement with the target."""

    def finish(self, result: TrainResult) -> None:
        """Hook: after training (``spec.heads`` unwrapped and in eval mode)."""

    def _collate(self, sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = collate(list(sequences), self.pad_id)
        return input_ids.to(self.accelerator.device), attention_mask.to(self.accelerator.device)

    def _step(self, heads, indices: list[int], step: int) -> tuple[float, list[float], int]:
        """Forward and backward over one optimizer step's sequences (all accumulation micro-steps)."""
        config, accelerator = self.config, self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        micro = config.batch_size // (world * config.gradient_accumulation)
        step_loss, step_agreement, tokens = 0.0, None, 0
        for accumulation in range(config.gradient_accumulation):
            chunk = indices[accumulation * micro * world:(accumulation + 1) * micro * world][rank::world]
            last = accumulation == config.gradient_accumulation - 1
            context = accelerator.no_sync(heads) if not last else nullcontext()
            with context:
                input_ids, attention_mask = self._collate([self.train_sequences[i] for i in chunk])
                loss, agreement = self.micro_loss(heads, input_ids, attention_mask, chunk, step)
                accelerator.backward(loss / config.gradient_accumulation)
            tokens += int(attention_mask.sum())
            step_loss += float(loss.detach()) / config.gradient_accumulation
            step_agreement = agreement if step_agreement is None else [
                a + b for a, b in zip(step_agreement, agreement)]
        return step_loss, [a / config.gradient_accumulation for a in step_agreement], tokens

    def train(self, resume: bool = False, stop_after: int | None = None) -> TrainResult:
        """Run to ``config.steps`` (or stop after step ``stop_after``, e.g. to test resuming)."""
        config, accelerator = self.config, self.accelerator
        torch.manual_seed(config.seed)
        self.spec.backbone.to(accelerator.device)
        self.spec.backbone.eval()
        self.prepare()
        parameters = [p for p in self.spec.heads.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
        heads, optimizer = accelerator.prepare(self.spec.heads, optimizer)
        accelerator.register_for_checkpointing(scheduler)
        start_step = self._resume() if resume else 0
        heads.train()
        result = TrainResult()
        end_step = config.steps if stop_after is None else min(stop_after, config.steps)
        bar = tqdm(range(start_step, end_step), disable=not (self.progress and accelerator.is_main_process),
                   desc=self.description, initial=start_step, total=config.steps)
        tokens, started = 0, time.perf_counter()
        for step in bar:
            indices = batch_indices(step, config.batch_size, len(self.train_sequences), config.seed)
            step_loss, step_agreement, count = self._step(heads, indices, step)
            tokens += count
            accelerator.clip_grad_norm_(parameters, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = float(accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), "mean"))
            result.losses.append(mean_loss)
            result.agreement.append(step_agreement)
            bar.set_postfix(loss=f"{mean_loss:.3f}", top1="/".join(f"{a:.2f}" for a in step_agreement))
            if config.checkpoint_every and self.checkpoint_dir and (step + 1) % config.checkpoint_every == 0:
                self._save_checkpoint(step + 1)
        bar.close()
        result.seconds = time.perf_counter() - started
        result.tokens_per_second = tokens * accelerator.num_processes / result.seconds if result.seconds else 0.0
        result.peak_memory_mb = _peak_memory_mb()
        self.spec.heads = accelerator.unwrap_model(heads)
        self.spec.heads.eval()
        self.finish(result)
        return result

    def _save_checkpoint(self, step: int) -> None:
        directory = self.checkpoint_dir / f"step-{step:07d}"
        self.accelerator.save_state(str(directory))
        if self.accelerator.is_main_process:
            (directory / _STATE_FILE).write_text(json.dumps({"step": step, "config": asdict(self.config)}))
            (self.checkpoint_dir / "latest").write_text(directory.name)
        self.accelerator.wait_for_everyone()

    def _resume(self) -> int:
        if self.checkpoint_dir is None or not (self.checkpoint_dir / "latest").is_file():
            raise FileNotFoundError(f"resume: no checkpoint under {self.checkpoint_dir}")
        directory = self.checkpoint_dir / (self.checkpoint_dir / "latest").read_text().strip()
        self.accelerator.load_state(str(directory))
        step = json.loads((directory / _STATE_FILE).read_text())["step"]
        logger.info("resumed from %s at step %d", directory, step)
        return step


class MedusaTrainer(DistillationTrainer):
    """Distils Medusa heads; afterwards measures per-head, per-rank accuracy on held-out
    sequences and rebuilds the default tree from it."""

    description = "distilling heads"

    def _features_and_teacher(self, input_ids, attention_mask):
        target = self.spec.target
        with torch.no_grad():
            outputs = target.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            features = outputs.last_hidden_state
            teacher = target.logits(features).float()
        return features, teacher

    def micro_loss(self, heads, input_ids, attention_mask, indices, step):
        features, teacher = self._features_and_teacher(input_ids, attention_mask)
        shared = self.spec.shared_logits if self.spec.config.share_lm_head else None
        with self.accelerator.autocast():
            head_logits = heads(features, shared)
        return head_losses(head_logits.float(), teacher, input_ids, attention_mask, self.config)

    def finish(self, result: TrainResult) -> None:
        result.accuracy = self.rank_accuracy()
        self.spec.accuracy = result.accuracy
        self.spec.set_tree(None)

    @torch.no_grad()
    def rank_accuracy(self, max_rank: int = 10) -> list[list[float]]:
        """On held-out sequences: per head, the share of positions where the target's token is
        the head's rank-r candidate, r < ``max_rank`` (the table default trees are built from)."""
        heads = self.spec.heads
        counts = None
        total = 0
        shared = self.spec.shared_logits if self.spec.config.share_lm_head else None
        for start in range(0, len(self.validation_sequences), 4):
            input_ids, attention_mask = self._collate(self.validation_sequences[start:start + 4])
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


def make_trainer(spec, sequences: Sequence[torch.Tensor], config: TrainConfig, **options) -> DistillationTrainer:
    """The trainer for ``spec.kind`` (``options``: those of :class:`DistillationTrainer`)."""
    if spec.kind == "medusa":
        return MedusaTrainer(spec, sequences, config, **options)
    if spec.kind == "eagle":
        from .eagle_trainer import EagleTrainer

        return EagleTrainer(spec, sequences, config, **options)
    raise ValueError(f"no trainer for drafter kind {spec.kind!r}")


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
