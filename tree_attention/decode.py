"""The speculative decoding loop: draft → verify → accept → commit, for a batch of sequences.

One prefill forward over the (left-padded) prompts gives each row its first token, the root of
its first tree. Each later step asks the drafter for one tree per row rooted at that row's last
committed token, runs one target forward over all rows' nodes (trees padded to the largest one)
with a tree mask, and lets every row accept its own path: the accepted path's keys and values
move to the front of the step's cache region, and the slots a row did not use stay in the cache as
holes that the mask hides (:class:`~tree_attention.cache.RaggedCache`), position ids per row. Rows
that reach eos or their token budget leave the batch; holes are compacted away only once they make
up half of the cache. Batch 1 is the same code with no holes.

The loop knows nothing about how drafts are made; it talks to a :class:`Target` (one forward) and
a :class:`Drafter` (one tree per row per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import torch

from . import cache as cache_ops
from .context import ContextProcessor, ContextTracker
from .draft_batch import DraftBatch
from .mask import AttentionMask, MaskLayout
from .mask import causal_visibility
from .planning import STEP_KINDS, ModalDrafter, Planner, StepRecord  # noqa: F401  (the loop's planning contract)
from .tree import Tree, TreeBatch, truncate_batch
from .verify import AcceptanceRule, GreedyRule


class Target(Protocol):
    """The frozen model, seen as one forward."""

    layout: MaskLayout
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                cache, logits_rows: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, T, F]`` for all rows and logits ``[B, T or 1, V]`` (``logits_rows`` "all" or "last")."""


class Drafter(Protocol):
    """Proposes one tree per step for every row still decoding."""

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences; ``batch_size`` rows follow (called once per ``generate``)."""

    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One tree per row of ``batch`` (node 0 of row ``r`` holds ``batch.roots[r]``)."""

    def retire(self, keep: torch.Tensor) -> None:
        """Rows finished: only the rows at indices ``keep`` ``[R']`` (of the current rows, in
        order) stay in the batch."""


class RowDrafter(Protocol):
    """Proposes one tree per step for one sequence (wrap in :class:`PerRowDrafter` for the loop)."""

    def reset(self) -> None:
        """Forget any state from an earlier sequence."""

    def propose(self, features: torch.Tensor, tokens: torch.Tensor, root: int) -> Tree:
        """A tree whose node 0 holds ``root``; ``features`` ``[1, n, F]`` and ``tokens`` ``[1, n]``
        as one row of :class:`DraftBatch`."""


class PerRowDrafter:
    """A :class:`Drafter` made of one :class:`RowDrafter` per row, for drafters written for one
    sequence with per-sequence state (oracles in tests, per-request lookups); serves batches of
    up to ``len(drafters)`` rows. Calls each live row's drafter in turn."""

    def __init__(self, drafters: Sequence[RowDrafter]) -> None:
        if not drafters:
            raise ValueError("PerRowDrafter needs at least one row drafter")
        self.drafters = list(drafters)
        self.live: list[int] = []

    def reset(self, batch_size: int) -> None:
        if batch_size > len(self.drafters):
            raise ValueError(f"PerRowDrafter holds {len(self.drafters)} row drafters; a batch of {batch_size} "
                             "needs one per row")
        self.live = list(range(batch_size))
        for drafter in self.drafters[:batch_size]:
            drafter.reset()

    def retire(self, keep: torch.Tensor) -> None:
        self.live = [self.live[index] for index in keep.tolist()]

    def propose(self, batch: DraftBatch) -> TreeBatch:
        lengths = batch.lengths.tolist()
        roots = batch.roots.tolist()
        return TreeBatch.from_trees([
            self.drafters[row].propose(batch.features[index:index + 1, :lengths[index]],
                                       batch.tokens[index:index + 1, :lengths[index]], roots[index])
            for index, row in enumerate(self.live)])


@dataclass
class DecodeStats:
    """What one ``generate`` call did. ``mean_accepted`` (tau) counts tokens committed per target
    forward and row, bonus token included, over all forwards (the prefill too)."""

    new_tokens: int = 0
    target_forwards: int = 0
    row_forwards: int = 0  # sum over forwards of the rows they served (= target_forwards at batch 1)
    batch_size: int = 1
    tree_size: int = 0
    verified_nodes: int = 0  # tree nodes (padding included) over all verify forwards, root included
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per row and verify step
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    _speculation: dict | Callable[[], dict] | None = field(default=None, repr=False)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the loop (:data:`PHASES`); contiguous laps, so they sum to ``total_seconds``."""
    steps: list["StepRecord"] = field(default_factory=list)
    """One :class:`StepRecord` per step after the prefill (what it verified, committed and cost)."""

    @property
    def speculation(self) -> dict | None:
        """What an adaptive policy (``speculate="auto"``) chose in this call and why; None without one.
        Built when first read (a policy hands a function: the call does not pay for it), so what it
        reports of the policy's models is as they stand then."""
        if callable(self._speculation):
            self._speculation = self._speculation()
        return self._speculation

    @speculation.setter
    def speculation(self, value: dict | Callable[[], dict] | None) -> None:
        self._speculation = value

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.row_forwards if self.row_forwards else 0.0

    tau = mean_accepted

    @property
    def prefix_survival(self) -> list[float]:
        """``P(accepted >= k)`` for ``k = 1..max_depth``: the share of verify steps (per row) that
        accepted at least ``k`` drafted tokens (the same list as ``acceptance_by_position``)."""
        return self.acceptance_by_position

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """``P(accept at k | accepted k - 1)`` for ``k = 1..max_depth`` (see :meth:`conditional_rates`)."""
        return self.conditional_rates(self.acceptance_by_position)

    @staticmethod
    def conditional_rates(survival: Sequence[float]) -> list[float | None]:
        """Prefix survival ``s_k = P(accepted >= k)`` -> ``s_k / s_(k-1)`` per ``k`` (``s_0 = 1``): of the
        steps that reached depth ``k``, the share that accepted its token too (a step whose tree was
        shallower than ``k`` counts as a rejection there). None where no step accepted ``k - 1``."""
        rates, previous = [], 1.0
        for rate in survival:
            rates.append(rate / previous if previous > 0 else None)
            previous = rate
        return rates

    def finish(self, max_depth: int) -> None:
        steps = len(self.accepted_lengths)
        self.acceptance_by_position = [
            sum(length > depth for length in self.accepted_lengths) / steps if steps else 0.0
            for depth in range(max_depth)
        ]

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
            "row_forwards": self.row_forwards, "batch_size": self.batch_size,
            "tau": self.mean_accepted, "tree_size": self.tree_size, "verified_nodes": self.verified_nodes,
            "acceptance_by_position": self.acceptance_by_position, "prefix_survival": self.prefix_survival,
            "conditional_acceptance": self.conditional_acceptance,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds, "speculation": self.speculation, "phases": dict(self.phases),
        }


PHASES = ("prefill", "plan", "draft", "tree", "mask", "forward", "accept", "cache", "commit", "result")
"""Where a ``generate`` call's time goes: the prefill forward (with its mask and first tokens); per
step the planner's choice (``speculate="auto"``), the drafter's ``propose`` (its forwards and tree
building), cutting trees to the token budget, the verification mask, the backbone forward, the
acceptance rule, the cache (keeping accepted slots, compaction), committing (features for the next
draft, emitted tokens, finished rows); and assembling the output."""


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded prompts, as ``generate`` computes them (padding at 1)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def left_align(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, T, ...]`` of left-padded rows (``mask`` ``[B, T]``, ones last) shifted so
    that each row's valid entries come first."""
    pad = mask.shape[1] - mask.long().sum(dim=1)  # (B,)
    if not bool(pad.any()):
        return values
    index = (torch.arange(mask.shape[1], device=mask.device)[None, :] + pad[:, None]).clamp(max=mask.shape[1] - 1)
    index = index.view(*index.shape, *([1] * (values.dim() - 2))).expand_as(values)
    return values.gather(1, index)


class SpeculativeDecoder:
    """State of one batched speculative generation; :meth:`run` is the whole loop.

    Cache row ``i`` belongs to batch row ``rows[i]`` (finished rows leave); ``cache`` is a
    :class:`~tree_attention.cache.RaggedCache` (prompt padding and rejected slots are holes),
    ``lengths`` ``[R]`` each row's committed length (the position of its next root) and
    ``draft`` the :class:`DraftBatch` the next step hands the drafter.
    """

    def __init__(self, target: Target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_ids: Collection[int] = (), rule: AcceptanceRule | None = None,
                 attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None,
                 stop: Callable[[int, list[int]], bool] | None = None,
                 on_commit: Callable[[int, list[int]], None] | None = None,
                 process: ContextProcessor | None = None, planner: Planner | None = None) -> None:
        """``stop(row, output)``: checked after every committed token (True ends the row there);
        ``on_commit(row, tokens)``: called with each chunk a row commits (streaming); ``process``:
        logits processors that read each position's sequence (repetition penalty, n-gram bans, ...),
        applied to the prefill's last logits and to every tree node's with that node's own sequence.

        ``planner``: decides before each step whether to draft (:class:`Planner`; None: always
        draft); drafted trees are verified whole. A step that does not
        draft verifies each row's root alone (a plain decoding step) and keeps what it committed for
        the drafter's next call; setting ``decoder.drafting = False`` ends drafting for the rest of
        the call (nothing more is kept for the drafter)."""
        self.target, self.drafter, self.rule = target, drafter, rule or GreedyRule()
        self.stop, self.on_commit = stop, on_commit
        self.input_ids = input_ids
        self.prompt_mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).bool()
        self.process = process
        self.contexts = None if process is None else ContextTracker(input_ids, self.prompt_mask, max_new_tokens)
        self.max_new_tokens, self.eos = max_new_tokens, frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        batch = input_ids.shape[0]
        self.outputs: list[list[int]] = [[] for _ in range(batch)]
        self.stats = DecodeStats(batch_size=batch)
        self.cache = cache_ops.RaggedCache(batch, input_ids.device)
        self.rows: list[int] = list(range(batch))
        self.max_depth = 0
        self.stats.phases = dict.fromkeys(PHASES, 0.0)
        self._stamp = time.perf_counter()
        self.holes = 0  # slots appended since the last compaction that no row kept (a bound on any row's holes)
        self.planner = planner
        self.drafting = True  # False: plain steps until the end of the call
        self.proposals = 0  # the drafter's propose calls so far (the first catches up on the prompt)
        self._skipped: list[DraftBatch] = []  # what plain steps committed since the drafter's last call

    # -- state per row ------------------------------------------------------------------------

    def _emit(self, row: int, chunk: list[int]) -> bool:
        """Append ``chunk`` to row's output up to its budget and first eos; True when the row is done."""
        output = self.outputs[row]
        start, done = len(output), False
        for token in chunk:
            if len(output) >= self.max_new_tokens:
                done = True
                break
            output.append(token)
            if token in self.eos or (self.stop is not None and self.stop(row, output)):
                done = True
                break
        if self.on_commit is not None and len(output) > start:
            self.on_commit(row, output[start:])
        if self.contexts is not None and len(output) > start:
            self.contexts.append(row, output[start:])
        return done or len(output) >= self.max_new_tokens

    def _keep_rows(self, done: list[bool]) -> None:
        if not any(done):
            return
        keep = [index for index, finished in enumerate(done) if not finished]
        self.rows = [self.rows[index] for index in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.lengths.device)
        self.drafter.retire(index)  # also when every row finished: drafters that remember text do it now
        if not keep:
            return
        self.cache.select_rows(index)
        self.lengths = self.lengths[index]
        self.draft, *self._skipped = (draft.select(index) for draft in (self.draft, *self._skipped))

    # -- the loop -----------------------------------------------------------------------------

    def prefill(self) -> None:
        ids, mask = self.input_ids, self.prompt_mask
        batch, length = ids.shape
        positions = prompt_positions(mask)
        visible = causal_visibility(length, ids.device) & mask[:, None, :]  # (B, T, T)
        attention = self.cache.mask(positions, visible, self.target.layout, self.target.dtype)
        self.drafter.reset(batch)
        features, logits = self.target.forward(ids, positions, attention, self.cache.cache, "last")
        self.stats.target_forwards, self.stats.row_forwards = 1, batch
        self.cache.extend(mask.clone(), positions)
        self.lengths = mask.long().sum(dim=1)
        last = logits[:, -1] if self.process is None else self.process(self.contexts.prompts(), logits[:, -1])
        roots = self.rule.first_tokens(last, list(range(batch)), positions[:, -1])  # (B,)
        self.draft = DraftBatch(left_align(features, mask), left_align(ids, mask), self.lengths.clone(), roots,
                                self.lengths.clone(), tuple(range(batch)))
        self._keep_rows([self._emit(row, [root]) for row, root in enumerate(roots.tolist())])

    def _lap(self, phase: str) -> float:
        """Charge the time since the last lap to ``phase``; returns it (seconds)."""
        now = time.perf_counter()
        seconds, self._stamp = now - self._stamp, now
        self.stats.phases[phase] += seconds
        return seconds

    def step(self, draft: bool | None = None) -> None:
        """One draft → verify → accept → commit step for every row still decoding (``draft``
        False: verify the roots alone; None: as :attr:`planner` says, drafting by default)."""
        rows = len(self.rows)
        if draft is None:
            draft = self.drafting and (self.planner is None or self.planner.draft(rows))
        plan_seconds = self._lap("plan")  # (the planner's own time: charged to no drafting option's cost)
        started = self._stamp
        first_draft = draft and self.proposals == 0
        if draft:
            self.proposals += 1
            if self._skipped:  # what the plain steps since its last call committed
                self.draft, self._skipped = self.draft.then(*self._skipped), []
            trees = self.drafter.propose(self.draft)
        else:
            trees = TreeBatch.roots_only((self._skipped[-1] if self._skipped else self.draft).roots)
        self._lap("draft")
        planned = trees
        trees = truncate_batch(trees, [self.max_new_tokens - 1 - len(self.outputs[row]) for row in self.rows])
        self._lap("tree")
        draft_seconds = self._stamp - started
        query_positions = self.lengths[:, None] + trees.depths  # (R, N)
        if trees.width == 1 and self.target.layout is None and self.cache.dense():
            # one query per row over a cache without holes: it sees every key, as in the backbone's
            # own decoding step, which passes no 4D mask either
            mask = None
        else:
            mask = self.cache.mask(query_positions, trees.visibility, self.target.layout, self.target.dtype)
        self._lap("mask")
        features, logits = self.target.forward(trees.tokens, query_positions, mask, self.cache.cache, "all")
        self._lap("forward")
        if self.process is not None:
            contexts = self.contexts.nodes(self.rows, trees)
            logits = self.process(contexts, logits.reshape(-1, logits.shape[-1])).view(*logits.shape[:2], -1)
        accepted = self.rule.accept_batch(trees, logits, self.rows, query_positions)
        paths, lengths = accepted.paths, accepted.lengths  # (R, L) padded with the last kept node, (R,)
        self._lap("accept")
        if rows == 1:  # its whole path is real
            self.cache.keep(paths, None, query_positions, full=True)
        else:
            kept = torch.arange(paths.shape[1], device=paths.device)[None, :] < lengths[:, None]
            self.cache.keep(paths, kept, query_positions)
        self._lap("cache")
        self.lengths = self.lengths + lengths
        path_tokens = trees.tokens.gather(1, paths)  # (R, L)
        path_features = features.gather(1, paths[..., None].expand(-1, -1, features.shape[-1]))
        committed = DraftBatch(path_features, path_tokens, lengths, accepted.next_tokens, self.lengths,
                               tuple(self.rows))
        # a step that did not draft leaves the drafter's pending entries in place and adds its own
        if draft or not self.drafting:
            self.draft, self._skipped = committed, []
        else:
            self._skipped.append(committed)
        self.stats.target_forwards += 1
        self.stats.row_forwards += rows
        self.stats.tree_size = max(self.stats.tree_size, trees.width)
        self.stats.verified_nodes += trees.width
        self.max_depth = max(self.max_depth, trees.max_depth)
        chunks = accepted.chunks  # (a rule that walked the tree on the host: whole paths, then the bonus)
        if chunks is None:
            chunks = torch.cat([path_tokens, accepted.next_tokens[:, None]], dim=1).tolist()
        counts = lengths.tolist() if accepted.chunks is None else [len(chunk) - 1 for chunk in chunks]
        done = []
        self.holes += trees.width * rows - sum(counts)
        for index, (row, length) in enumerate(zip(self.rows, counts)):
            self.stats.accepted_lengths.append(length - 1)
            chunk = chunks[index]
            done.append(self._emit(row, chunk[1:length] + [chunk[-1]]))
        self._keep_rows(done)
        self._lap("commit")
        if self.rows and 2 * self.holes >= self.cache.width and self.cache.compact():
            self.holes = 0
        self._lap("cache")
        kind = "plain" if not draft else "drafted" if trees.width > 1 else "empty"
        record = StepRecord(kind, rows, trees.width, draft_seconds, self._stamp - started - draft_seconds,
                            sum(counts), first_draft, plan_seconds)
        self.stats.steps.append(record)
        if self.planner is not None:
            # a step cut to the token budget renumbered its nodes: its acceptance says nothing of the plan
            self.planner.observe(record, trees if trees is planned else None, paths, lengths)

    def result(self) -> torch.Tensor:
        """Prompts plus new tokens, rows that stopped early filled with ``pad_token_id`` (as ``generate``)."""
        longest = max(len(output) for output in self.outputs)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        new = torch.full((len(self.outputs), longest), pad, dtype=self.input_ids.dtype, device=self.input_ids.device)
        for row, output in enumerate(self.outputs):
            new[row, :len(output)] = torch.tensor(output, dtype=self.input_ids.dtype)
        return torch.cat([self.input_ids, new], dim=1)

    def run(self) -> tuple[torch.Tensor, DecodeStats]:
        start = self._stamp = time.perf_counter()
        if self.max_new_tokens == 0:
            return self.input_ids.clone(), self.stats
        self.prefill()
        self._lap("prefill")
        while self.rows:
            self.step()
        self.stats.new_tokens = sum(len(output) for output in self.outputs)
        self.stats.finish(self.max_depth)
        output = self.result()
        self._lap("result")
        phases = self.stats.phases
        self.stats.draft_seconds = phases["draft"] + phases["tree"]
        self.stats.verify_seconds = sum(phases[name] for name in ("mask", "forward", "accept", "cache", "commit"))
        self.stats.total_seconds = self._stamp - start
        return output, self.stats


def speculative_generate(target: Target, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int,
                         eos_token_ids: Collection[int] = (), rule: AcceptanceRule | None = None,
                         attention_mask: torch.Tensor | None = None,
                         pad_token_id: int | None = None) -> tuple[torch.Tensor, DecodeStats]:
    """Generate up to ``max_new_tokens`` after each row of ``input_ids`` (``[B, T]``, left-padded
    where ``attention_mask`` has zeros), each row stopping at its first eos.

    ``rule`` picks tokens and accepted paths (default :class:`~tree_attention.verify.GreedyRule`).
    Returns the ids ``[B, T + new]`` (rows that stopped early padded with ``pad_token_id``) and the
    step statistics.
    """
    decoder = SpeculativeDecoder(target, drafter, input_ids, max_new_tokens, eos_token_ids, rule,
                                 attention_mask, pad_token_id)
    return decoder.run()
