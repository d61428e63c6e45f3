"""Self-distillation of a drafter against its frozen backbone, on accelerate.

One loop serves every drafter kind (:class:`DistillationTrainer`): each optimizer step takes
``batch_size`` sequences (the target's own continuations of prompts, or original text), and the
kind's **loss hook** runs one backbone forward over them without gradients (features and the
target's distribution at every position) and returns the loss. Only the drafter gets gradients and
optimizer state (the backbone is frozen). Warm-up + cosine schedule, gradient accumulation,
clipping, checkpoints with exact resume, on-policy mixing and a progress bar are shared.

The loss hook is the kind's ``loss`` in the registry (:mod:`heads.kinds`; e.g.
``heads/medusa/loss.py``, ``heads/eagle/loss.py``). ``heads`` never imports ``training``, so the
trainer hands the hook what it needs in a :class:`LossContext` (the divergences of
:mod:`training.losses` among it). The protocol, duck-typed::

    hook = kind.loss(context)      # ValueError for a TrainConfig the kind cannot train
    hook.description               # progress-bar label, e.g. "distilling heads"
    hook.prepare()                 # before the optimizer is built (e.g. EAGLE-3's draft vocabulary)
    hook.micro_loss(heads, input_ids, attention_mask, indices, step) -> (loss, agreement)
        # heads: the (possibly DDP-wrapped) drafter; input_ids, attention_mask [B, T] on the device;
        # indices: the sequences' keys (see DistillationTrainer.batch); step: the optimizer step;
        # loss: a scalar to back-propagate; agreement: per head (drafting step) top-1 agreement
    hook.rank_accuracy(max_rank=10, ...) -> [[float]]  # per head (step), per rank, held out
    hook.finish(accuracy)          # after training, with rank_accuracy()'s table (e.g. Medusa's tree)
    hook.on_policy_model()         # optional: the model that samples on-policy data itself (the draft
                                   # kind's draft model, DistillSpec) instead of speculative generation
    hook.swap_vocabulary(counts, limit) -> int  # optional, online learning (training/online.py): a
                                   # reduced draft vocabulary follows served traffic's token counts [V]

A hook that trains tensors of the backbone too (Medusa-2's LoRA, ``TrainConfig.joint``) adds three
optional methods; the trainer gives those tensors their own optimizer groups, clips their gradient
norm apart from the drafter's, averages their gradients over processes itself (they are outside
the DDP-wrapped drafter) and checkpoints them in ``backbone.safetensors``::

    hook.parameter_groups() -> [{"params": [...], "lr": ...}]  # the backbone's trainable tensors
    hook.backbone_state() -> {name: tensor}                     # for checkpoints
    hook.load_backbone_state(tensors)                           # on resume

On-policy data (DistillSpec): with ``on_policy_ratio > 0`` that share of every batch comes from a
pool of sequences that speculative generation with the *current* drafter produces from training
prompts at the serving temperature (:func:`training.on_policy.generate_on_policy_data`); the pool is
regenerated every ``on_policy_refresh`` steps. Both kinds of sequence go through the same
backbone forward and loss, so the target re-scores the contexts the drafter will visit.

Runs unchanged under ``accelerate launch`` (DDP): the global batch of a step is split across
processes and gradients are averaged; each process generates its share of the on-policy pool and
all processes gather the whole pool. Batches are a pure function of ``(seed, step)`` and the
pool, which checkpoints save, so a run resumed from a checkpoint sees exactly the batches an
uninterrupted run sees.

Checkpoints are safetensors and JSON only (:mod:`training.checkpoint`). Resuming refuses pickles
and a checkpoint written by another recipe, naming what changed; resuming a finished run trains
no further step and returns the recorded history.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import resource
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Sequence

import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from tqdm.auto import tqdm

from heads import kinds

from . import checkpoint, losses
from .config import TrainConfig
from .on_policy import generate_on_policy_data, sample_model_data
from .sequences import collate, load_sequences, save_sequences

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run did. The per-step lists cover the whole run from step 0: a resumed run's start
    with the checkpoint's history; ``seconds`` and ``tokens_per_second`` are this call's."""

    losses: list[float] = field(default_factory=list)
    agreement: list[list[float]] = field(default_factory=list)  # per step, per head (draft step) top-1 agreement
    accuracy: list[list[float]] = field(default_factory=list)  # per head (draft step), per rank (validation)
    tokens_per_second: float = 0.0
    peak_memory_mb: float = 0.0
    seconds: float = 0.0
    on_policy_refreshes: list[int] = field(default_factory=list)  # steps at which the pool was regenerated
    on_policy_tau: list[float] = field(default_factory=list)  # the drafter's tau while generating each pool
    start_step: int = 0  # the step this call started from (> 0 when resumed)

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


@dataclass(frozen=True)
class LossContext:
    """What a kind's loss hook gets from the trainer (see the module docstring for the protocol)."""

    spec: object
    """The ``heads.SpeculativeModel`` being trained: ``spec.heads`` (the drafter), ``spec.target``
    (the backbone's view: features, logits), ``spec.config`` (the kind's config)."""
    config: TrainConfig
    accelerator: Accelerator
    """For ``autocast()`` and ``unwrap_model``; its device is the batches' device."""
    losses: ModuleType
    """:mod:`training.losses`: ``divergence``, ``feature_regression``, ``masked_mean``,
    ``hard_cross_entropy``, ``head_loss_weights``."""
    train_sequences: list[torch.Tensor]
    validation_sequences: list[torch.Tensor]
    """Held-out 1D token sequences, for ``rank_accuracy``."""
    collate: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]
    """Sequences -> right-padded ``(input_ids, attention_mask)`` ``[B, T]`` on the accelerator's device."""
    backbone_memo: object | None = None
    """Online learning (:class:`training.replay.BackboneMemo`): where a hook knows its rows' keys it
    reads its backbone outputs through ``backbone_memo.outputs(keys, input_ids, attention_mask,
    compute)``, which computes only rows it does not hold. None (offline training): compute them."""
    validation_keys: list[int] | None = None
    """The keys of ``validation_sequences`` (for the memo), or None."""


class DistillationTrainer:
    """The training loop of every kind; the loss comes from the hook ``kinds.get(spec.kind).loss``
    builds (ValueError for a kind with nothing to train).

    Trains ``spec.heads`` against ``spec.backbone`` on token sequences ``[L]``; the last
    ``validation_fraction`` of them are held out for :meth:`rank_accuracy`. ``prompts`` (1D token
    ids of training prompts) feed on-policy generation and are needed when
    ``config.on_policy_ratio > 0``.
    """

    kind: str | None = None
    """Set on the classes of :func:`kind_trainer`: the one kind they accept (None: any)."""

    def __init__(self, spec, sequences: Sequence[torch.Tensor], config: TrainConfig, pad_id: int = 0,
                 checkpoint_dir: str | Path | None = None, progress: bool = True,
                 accelerator: Accelerator | None = None, prompts: Sequence[torch.Tensor] | None = None) -> None:
        if self.kind is not None and spec.kind != self.kind:
            raise ValueError(f"{type(self).__name__} trains kind {self.kind!r}; got a {spec.kind!r} drafter")
        make_hook = kinds.get(spec.kind).loss
        if make_hook is None:
            raise ValueError(f"kind {spec.kind!r} has nothing to train")
        if config.joint and not kinds.get(spec.kind).extra.get("joint_training"):
            joint = [name for name, kind in kinds.registry().items() if kind.extra.get("joint_training")]
            raise ValueError(f"joint training (a LoRA on the backbone) is for kind(s) {joint}, not {spec.kind!r}")
        if len(sequences) < 2:
            raise ValueError(f"need at least 2 training sequences; got {len(sequences)}")
        self.prompts = _check_prompts(prompts, config)
        self.backbone_parameters: list[torch.nn.Parameter] = []  # the hook's trainable backbone tensors
        self.pool: list[torch.Tensor] = []  # the on-policy sequences of the current refresh
        self.pool_refreshed_at = -1  # the step that generated them
        self.spec = spec
        self.config = config
        self.pad_id = pad_id
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.progress = progress
        self.accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision,
                                                      cpu=not torch.cuda.is_available())
        held_out = max(1, int(len(sequences) * config.validation_fraction))
        self.train_sequences = list(sequences[:-held_out])
        self.validation_sequences = list(sequences[-held_out:])
        world = self.accelerator.num_processes
        if config.batch_size % (world * config.gradient_accumulation):
            raise ValueError(
                f"batch_size {config.batch_size} must be divisible by processes ({world}) x "
                f"gradient_accumulation ({config.gradient_accumulation})"
            )
        self.hook = make_hook(LossContext(
            spec=spec, config=config, accelerator=self.accelerator, losses=losses,
            train_sequences=self.train_sequences, validation_sequences=self.validation_sequences,
            collate=self._collate))

    def rank_accuracy(self, max_rank: int = 10, **options) -> list[list[float]]:
        """The hook's held-out accuracy table: per head (drafting step), per rank ``< max_rank``."""
        return self.hook.rank_accuracy(max_rank, **options)

    def _collate(self, sequences: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = collate(list(sequences), self.pad_id)
        return input_ids.to(self.accelerator.device), attention_mask.to(self.accelerator.device)

    def batch(self, step: int) -> list[tuple[int, torch.Tensor]]:
        """The ``(key, sequence)`` pairs of optimizer step ``step``: ``batch_size - on_policy_count``
        training sequences (key: their index) and ``on_policy_count`` pool sequences (key:
        ``len(train_sequences)`` + pool index), in a seeded order. A pure function of the seed,
        the step and the pool."""
        config = self.config
        count = config.on_policy_count
        off = batch_indices(step, config.batch_size - count, len(self.train_sequences), config.seed)
        items = [(index, self.train_sequences[index]) for index in off]
        if count == 0:
            return items
        on = batch_indices(step - self.pool_refreshed_at, count, len(self.pool),
                           config.seed + 1 + self.pool_refreshed_at)
        items += [(len(self.train_sequences) + index, self.pool[index]) for index in on]
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(config.seed * 7919 + step))
        return [items[index] for index in order.tolist()]

    def refresh_pool(self, step: int) -> float:
        """Regenerate the on-policy pool with the current drafter at ``config.serving_temperature``;
        returns the drafter's tau while generating. A hook with ``on_policy_model()`` (the draft
        kind) has that model sample the pool itself, and the tau is the expected one at its
        measured acceptance (:func:`training.on_policy.sample_model_data`). Round
        ``r = step // on_policy_refresh`` takes the next ``on_policy_prompts`` training prompts in
        turn; each process generates a contiguous share and all gather the whole pool (each
        prompt's sequence is seeded by the round and its position)."""
        config, accelerator = self.config, self.accelerator
        round_index = step // config.on_policy_refresh
        chosen = [self.prompts[(round_index * config.on_policy_prompts + j) % len(self.prompts)]
                  for j in range(config.on_policy_prompts)]
        share = math.ceil(len(chosen) / accelerator.num_processes)
        first = accelerator.process_index * share
        settings = dict(max_new_tokens=config.on_policy_max_new_tokens, temperature=config.serving_temperature,
                        seed=config.seed * 100_003 + round_index, first_index=first)
        sample_from = getattr(self.hook, "on_policy_model", None)
        if sample_from is not None:  # a separate draft model samples itself (DistillSpec); tau: expected
            from heads.model import eos_token_ids

            data = sample_model_data(sample_from(), chosen[first:first + share], **settings,
                                     eos_token_ids=sorted(eos_token_ids(self.spec.backbone)),
                                     target=self.spec.backbone, depth=getattr(self.spec.config, "depth", 1))
        else:
            data = generate_on_policy_data(self.spec, chosen[first:first + share], **settings)
        parts = [(data.sequences, data.new_tokens, data.target_forwards)]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            parts = gather_object(parts)  # in process order, so the pool is the one-process pool
        self.pool = [sequence for sequences, _, _ in parts for sequence in sequences]
        self.pool_refreshed_at = step
        tau = sum(part[1] for part in parts) / max(1, sum(part[2] for part in parts))
        logger.info("step %d: on-policy pool of %d sequences at T=%g, drafter tau %.3f", step, len(self.pool),
                    config.serving_temperature, tau)
        return tau

    def _step(self, heads, items: list[tuple[int, torch.Tensor]], step: int) -> tuple[float, list[float], int]:
        """Forward and backward over one optimizer step's sequences (all accumulation micro-steps)."""
        config, accelerator = self.config, self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        micro = config.batch_size // (world * config.gradient_accumulation)
        step_loss, step_agreement, tokens = 0.0, None, 0
        for accumulation in range(config.gradient_accumulation):
            chunk = items[accumulation * micro * world:(accumulation + 1) * micro * world][rank::world]
            last = accumulation == config.gradient_accumulation - 1
            context = accelerator.no_sync(heads) if not last else nullcontext()
            with context:
                input_ids, attention_mask = self._collate([sequence for _, sequence in chunk])
                keys = [key for key, _ in chunk]
                loss, agreement = self.hook.micro_loss(heads, input_ids, attention_mask, keys, step)
                accelerator.backward(loss / config.gradient_accumulation)
            tokens += int(attention_mask.sum())
            step_loss += float(loss.detach()) / config.gradient_accumulation
            step_agreement = agreement if step_agreement is None else [
                a + b for a, b in zip(step_agreement, agreement)]
        return step_loss, [a / config.gradient_accumulation for a in step_agreement], tokens

    def train(self, resume: bool = False, stop_after: int | None = None) -> TrainResult:
        """Run to ``config.steps`` (or stop after step ``stop_after``, e.g. to test resuming).

        ``resume``: continue from the latest checkpoint under ``checkpoint_dir`` (CheckpointError
        when there is none, when it holds pickles or was written by another recipe); the result's
        per-step history then starts at step 0, the checkpoint's part included."""
        config, accelerator = self.config, self.accelerator
        torch.manual_seed(config.seed)
        self.spec.backbone.to(accelerator.device)
        self.spec.backbone.eval()
        self.hook.prepare()
        parameters = [p for p in self.spec.heads.parameters() if p.requires_grad]
        backbone_groups = self._backbone_groups()
        backbone_parameters = self.backbone_parameters = [p for group in backbone_groups for p in group["params"]]
        optimizer = torch.optim.AdamW([{"params": parameters}, *backbone_groups], lr=config.learning_rate,
                                      weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
        groups = clip_groups(self.hook, parameters)
        heads, optimizer = accelerator.prepare(self.spec.heads, optimizer)
        result = TrainResult()
        start_step = result.start_step = self._resume(heads, optimizer, scheduler, result) if resume else 0
        heads.train()
        end_step = config.steps if stop_after is None else min(stop_after, config.steps)
        bar = tqdm(range(start_step, end_step), disable=not (self.progress and accelerator.is_main_process),
                   desc=self.hook.description, initial=start_step, total=config.steps)
        tokens, started = 0, time.perf_counter()
        for step in bar:
            if config.on_policy_count and (not self.pool or step % config.on_policy_refresh == 0):
                result.on_policy_tau.append(self.refresh_pool(step))
                result.on_policy_refreshes.append(step)
            step_loss, step_agreement, count = self._step(heads, self.batch(step), step)
            tokens += count
            for group in groups:
                accelerator.clip_grad_norm_(group, config.max_grad_norm)
            self._reduce_backbone_gradients(backbone_parameters)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            mean_loss = float(accelerator.reduce(torch.tensor(step_loss, device=accelerator.device), "mean"))
            result.losses.append(mean_loss)
            result.agreement.append(step_agreement)
            bar.set_postfix(loss=f"{mean_loss:.3f}", top1="/".join(f"{a:.2f}" for a in step_agreement))
            if config.checkpoint_every and self.checkpoint_dir and (step + 1) % config.checkpoint_every == 0:
                self._save_checkpoint(step + 1, heads, optimizer, scheduler, result)
        bar.close()
        result.seconds = time.perf_counter() - started
        result.tokens_per_second = tokens * accelerator.num_processes / result.seconds if result.seconds else 0.0
        result.peak_memory_mb = _peak_memory_mb()
        self.spec.heads = accelerator.unwrap_model(heads)
        self.spec.heads.eval()
        result.accuracy = self.hook.rank_accuracy()
        self.hook.finish(result.accuracy)
        return result

    def _backbone_groups(self) -> list[dict]:
        """The hook's optimizer groups of backbone tensors (none for most hooks)."""
        groups = getattr(self.hook, "parameter_groups", None)
        return [dict(group, params=list(group["params"])) for group in groups()] if groups is not None else []

    def _reduce_backbone_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Average the backbone tensors' gradients over processes (they are outside the DDP-wrapped
        drafter) and clip their norm to ``max_grad_norm``, apart from the drafter's."""
        grads = [p for p in parameters if p.grad is not None]
        if not grads:
            return
        if self.accelerator.num_processes > 1:
            for parameter in grads:
                parameter.grad = self.accelerator.reduce(parameter.grad, "mean")
        torch.nn.utils.clip_grad_norm_(grads, self.config.max_grad_norm)

    def recipe(self) -> dict:
        """What a resumed run must share with the checkpoint (:func:`training.checkpoint.recipe`)."""
        return checkpoint.recipe(asdict(self.config), self.spec.kind, self.spec.config.to_dict(),
                                 self.accelerator.num_processes,
                                 checkpoint.sequences_sha256(self.train_sequences + self.validation_sequences))

    def _save_checkpoint(self, step: int, heads, optimizer, scheduler, result: TrainResult) -> None:
        """Write checkpoint ``step`` (see :mod:`training.checkpoint`) from every process."""
        accelerator = self.accelerator
        directory = checkpoint.step_directory(self.checkpoint_dir, step)
        drafter = {name: tensor.detach().to("cpu").contiguous().clone()
                   for name, tensor in accelerator.unwrap_model(heads).state_dict().items()}
        optimizer_tensors, optimizer_index = checkpoint.optimizer_tensors(optimizer.state_dict())
        state = {
            "format": checkpoint.FORMAT, "version": checkpoint.VERSION, "step": step, "recipe": self.recipe(),
            "scheduler": checkpoint.json_value(scheduler.state_dict(), "scheduler state"),
            "optimizer": optimizer_index,
            "on_policy_refreshed_at": self.pool_refreshed_at, "on_policy_sequences": len(self.pool),
            "history": {"losses": result.losses, "agreement": result.agreement,
                        "on_policy_refreshes": result.on_policy_refreshes, "on_policy_tau": result.on_policy_tau},
        }
        files = {
            checkpoint.DRAFTER_FILE: lambda path: save_file(drafter, str(path)),
            checkpoint.OPTIMIZER_FILE: lambda path: save_file(optimizer_tensors, str(path)),
            checkpoint.STATE_FILE: lambda path: path.write_text(json.dumps(state) + "\n"),
        }
        if self.pool:
            files[checkpoint.POOL_FILE] = lambda path: save_sequences(path, self.pool,
                                                                      {"refreshed_at": self.pool_refreshed_at})
        if self.backbone_parameters:
            backbone = {name: tensor.detach().to("cpu").contiguous().clone()
                        for name, tensor in self.hook.backbone_state().items()}
            files[checkpoint.BACKBONE_FILE] = lambda path: save_file(backbone, str(path))
        checkpoint.save(directory, accelerator.process_index, accelerator.is_main_process,
                        accelerator.wait_for_everyone, files)

    def _resume(self, heads, optimizer, scheduler, result: TrainResult) -> int:
        """Restore the latest checkpoint into the drafter, optimizer, scheduler, random states, pool
        and ``result``'s history; the step to continue from."""
        directory = checkpoint.latest_checkpoint(self.checkpoint_dir)
        state = checkpoint.read_state(directory)
        checkpoint.check_recipe(state, self.recipe(), directory)
        try:
            self.accelerator.unwrap_model(heads).load_state_dict(
                checkpoint.read_tensors(directory / checkpoint.DRAFTER_FILE), strict=True)
        except RuntimeError as error:
            raise checkpoint.CheckpointError(f"{directory}: not this drafter's tensors: {error}") from error
        if self.backbone_parameters:
            path = directory / checkpoint.BACKBONE_FILE
            try:
                self.hook.load_backbone_state(checkpoint.read_tensors(path))
            except ValueError as error:  # CheckpointError included
                raise checkpoint.CheckpointError(f"{path}: not this run's backbone tensors: {error}") from error
        optimizer.load_state_dict(checkpoint.optimizer_state(
            checkpoint.read_tensors(directory / checkpoint.OPTIMIZER_FILE), state["optimizer"],
            optimizer.state_dict(), directory))
        scheduler.load_state_dict(state["scheduler"])
        rng = directory / checkpoint.rng_file(self.accelerator.process_index)
        checkpoint.set_rng_state(rng)
        step = state["step"]
        history = state.get("history", {})
        for name in ("losses", "agreement", "on_policy_refreshes", "on_policy_tau"):
            setattr(result, name, list(history.get(name, [])))
        if self.config.on_policy_count and state.get("on_policy_sequences"):
            self.pool = load_sequences(directory / checkpoint.POOL_FILE, state["on_policy_sequences"])
            self.pool_refreshed_at = state["on_policy_refreshed_at"]
        elif self.config.on_policy_count and step % self.config.on_policy_refresh:
            logger.warning("checkpoint %s holds no on-policy pool: regenerating it at step %d (not exact)",
                           directory, step)
        logger.info("resumed from %s at step %d%s", directory, step,
                    " (the run had finished: no step left)" if step >= self.config.steps else "")
        return step


def clip_groups(hook, parameters: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The drafter's trainable tensors split into groups whose gradient norms are clipped apart
    (the hook's ``clip_groups``, e.g. EAGLE's parallel heads apart from the drafter, so that their
    large early gradients do not shrink the drafter's updates; one group by default)."""
    declared = getattr(hook, "clip_groups", None)
    groups = [[p for p in group if p.requires_grad] for group in declared()] if declared is not None else []
    covered = {id(p) for group in groups for p in group}
    rest = [p for p in parameters if id(p) not in covered]
    return [group for group in groups + [rest] if group]


def _check_prompts(prompts: Sequence[torch.Tensor] | None, config: TrainConfig) -> list[torch.Tensor]:
    """The on-policy prompts as a list of 1D tensors; an error if on-policy data cannot be made."""
    if config.on_policy_ratio and config.on_policy_count == 0:
        raise ValueError(f"on_policy_ratio {config.on_policy_ratio} x batch_size {config.batch_size} rounds to 0 "
                         "on-policy sequences per batch; raise the ratio or the batch size")
    prompts = list(prompts or [])
    for index, ids in enumerate(prompts):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prompts[{index}] must be a non-empty 1D tensor of token ids")
    if config.on_policy_count and not prompts:
        raise ValueError("on_policy_ratio > 0 needs prompts= (1D token ids of training prompts) to generate "
                         "on-policy data from")
    return prompts


@functools.cache
def kind_trainer(kind: str) -> type[DistillationTrainer]:
    """The :class:`DistillationTrainer` subclass that trains only drafters of ``kind`` (named after it,
    e.g. ``EagleTrainer``); :func:`make_trainer` builds one, so a caller can tell which it got."""
    name = kinds.get(kind).name
    class_name = f"{name.capitalize()}Trainer"
    return type(class_name, (DistillationTrainer,), {"kind": name, "__module__": __name__,
                                                     "__qualname__": class_name})


def make_trainer(spec, sequences: Sequence[torch.Tensor], config: TrainConfig, **options) -> DistillationTrainer:
    """The trainer of ``spec.kind`` with the kind's loss hook (``options``: those of
    :class:`DistillationTrainer`); ValueError for a kind that has nothing to train."""
    return kind_trainer(spec.kind)(spec, sequences, config, **options)


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
