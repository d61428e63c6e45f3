"""Sampled draft candidates: children drawn from a draft distribution without replacement, and
dynamic trees grown from them, both lossless under :func:`tree_attention.verify.sample_accept`.

The sampling rule accepts a child ``x`` with probability ``min(1, r(x)/q(x))`` where ``q`` is the
distribution the child was *really* drawn from, given everything the drafter decided before it.
Two things follow for a drafter:

* the ``k`` children of a node drawn without replacement from ``q`` carry, in order, ``q`` with
  the earlier siblings' tokens removed and renormalised (:func:`drawn_from`); a child drafted
  deterministically (beyond ``q``'s support, or a lookup continuation) carries a one-hot row;
* whether a node exists may depend on anything drafted before it, but never on its own token
  or on what was drawn after it (its later siblings, which depend on it, and their subtrees).
  Keeping the ``n`` best candidates by their own draft probability, as EAGLE-2 does with top-k
  candidates, breaks this: a candidate would be more likely kept when its token was likely under
  ``q``, so its kept token no longer follows ``q``. :func:`grow_sampled_tree` ranks each slot by a
  key fixed before the slot's token is drawn (see there).
"""

from __future__ import annotations

import heapq
import math
from typing import Generator

import numpy as np
import torch

from .dynamic import Expansion, _check_dynamic_shape, _tree_from_candidates, best_nodes, expansion_request
from .tree import Tree
from .verify import inverse_cdf


TRIES = 2
"""Draws of a token from a row's undepleted distribution before the row's remaining mass is summed
afresh (see :func:`_draw_row`)."""


def _draw_row(weights: np.ndarray, count: int, uniforms: np.ndarray) -> list[int]:
    """``count`` distinct tokens drawn in order without replacement from ``weights`` ``[V]`` (at least
    ``count`` of them positive), with ``uniforms`` ``[count * (TRIES + 1)]``. Each token is drawn from
    the whole row and redrawn while it repeats an earlier one (rejection: exactly the renormalised
    rest), up to :data:`TRIES` times; then from the rest's own cumulative sums (one pass)."""
    cdf = np.cumsum(weights, dtype=np.float64)
    total, last = cdf[-1], len(weights) - 1
    drawn: list[int] = []
    rest = None
    for index in range(count):
        base, token = index * (TRIES + 1), None
        for attempt in range(TRIES):
            candidate = min(int(np.searchsorted(cdf, uniforms[base + attempt] * total, side="right")), last)
            if weights[candidate] > 0 and candidate not in drawn:
                token = candidate
                break
        if token is None:
            if rest is None:
                rest = weights.astype(np.float64)
            rest[drawn] = 0.0
            token = inverse_cdf(rest, float(uniforms[base + TRIES]))
        drawn.append(token)
    return drawn


RACE_ELEMENTS = 1 << 14
"""Up to this many entries (rows x vocabulary) tokens are drawn by a Gumbel race in a few tensor
operations; above it the host's per-row draws cost less (on a small vocabulary their Python
bookkeeping costs more than the race)."""


def _race(logits: torch.Tensor, probs: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`draw_without_replacement` by a Gumbel race: the tokens by decreasing ``log probs + G``,
    ``G`` standard Gumbel (i.i.d. per entry), then the rest by ``logits`` past the support."""
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300, max=1.0 - 1e-16)))
    support = probs > 0
    keys = torch.where(support, probs.double().log() + gumbel, -math.inf)
    drawn = torch.topk(keys, count, dim=-1).indices  # (..., count) the first `supported` are real draws
    supported = support.sum(dim=-1, keepdim=True)  # (..., 1)
    if bool((supported >= count).all()):
        return drawn
    spare = torch.topk(logits.float().masked_fill(support, -math.inf), count, dim=-1).indices
    slot = torch.arange(count, device=probs.device)
    return torch.where(slot < supported, drawn, spare.gather(-1, (slot - supported).clamp(min=0)))


def draw_without_replacement(logits: torch.Tensor, probs: torch.Tensor, count: int,
                             generator: torch.Generator | None) -> torch.Tensor:
    """``count`` tokens per row of ``probs`` ``[..., V]``, drawn without replacement in order (the same
    law as drawing one at a time from the renormalised rest). Large ones on the host from one
    generator call: a few cumulative-sum passes per row, where a race needs a random number per
    vocabulary entry (milliseconds for a few rows of an 8K vocabulary); small ones by a race
    (:data:`RACE_ELEMENTS`).

    Once ``probs``' support is used up, the remaining tokens are the best of the rest by ``logits``
    ``[..., V]`` (deterministic: point masses, see :func:`drawn_from`). Returns ``[..., count]`` long.
    """
    vocab = probs.shape[-1]
    if count > vocab:
        raise ValueError(f"cannot draw {count} distinct tokens from a vocabulary of {vocab}")
    if probs.numel() <= RACE_ELEMENTS:
        return _race(logits, probs, count, generator)
    flat = probs.detach().reshape(-1, vocab).cpu()
    rows = flat.shape[0]
    uniforms = torch.rand(rows, count * (TRIES + 1), generator=generator, dtype=torch.float64).numpy()
    weights = (flat if flat.dtype in (torch.float32, torch.float64) else flat.float()).numpy()
    supported = (flat > 0).sum(dim=-1).tolist()
    drawn = [_draw_row(weights[row], min(count, supported[row]), uniforms[row]) for row in range(rows)]
    if min(supported) < count:  # the rest by logits, deterministically
        spare = torch.topk(logits.detach().reshape(-1, vocab).float().cpu().masked_fill(flat > 0, -math.inf),
                           count, dim=-1).indices.tolist()
        drawn = [tokens + spare[row][:count - len(tokens)] for row, tokens in enumerate(drawn)]
    return torch.tensor(drawn, dtype=torch.long, device=probs.device).view(*probs.shape[:-1], count)


def depleted(probs: torch.Tensor, tokens: torch.Tensor, earlier: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """The distribution each of ``tokens`` ``[...]`` was drawn from: ``probs`` ``[..., V]`` with the
    ``earlier`` ``[..., k]`` tokens where ``used`` (bool, broadcast to ``earlier``) removed and
    renormalised; a one-hot row at the token when that leaves it no probability (a point mass).
    ``earlier`` holds distinct tokens per row (draws without replacement). Returns ``[..., V]`` in
    ``probs``' dtype (three passes over the rows: copy, sum, divide)."""
    remove = used.expand(earlier.shape)
    rest = probs.clone(memory_format=torch.contiguous_format)
    rest.scatter_(-1, earlier, rest.gather(-1, earlier) * (~remove).to(probs.dtype))
    own = rest.gather(-1, tokens[..., None])  # (..., 1)
    rest.div_(rest.sum(dim=-1, keepdim=True).clamp_min(1e-30))
    point = own[..., 0] <= 0
    if bool(point.any()):
        rest[point] = torch.nn.functional.one_hot(tokens[point], probs.shape[-1]).to(probs.dtype)
    return rest


def drawn_from(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., k, V]`` for ``tokens`` ``[..., k]`` drawn in order without replacement from
    ``probs`` ``[..., V]`` (:func:`draw_without_replacement`): row ``j`` is ``probs`` without
    tokens ``0 .. j-1``, renormalised (one-hot past the support)."""
    count = tokens.shape[-1]
    before = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril(-1)  # [j, i]: i before j
    expanded = tokens[..., None, :].expand(*tokens.shape, count)  # (..., k, k) every sibling's tokens
    return depleted(probs[..., None, :].expand(*tokens.shape, probs.shape[-1]), tokens, expanded, before)


SampledChildren = tuple[torch.Tensor, torch.Tensor]
"""``(tokens [m, k] long, rows [m, k, V])``: each requested node's ``k`` children drawn without
replacement from its draft distribution and the rows they were drawn from (:func:`drawn_from`)."""


def _slots(parent_key: float, parent_score: float, values: list[float]) -> list[tuple[float, float]]:
    """``(key, score)`` of each drawn child of one node, ``values`` being ``q(x)`` of each child's
    token under the node's undepleted ``q``: a child's score is the parent's plus ``log q(x)`` (its
    path's draft log-probability); its key, fixed before its own token is drawn, is
    ``min(parent key, parent score + log(q mass not taken by earlier siblings))``."""
    slots, remaining = [], 1.0
    for value in values:
        key = min(parent_key, parent_score + math.log(remaining)) if remaining > 0 else -math.inf
        slots.append((key, parent_score + math.log(value) if value > 0 else -math.inf))
        remaining -= value
    return slots


def grow_sampled_tree(root: int, root_children: SampledChildren, depth: int, top_k: int, total_tokens: int
                      ) -> Generator[Expansion, SampledChildren, Tree]:
    """A dynamic tree of sampled children, best-first by a key fixed before each token is drawn.

    Like :func:`tree_attention.dynamic.grow_dynamic_tree` (the same :class:`Expansion` requests and
    ``send`` protocol, one level per request) but every expanded node's ``top_k`` children are
    draws without replacement, sent back as ``(tokens [m, top_k], rows [m, top_k, V])``, and the
    tree carries each node's row in ``draft_probs``.

    Keys: a child slot's key is ``min(parent's key, parent's score + log(1 - q mass of its earlier
    siblings))`` where a node's score is its path's draft log-probability (the root: key and score
    0): the chance, under the draft, of reaching the slot. It never exceeds its parent's or an
    earlier sibling's, so the ``total_tokens`` best slots (ties: shallower, then earlier) are the
    first ``total_tokens`` slots of a best-first search that draws each token only when its slot is
    taken: whether a node is kept is decided before its own token is drawn, as the rule needs.
    Level by level, every newest node whose first child could still enter the best
    ``total_tokens`` is expanded (no ``top_k`` cap on expansions per level: capping by the drawn
    tokens' probabilities would make a node's presence depend on its own token), so the kept set
    equals that search's. Slots with no draft probability left (key ``-inf``) are not drafted.
    """
    _check_dynamic_shape(depth, top_k, total_tokens)
    first_tokens, first_rows = root_children
    device = first_tokens.device
    tokens: list[int] = []
    parents: list[int] = []  # parent candidate (-1: the root)
    depths: list[int] = []
    keys: list[float] = []
    scores: list[float] = []
    rows: list[torch.Tensor] = []  # per candidate: the distribution it was drawn from

    def add(parent: list[int], child_tokens: torch.Tensor, child_rows: torch.Tensor, level: int) -> None:
        """Children ``[m, k]`` of the ``m`` nodes ``parent`` (a list; -1: the root) as candidates."""
        values = child_rows[:, 0].gather(1, child_tokens).tolist()  # q(x) under each parent's undepleted q
        for row, (node, row_tokens) in enumerate(zip(parent, child_tokens.tolist())):
            key, score = (0.0, 0.0) if node < 0 else (keys[node], scores[node])
            for index, (child_key, child_score) in enumerate(_slots(key, score, values[row])):
                if child_key == -math.inf:
                    break  # later siblings have no probability left either
                tokens.append(row_tokens[index])
                parents.append(node)
                depths.append(level)
                keys.append(child_key)
                scores.append(child_score)
                rows.append(child_rows[row, index])

    if total_tokens:
        add([-1], first_tokens[None], first_rows[None], 1)
    slot: dict[int, int] = {}  # candidate -> position in expansion order
    chains: list[list[int]] = []  # per expanded node: expansion positions of its expanded ancestors and itself
    newest = list(range(len(tokens)))
    for level in range(1, depth if total_tokens else 1):
        threshold = heapq.nlargest(total_tokens, keys)[-1] if len(keys) >= total_tokens else -math.inf
        frontier = [c for c in newest if min(keys[c], scores[c]) > threshold]
        if not frontier:
            break
        grown = len(chains)
        request, new_chains = expansion_request(frontier, tokens, parents, slot, chains, level, device)
        child_tokens, child_rows = yield request
        if child_tokens.shape != (len(frontier), top_k) or child_rows.shape[:2] != (len(frontier), top_k):
            raise ValueError(f"expand must return tokens [{len(frontier)}, {top_k}] and rows [{len(frontier)}, "
                             f"{top_k}, V]; got {tuple(child_tokens.shape)} and {tuple(child_rows.shape)}")
        slot.update({candidate: grown + i for i, candidate in enumerate(frontier)})
        chains += new_chains
        first = len(tokens)
        add(frontier, child_tokens.long(), child_rows, level + 1)
        newest = list(range(first, len(tokens)))
    keep = best_nodes(torch.tensor(keys, dtype=torch.float64), torch.tensor(depths, dtype=torch.long),
                      total_tokens).tolist()
    tree = _tree_from_candidates(root, tokens, parents, depths, keep, device)
    vocab = first_rows.shape[-1]
    probs = torch.stack([first_rows.new_zeros(vocab)] + [rows[c] for c in keep])  # (N, V) the root's row unused
    return Tree(tree.tokens, tree.parents, tree.depths, tree.ancestors, probs)
