"""Online self-distillation while serving: a trained drafter keeps learning from the traffic it serves.

    learner = training.online.learn(spec, budget=0.05)   # spec.learning: every generate call feeds it
    spec.generate(...)                                   # then learns for <= 5% of the call's time
    learner.pause(); learner.resume(); learner.step(seconds=2.0)
    training.online.learn(spec, False)                   # off
    spec.save_pretrained("refined/")                     # the refined adapter, its recipe says so

After each ``generate`` call the rows' whole sequences (prompt + committed output: under greedy
decoding the target's own argmax continuation, sampled: a sample of the target's distribution) enter
a bounded :class:`~training.replay.ReplayBuffer`. Learning is the offline trainer's, per kind: the
kind's **loss hook** (``kinds.get(kind).loss``, what :class:`training.trainer.DistillationTrainer`
calls) runs one backbone forward without gradients over a batch of buffered sequences and scores
the drafter against the target's distribution at every position, with the objective the adapter
was trained with (its recorded ``TrainConfig``); AdamW at a constant rate updates the drafter's
trainable tensors only. The backbone is never changed.

**Budget.** Each call earns ``budget`` times its own wall-clock seconds; an update runs while the
earned credit is positive and its cost is paid from it (an update that costs more than the credit
leaves a debt that later calls repay), so learning takes at most ``budget`` of serving time over a
stream, give or take one update. Learning runs synchronously at the end of ``generate``, under the
spec's lock: outputs are final before any weight changes, and a call never drafts with half-updated
weights. :meth:`OnlineLearner.step` spends time explicitly (between requests) whatever the credit.

**Guard.** One sequence in ``hold_every`` is held back from training in a small pool of recent
traffic. An update is ``steps_per_update`` optimizer steps; before keeping it, the drafter's
acceptance proxy on the held-back pool (:func:`expected_acceptance`: the expected accepted length of a
default tree built from its per-depth, per-rank top-k accuracy, the hook's ``rank_accuracy``) is
compared with the proxy before the update; if it fell by more than ``tolerance``, the drafter's weights
and the optimizer's state are restored. Kept and rolled-back updates are counted (:meth:`summary`).

**Tree.** A kind whose tree is shaped by measured accuracies (Medusa's default trees) gets the
held-back pool's accuracy table after each kept update (the hook's ``finish``, as after offline
training); a tree chosen with ``spec.set_tree`` stays chosen.

Kinds: every kind whose loss hook trains the drafter it was given (Medusa, EAGLE). Lookup learns from
history already and has nothing to train; the draft kind's hook makes its model trainable in
``prepare``, which re-initialises Medusa's and EAGLE's drafters, so the online learner (which never
calls ``prepare``) refuses it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace

import torch

from heads import kinds
from heads.fingerprint import state_fingerprint
from tree_attention.tree import best_first_choices

from . import losses
from .config import TrainConfig
from .replay import BackboneMemo, ReplayBuffer
from .sequences import collate
from .trainer import LossContext, clip_groups

logger = logging.getLogger(__name__)

GUARD_TREE = 16
"""Drafted nodes of the default tree whose expected acceptance the guard compares (the default tree size)."""
GUARD_RANKS = 10
"""Ranks per depth the guard measures (what the offline trainer's accuracy table holds)."""
SERVED_WINDOW = 50
"""Greedy calls whose acceptance a saved adapter records as its ``served`` entry."""
RATE_BACKOFF = 0.5
"""The learning rate is multiplied by this after a rolled-back update (the steps were too large to help)."""
RATE_RECOVERY = 1.25
"""... and by this after a kept one, up to ``OnlineConfig.learning_rate``."""
RATE_FLOOR = 1 / 3
"""The rate's floor as a share of ``OnlineConfig.learning_rate`` (unless ``min_learning_rate`` sets it): the
guard judges each update on a small pool, so a run of rollbacks may be noise, and a rate halved after each
of them could end too small to learn what the traffic still has to teach."""


@dataclass
class OnlineConfig:
    """Settings of online learning (:func:`learn`'s keywords)."""

    budget: float = 0.05
    """Learning seconds earned per second of ``generate`` (0.05: at most 5% of serving time)."""
    buffer_tokens: int = 65_536
    """Bound of the training pool, in tokens (oldest sequences dropped first)."""
    max_length: int = 256
    """Tokens kept per sequence (its first ones), as ``selfdraft train --max-length``."""
    batch_size: int = 8
    """Sequences per optimizer step (``selfdraft train``'s default)."""
    steps_per_update: int = 4
    """Optimizer steps between two guard checks (one update, kept or rolled back whole)."""
    learning_rate: float = 3e-3
    """AdamW's first and largest rate (about a third of ``selfdraft train``'s peak for Medusa and EAGLE); the rate
    follows the guard: :data:`RATE_BACKOFF` after a rolled-back update, :data:`RATE_RECOVERY` after a kept one."""
    min_learning_rate: float | None = None
    """The rate never falls below this (None: :data:`RATE_FLOOR` x ``learning_rate``)."""
    held_out: int = 16
    """Sequences in the guard's held-back pool (the most recent held-back ones). Fewer make the guard
    cheaper and its measurement noisier."""
    hold_every: int = 4
    """One served sequence in this many is held back for the guard (never trained on)."""
    tolerance: float = 0.0
    """An update is rolled back when the guard's proxy falls by more than this (tokens per step)."""
    refresh_tree: bool = True
    """After a kept update, let the kind reshape its default tree from the held-back accuracies."""
    backbone_cache_mb: int = 256
    """Bound of the memo of the backbone's outputs per buffered sequence (MiB; 0: none): a sequence's
    backbone forward runs the first time it is drawn, its features serve every later draw."""
    vocabulary_swaps: int = 64
    """Draft-vocabulary tokens an update may swap for tokens frequent in the buffered traffic that the
    drafter cannot draft (kinds with a reduced draft vocabulary; 0: the vocabulary stays)."""
    seed: int = 0

    def attach(self, spec) -> "OnlineLearner":
        """The learner of ``spec`` with these settings (what ``spec.learn(settings)``, ``heads.load_heads(...,
        learn=settings)`` and ``heads.attach_heads(..., learn=settings)`` call)."""
        return OnlineLearner(spec, self)

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not self.budget >= 0:
            raise ValueError(f"budget must be a number >= 0 (learning seconds per served second); got {self.budget!r}")
        if isinstance(self.vocabulary_swaps, bool) or not isinstance(self.vocabulary_swaps, int) \
                or self.vocabulary_swaps < 0:
            raise ValueError(f"vocabulary_swaps must be an int >= 0; got {self.vocabulary_swaps!r}")
        if isinstance(self.backbone_cache_mb, bool) or not isinstance(self.backbone_cache_mb, int) \
                or self.backbone_cache_mb < 0:
            raise ValueError(f"backbone_cache_mb must be an int >= 0 (MiB); got {self.backbone_cache_mb!r}")
        for name in ("buffer_tokens", "max_length", "batch_size", "steps_per_update", "hold_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (2 if name == "max_length" else 1):
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if isinstance(self.held_out, bool) or not isinstance(self.held_out, int) or self.held_out < 1:
            raise ValueError(f"held_out must be an int >= 1 (the guard needs held-back traffic); got {self.held_out!r}")
        if self.buffer_tokens < self.max_length:
            raise ValueError(f"buffer_tokens ({self.buffer_tokens}) must be >= max_length ({self.max_length})")
        if isinstance(self.learning_rate, bool) or not isinstance(self.learning_rate, (int, float)) \
                or not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be a number > 0; got {self.learning_rate!r}")
        if self.min_learning_rate is not None and (
                isinstance(self.min_learning_rate, bool) or not isinstance(self.min_learning_rate, (int, float))
                or not 0 < self.min_learning_rate <= self.learning_rate):
            raise ValueError(f"min_learning_rate must be None (a third of learning_rate) or a number in "
                             f"(0, learning_rate]; got {self.min_learning_rate!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or self.tolerance < 0:
            raise ValueError(f"tolerance must be a number >= 0; got {self.tolerance!r}")


def expected_acceptance(accuracy: list[list[float]], size: int = GUARD_TREE) -> float:
    """Drafted tokens a step accepts on average with the default tree of ``size`` nodes built from
    ``accuracy`` (per depth, per rank: the share of positions whose target token is that rank), if
    depths were independent: the sum over the tree's nodes of the product of their path's accuracies."""
    if not accuracy:
        return 0.0
    total = 0.0
    for path in best_first_choices(accuracy, size):
        total += math.prod(accuracy[depth][rank] for depth, rank in enumerate(path))
    return total


class LocalAccelerator:
    """What a loss hook uses of ``accelerate.Accelerator`` (``autocast``, ``unwrap_model``, ``device``), for
    steps in the serving process: one process, the drafter's own dtype, nothing moved or wrapped."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def autocast(self):
        return nullcontext()

    def unwrap_model(self, model):
        return model


def recorded_config(spec) -> TrainConfig:
    """The ``TrainConfig`` the adapter recorded (``spec.metadata["training"]["config"]``; defaults for
    what it does not record), for online steps: no joint LoRA, no on-policy data."""
    recorded = dict(spec.metadata.get("training", {}).get("config", {}) or {})
    known = {field.name for field in fields(TrainConfig)}
    values = {name: value for name, value in recorded.items() if name in known}
    if isinstance(values.get("lora_targets"), list):
        values["lora_targets"] = tuple(values["lora_targets"])
    try:
        config = TrainConfig(**values)
    except (TypeError, ValueError) as error:
        logger.warning("the adapter's recorded training config is unusable (%s): online learning uses the defaults",
                       error)
        config = TrainConfig()
    return replace(config, joint=False, on_policy_ratio=0.0, checkpoint_every=0, draft_lora=False)


class OnlineLearner:
    """Learns ``spec``'s drafter from the calls it serves (see the module docstring); ``spec.learning``."""

    def __init__(self, spec, config: OnlineConfig) -> None:
        entry = kinds.get(spec.kind)
        if entry.loss is None:
            raise ValueError(f"a {spec.kind!r} drafter has nothing to train online (lookup already learns from the "
                             "requests it serves through its history)")
        if entry.save is not None:
            raise ValueError(f"online learning does not train {spec.kind!r} drafters: their training hook makes the "
                             "model trainable in prepare(), which would also re-initialise other kinds' drafters")
        self.spec = spec
        self.config = config
        self.train_config = recorded_config(spec)
        self.buffer = ReplayBuffer(config.buffer_tokens, config.max_length, config.held_out, config.hold_every)
        self._train_view: list[torch.Tensor] = []  # what the hook sees as training / validation sequences
        self._held_view: list[torch.Tensor] = []
        self._held_keys: list[int] = []
        self.memo = BackboneMemo(config.backbone_cache_mb * 2 ** 20) if config.backbone_cache_mb else None
        self.hook = entry.loss(LossContext(
            spec=spec, config=self.train_config, accelerator=LocalAccelerator(spec.target.device), losses=losses,
            train_sequences=self._train_view, validation_sequences=self._held_view, collate=self._collate,
            backbone_memo=self.memo, validation_keys=self._held_keys))
        self.parameters = [p for p in spec.heads.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError(f"this {spec.kind!r} drafter has no trainable tensors")
        self.clip_groups = clip_groups(self.hook, self.parameters)
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate,
                                           weight_decay=self.train_config.weight_decay)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.start = {"adapter": spec.metadata.get("directory"),
                      "sha256": state_fingerprint({k: v.detach().cpu() for k, v in spec.heads.state_dict().items()})}
        self.paused = False
        self.credit = 0.0
        self.steps = self.kept = self.rolled_back = self.swapped = 0
        self.rate = config.learning_rate  # AdamW's rate now (follows the guard)
        self.swap_limit = config.vocabulary_swaps  # tokens the next update may swap (follows the guard)
        self.trained_tokens = 0  # tokens of the batches of kept updates
        self.seconds = 0.0  # spent learning
        self.guard_seconds = 0.0  # of which measuring the held-back pool
        self.served_seconds = 0.0
        self.last_proxy: tuple[float, float] | None = None  # (before, after) of the last update
        self._baseline: tuple[int, float, list] | None = None  # (held-back pool version, proxy, table) now
        self._served: deque[tuple] = deque(maxlen=SERVED_WINDOW)

    # ---- serving side -------------------------------------------------------------------------

    def observe(self, call) -> None:
        """A finished ``generate`` call (:class:`heads.model.ServedCall`): buffer its rows, earn
        ``budget`` x its seconds and learn while the credit lasts (unless paused)."""
        for sequence in call.sequences():
            self.buffer.add(sequence)
        if self.memo is not None and self.memo.rows:  # sequences the buffer dropped are never drawn again
            self.memo.retain([key for key, _ in self.buffer.train] + [key for key, _ in self.buffer.held])
        if call.greedy:
            stats = call.stats
            self._served.append((stats.new_tokens, stats.row_forwards, len(stats.accepted_lengths),
                                 list(stats.acceptance_by_position), stats.batch_size))
        self.served_seconds += call.seconds
        if self.paused:
            return
        self.credit += self.config.budget * call.seconds
        while self.credit > 0 and self.ready:
            self.credit -= self._timed_update()

    @property
    def ready(self) -> bool:
        """Enough traffic to train on (a batch) and to guard with (a held-back sequence)."""
        return len(self.buffer.train) >= min(2, self.config.batch_size) and len(self.buffer.held) > 0

    def pause(self) -> None:
        """Stop learning after calls (sequences are still buffered; :meth:`step` still learns)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def step(self, seconds: float | None = None, updates: int | None = None) -> int:
        """Learn now, between requests: updates until ``seconds`` have been spent or ``updates`` made
        (the first of the two given; at least one is required). Returns the updates made (0 while
        the buffer is not :attr:`ready`). Takes the spec's lock, so it never runs inside a call."""
        if seconds is None and updates is None:
            raise ValueError("step() needs seconds= or updates=")
        made, spent = 0, 0.0
        with self.spec.locked():
            while self.ready and (updates is None or made < updates) and (seconds is None or spent < seconds):
                spent += self._timed_update()
                made += 1
        return made

    # ---- learning -----------------------------------------------------------------------------

    def _timed_update(self) -> float:
        started = time.perf_counter()
        self._update()
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        return elapsed

    def _update(self) -> None:
        """``steps_per_update`` optimizer steps, kept when the guard's proxy did not fall."""
        before, _ = self._current_proxy()
        snapshot = self._snapshot()
        swapped = self._swap_vocabulary()
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate
        tokens = sum(self._optimizer_step() for _ in range(self.config.steps_per_update))
        after, table = self._measure()
        self.last_proxy = (before, after)
        if after >= before - self.config.tolerance:
            self.kept += 1
            self.steps += self.config.steps_per_update
            self.trained_tokens += tokens
            self.swapped += swapped
            self.rate = min(self.config.learning_rate, self.rate * RATE_RECOVERY)
            self.swap_limit = self.config.vocabulary_swaps
            self._baseline = (self.buffer.held_version, after, table)
            if self.config.refresh_tree and table:
                choice = self.spec.tree_choice
                self.hook.finish(table)  # e.g. Medusa: the default tree from the new accuracies
                if self.spec.tree_choice != choice:
                    self.spec.set_tree(choice)
        else:
            self.rolled_back += 1
            self._restore(snapshot)
            floor = self.config.min_learning_rate
            self.rate = max(self.config.learning_rate * RATE_FLOOR if floor is None else floor, self.rate * RATE_BACKOFF)
            if swapped:  # the swap may be what hurt: the next update tries half as many
                self.swap_limit //= 2
            logger.info("online update rolled back: held-back acceptance proxy %.3f -> %.3f", before, after)

    def _swap_vocabulary(self) -> int:
        """Let the kind's draft vocabulary follow the buffered traffic (its hook's ``swap_vocabulary``, if
        any). The optimizer's moments restart where the swap changed a tensor (the swapped tokens' rows,
        restarted themselves) and nowhere else: restarting them all would make Adam's next step move every
        weight by about the full rate at once."""
        swap = getattr(self.hook, "swap_vocabulary", None)
        if swap is None or not self.swap_limit:
            return 0
        vocab = self.spec.target.vocab_size
        counts = torch.zeros(vocab, dtype=torch.long)
        for _, sequence in self.buffer.train:
            counts += torch.bincount(sequence[1:], minlength=vocab)[:vocab]
        before = [parameter.detach().clone() for parameter in self.parameters]
        swapped = swap(counts, self.swap_limit)
        if swapped:
            for parameter, previous in zip(self.parameters, before):
                state = self.optimizer.state.get(parameter)
                if not state:
                    continue
                changed = parameter.detach() != previous  # same shape as the parameter
                for moment in ("exp_avg", "exp_avg_sq"):
                    if isinstance(state.get(moment), torch.Tensor):
                        state[moment].masked_fill_(changed, 0.0)
        return swapped

    def _current_proxy(self) -> tuple[float, list]:
        """The proxy of the current weights on the current held-back pool (measured again when the pool changed)."""
        if self._baseline is None or self._baseline[0] != self.buffer.held_version:
            proxy, table = self._measure()
            self._baseline = (self.buffer.held_version, proxy, table)
        return self._baseline[1], self._baseline[2]

    def _measure(self) -> tuple[float, list]:
        """The guard's proxy and the accuracy table (per depth, per rank) on the held-back pool."""
        started = time.perf_counter()
        self._held_view[:] = self.buffer.held_sequences()
        self._held_keys[:] = [key for key, _ in self.buffer.held]
        heads = self.spec.heads
        was_training = heads.training
        heads.eval()
        try:
            table = self.hook.rank_accuracy(GUARD_RANKS)
        finally:
            heads.train(was_training)
        self.guard_seconds += time.perf_counter() - started
        return expected_acceptance(table), table

    def _optimizer_step(self) -> int:
        """One AdamW step on a batch of buffered sequences; the batch's tokens."""
        batch = self.buffer.sample(self.config.batch_size, self.generator)
        keys, sequences = [key for key, _ in batch], [sequence for _, sequence in batch]
        self._train_view[:] = sequences
        input_ids, attention_mask = self._collate(sequences)
        heads = self.spec.heads
        was_training = heads.training
        heads.train()
        try:
            with torch.enable_grad():
                loss, _ = self.hook.micro_loss(heads, input_ids, attention_mask, keys, self.steps)
                loss.backward()
            for group in self.clip_groups:
                torch.nn.utils.clip_grad_norm_(group, self.train_config.max_grad_norm)
            self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            heads.train(was_training)
        return int(attention_mask.sum())

    def _collate(self, sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``(input_ids, attention_mask)`` ``[B, T]`` on the backbone's device."""
        input_ids, attention_mask = collate(list(sequences), 0)
        return input_ids.to(self.spec.target.device), attention_mask.to(self.spec.target.device)

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """The drafter's tensors (a draft vocabulary's ``token_map`` too) and the optimizer's state."""
        tensors = {name: tensor.detach().clone() for name, tensor in self.spec.heads.state_dict().items()}
        states = [{key: value.clone() if isinstance(value, torch.Tensor) else value
                   for key, value in self.optimizer.state.get(parameter, {}).items()} for parameter in self.parameters]
        return tensors, states

    def _restore(self, snapshot: tuple[dict[str, torch.Tensor], list[dict]]) -> None:
        """The drafter's tensors and the optimizer's state of ``snapshot``, copied in place (the drafter's
        caches keyed on tensor versions notice it)."""
        tensors, states = snapshot
        self.spec.heads.load_state_dict(tensors, strict=True)
        self.optimizer.state.clear()
        for parameter, state in zip(self.parameters, states):
            if state:
                self.optimizer.state[parameter] = state

    # ---- what it did --------------------------------------------------------------------------

    def summary(self) -> dict:
        """Counts so far: updates kept / rolled back, optimizer steps kept, tokens, seconds, buffer."""
        return {
            "paused": self.paused, "updates_kept": self.kept, "updates_rolled_back": self.rolled_back,
            "steps": self.steps, "vocabulary_swapped": self.swapped, "trained_tokens": self.trained_tokens,
            "learning_rate": self.rate,
            "sequences_seen": self.buffer.seen, "tokens_seen": self.buffer.seen_tokens,
            "buffer_tokens": self.buffer.tokens, "buffer_sequences": len(self.buffer.train),
            "held_out_sequences": len(self.buffer.held), "learning_seconds": self.seconds,
            "guard_seconds": self.guard_seconds, "served_seconds": self.served_seconds, "credit_seconds": self.credit,
            "backbone_memo_bytes": self.memo.bytes if self.memo is not None else 0,
            "last_proxy": self.last_proxy,
        }

    def served_acceptance(self) -> dict | None:
        """The acceptance of the last :data:`SERVED_WINDOW` greedy calls, as an adapter's acceptance entry."""
        if not self._served:
            return None
        new = sum(item[0] for item in self._served)
        forwards = sum(item[1] for item in self._served)
        rows = sum(item[4] for item in self._served)
        steps = sum(item[2] for item in self._served)
        depth = max(len(item[3]) for item in self._served)
        survival = [sum(item[2] * (item[3][i] if i < len(item[3]) else 0.0) for item in self._served) / steps
                    if steps else 0.0 for i in range(depth)]  # each call's P(accepted >= i + 1), by its steps
        return {"tau": new / forwards if forwards else 0.0, "acceptance_by_position": survival,
                "prefix_survival": survival, "prompts": rows, "max_new_tokens": max(1, round(new / max(1, rows))),
                "split": "served"}

    def recipe(self) -> dict:
        """The ``training.online`` entry of a saved adapter: it was refined online, from which adapter,
        on how much traffic, with how many steps kept and updates rolled back."""
        return {"refined_online": True, "from": dict(self.start), **{k: v for k, v in self.summary().items()
                                                                    if k not in ("paused", "last_proxy",
                                                                                 "credit_seconds",
                                                                                 "backbone_memo_bytes")},
                "settings": asdict(self.config), "objective": self.train_config.divergence}

    def adapter_metadata(self) -> dict:
        """``save_pretrained`` metadata once an update was kept: the recipe with this refinement appended
        to ``training.online``; acceptance: the served window's entry (``served``) instead of figures
        measured before the drafter changed. {} while nothing was kept (the adapter is unchanged)."""
        if not self.kept:
            return {}
        training = dict(self.spec.metadata.get("training", {}))
        training["online"] = list(training.get("online", [])) + [self.recipe()]
        served = self.served_acceptance()
        return {"training": training, **({"acceptance": {"served": served}} if served else {})}


def learn(spec, enabled: bool = True, **options) -> OnlineLearner | None:
    """Start (or stop) learning ``spec``'s drafter from the traffic it serves; the learner is
    ``spec.learning``. ``enabled=False`` detaches it (its buffer dropped); ``options``: the fields of
    :class:`OnlineConfig` (``budget``, ``buffer_tokens``, ...). Calling it again replaces the learner
    (the drafter keeps what was learned). ValueError for a kind with nothing to train online."""
    if not enabled and options:
        raise ValueError(f"learn(spec, False) turns learning off; options {sorted(options)} apply to nothing")
    return spec.learn(OnlineConfig(**options) if enabled else None)
