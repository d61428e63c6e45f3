"""Acceptance rules: which path of a verified tree the target keeps, and the token after it.

**Greedy** (``do_sample=False``): a node is correct when its token is the target's argmax at its
parent; the deepest all-correct path from the root is kept and the target's argmax at its last
node is the bonus token. Every committed token is the target's own greedy choice.

**Lossless sampling over trees.** Let ``p`` be the target's (warped) distribution at a node and
``x_1..x_m`` its children's tokens, tried in order with a residual ``r`` that starts as ``p``:

* a child drawn from a draft distribution ``q`` is accepted with probability
  ``min(1, r(x)/q(x))``; on rejection ``r <- norm(max(0, r - q))``;
* a child chosen deterministically (top-k ranks, as Medusa and EAGLE-2 trees do) is the case
  ``q = delta_x``: accepted with probability ``r(x)``; on rejection ``r <- norm(r with x removed)``;
* if no child is accepted, the bonus token is drawn from ``r`` (at a leaf: from ``p``).

Why the emitted token follows ``p``: for one drawn candidate, P(y) = q(y)·min(1, p(y)/q(y)) +
(1 - Σ_z min(p, q)(z))·max(0, p(y) - q(y)) / Σ_z max(0, p - q)(z) = min(p, q)(y) + max(0, p - q)(y)
= p(y), since both sums equal the same rejection mass. For a deterministic candidate, P(x) = p(x)
and P(y ≠ x) = (1 - p(x))·p(y)/(1 - p(x)) = p(y). Conditioned on a rejection, the rest of the
procedure faces the residual ``r`` with fresh candidates (drawn independently, or fixed), so by
induction on the number of children it emits ``r``'s distribution, which is exactly what the
first case needs. Children drawn from ``q`` *without* replacement must carry the distribution they
were really drawn from (``q`` with earlier picks removed and renormalised) in ``draft_probs``.
Accepting a child commits its token and moves to it, where the same argument applies with the
target's distribution given the longer prefix, so every committed token has the target's
conditional law: the output sequence is distributed exactly as plain sampling from the target.

**Typical acceptance** (Medusa; lossy, opt-in): a node passes when the target gives its token
probability above ``min(posterior_threshold, posterior_alpha * exp(-H(p)))``; the deepest passing
path is kept and the bonus is sampled from the target at its last node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .tree import Tree, TreeBatch

ACCEPTANCE_RULES = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one tree.

    Attributes:
        path: ``[k]`` long node indices from the root (index 0) down, increasing.
        next_token: the bonus token the target produces after the path's last node.
    """

    path: torch.Tensor
    next_token: int

    @property
    def accepted_drafts(self) -> int:
        """Drafted nodes accepted (the root was committed before this step)."""
        return int(self.path.numel()) - 1


@dataclass(frozen=True)
class BatchAcceptance:
    """Outcome of verifying a :class:`~tree_attention.tree.TreeBatch`.

    Attributes:
        paths: ``[R, L]`` long node indices from the root down; row ``r``'s first ``lengths[r]``
            entries are its path, the rest repeat its last node.
        lengths: ``[R]`` long nodes kept per row (root included, >= 1).
        next_tokens: ``[R]`` long bonus token after each row's path.
    """

    paths: torch.Tensor
    lengths: torch.Tensor
    next_tokens: torch.Tensor
    chunks: list[list[int]] | None = None
    """Where the rule walked the tree on the host anyway: each row's path tokens (root first) then
    its bonus token, as Python ints, so the loop commits them without reading the tensors back."""


def stack_acceptances(acceptances: list[Acceptance], device) -> BatchAcceptance:
    """Per-row :class:`Acceptance` results as one :class:`BatchAcceptance`."""
    lengths = [int(a.path.numel()) for a in acceptances]
    longest = max(lengths)
    paths = torch.stack([torch.cat([a.path, a.path[-1:].expand(longest - length)]) if length < longest else a.path
                         for a, length in zip(acceptances, lengths)])
    return BatchAcceptance(paths.to(device), torch.tensor(lengths, device=device),
                           torch.tensor([a.next_token for a in acceptances], device=device))


def roots_acceptance(next_tokens: torch.Tensor) -> BatchAcceptance:
    """The outcome of a step that drafted nothing: every row keeps its root and commits
    ``next_tokens`` ``[R]``."""
    rows, device = int(next_tokens.shape[0]), next_tokens.device
    return BatchAcceptance(torch.zeros(rows, 1, dtype=torch.long, device=device),
                           torch.ones(rows, dtype=torch.long, device=device), next_tokens)


def last_axis_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, the same indices (the first maximum; a NaN counts as the maximum),
    computed by NumPy for float32 / float64 tensors on the CPU: torch's CPU argmax over the last axis
    runs about 1.2 G elements/s on this machine (112 us for a 16-node tree over an 8192-token
    vocabulary), NumPy's vectorised one about 12x faster (9 us); with 32K-128K vocabularies that is
    milliseconds a step. Anything else (other devices and dtypes, gradients) keeps torch's."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)
            and not logits.requires_grad and logits.dim() >= 1 and logits.shape[-1] > 0):
        return torch.from_numpy(np.asarray(logits.numpy()).argmax(axis=-1))
    return logits.argmax(dim=-1)


def greedy_accept_batch(trees: TreeBatch, logits: torch.Tensor) -> BatchAcceptance:
    """Greedy acceptance of every row at once: ``logits`` ``[R, N, V]``. Equal to
    :func:`greedy_accept` row by row (ties between equally deep paths go to the lower index)."""
    return accept_choices(trees, last_axis_argmax(logits))


def accept_choices(trees: TreeBatch, target: torch.Tensor) -> BatchAcceptance:
    """The greedy walk given the target's choice at every node, ``target`` ``[R, N]`` long: a node
    is kept when every node on its root path holds its parent's choice; the deepest such path is
    kept (the lowest index among the deepest) and its last node's choice is the bonus token."""
    rows, width = trees.tokens.shape
    if width == 1:  # roots only: nothing drafted
        return roots_acceptance(target[:, 0])
    if rows == 1:
        return _greedy_accept_single(trees, target)
    return _greedy_accept_rows(trees, target)


def _greedy_accept_single(trees: TreeBatch, target: torch.Tensor) -> BatchAcceptance:
    """:func:`greedy_accept_batch` of a one-row batch (``target`` ``[1, N]``: the target's argmax at
    every node): the tree's tokens, parents and depths and the target's argmax read to the host in
    two calls, then a walk over at most a few dozen nodes in Python (in the loop, where every tensor
    call runs cold after the backbone's forward, 143 us for the former tensor comparisons against
    about 60 us; the first one-row form had cut the batched form's 100 us to 42 us hot). The path's
    tokens and bonus token come back as :attr:`BatchAcceptance.chunks` too."""
    size = trees.width if trees.uniform else int(trees.sizes[0])
    (tokens,), (parent_list,), (depth_list,) = torch.stack([trees.tokens, trees.parents, trees.depths]).tolist()
    argmax = target[0].tolist()
    alive = [True] * size
    best, deepest = 0, 0
    for node in range(1, size):
        parent = parent_list[node]
        alive[node] = alive[parent] and tokens[node] == argmax[parent]
        if alive[node] and depth_list[node] > deepest:  # strictly deeper: the lowest index among the deepest
            best, deepest = node, depth_list[node]
    path = [best]
    while path[-1] != 0:
        path.append(parent_list[path[-1]])
    path.reverse()
    device = target.device
    return BatchAcceptance(torch.tensor([path], device=device), torch.tensor([len(path)], device=device),
                           target[0, best:best + 1], [[tokens[node] for node in path] + [argmax[best]]])


def _greedy_accept_rows(trees: TreeBatch, target: torch.Tensor) -> BatchAcceptance:
    """:func:`greedy_accept_batch` with no per-row Python (``target`` ``[R, N]``)."""
    rows, width = trees.tokens.shape
    correct = trees.tokens == target.gather(1, trees.parents.clamp(min=0))
    correct[:, 0] = True
    if not trees.uniform:
        correct &= torch.arange(width, device=correct.device)[None, :] < trees.sizes[:, None]
    alive = ~(trees.visibility & ~correct[:, None, :]).any(dim=-1)  # (R, N) every ancestor correct
    best = torch.where(alive, trees.depths, torch.full_like(trees.depths, -1)).argmax(dim=1)  # (R,) first maximum
    depth = trees.depths.gather(1, best[:, None])[:, 0]  # (R,)
    longest = int(depth.max()) + 1
    paths = best[:, None].repeat(1, longest)
    ancestors = trees.visibility[torch.arange(rows, device=best.device), best]  # (R, N)
    row_index, node_index = torch.nonzero(ancestors, as_tuple=True)
    paths[row_index, trees.depths[row_index, node_index]] = node_index
    return BatchAcceptance(paths, depth + 1, target.gather(1, best[:, None])[:, 0])


def deepest_path(tree: Tree, correct: torch.Tensor) -> torch.Tensor:
    """Longest root path whose nodes are all ``correct`` (``[N]`` bool; the root counts as correct).

    Ties between equally deep nodes go to the lower index. Returns ``[k]`` node indices.
    """
    correct = correct.clone()
    correct[0] = True
    alive = ~(tree.ancestors & ~correct.unsqueeze(0)).any(dim=-1)  # (N,) every ancestor correct
    score = torch.where(alive, tree.depths, torch.full_like(tree.depths, -1))
    best = int(torch.argmax(score))  # first maximum: lowest index among the deepest
    return torch.nonzero(tree.ancestors[best], as_tuple=False).flatten()


def _check_logits(tree: Tree, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[0] != tree.size:
        raise ValueError(f"logits must be [N={tree.size}, V]; got shape {tuple(logits.shape)}")


def greedy_accept(tree: Tree, logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance. ``logits`` is ``[N, V]``: the target's logits at every tree node."""
    _check_logits(tree, logits)
    target = logits.argmax(dim=-1)  # (N,)
    parent_choice = target[tree.parents.clamp(min=0)]
    path = deepest_path(tree, tree.tokens == parent_choice)
    return Acceptance(path=path, next_token=int(target[path[-1]]))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def inverse_cdf(weights: np.ndarray, uniform: float) -> int:
    """The token a uniform draw in [0, 1) picks from ``weights`` ``[V]`` (non-negative, not all zero;
    never one without weight)."""
    cdf = np.cumsum(weights)
    index = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    if index >= len(weights) or weights[index] <= 0:  # rounding at the top end: the last token with mass
        index = int(np.flatnonzero(weights)[-1])
    return index


def _accept_row(parents: list[int], tokens: list[int], p, q: np.ndarray | None,
                uniforms: np.ndarray, use_residual: bool = True) -> tuple[list[int], int]:
    """The sampling rule on one tree (see the module docstring), on the host: ``p`` ``[N, V]`` the
    target's distributions (indexed by node), ``q`` ``[N, V]`` or None the children's draft rows, ``uniforms`` ``[N]``
    the draws (one per child tried, then the bonus token's). Returns the path and the bonus token."""
    children: list[list[int]] = [[] for _ in parents]
    for node in range(1, len(parents)):
        children[parents[node]].append(node)
    node, path, draw = 0, [0], 0
    while True:
        target = p[node].astype(np.float64)
        residual, accepted = target, None
        for child in children[node]:
            token = tokens[child]
            if q is None:
                chance = residual[token]
            else:
                row = q[child].astype(np.float64)
                chance = min(1.0, residual[token] / max(row[token], 1e-30))
            draw += 1
            if uniforms[draw - 1] < chance:
                accepted = child
                break
            if not use_residual:
                continue
            if q is None:
                residual = residual.copy()
                residual[token] = 0.0
            else:
                residual = np.maximum(residual - row, 0.0)
            total = residual.sum()
            residual = target if total <= 0.0 else residual / total  # <= 0: cannot happen after a rejection
        if accepted is None:
            return path, inverse_cdf(residual if use_residual else target, float(uniforms[draw]))
        node = accepted
        path.append(node)


def _host(values: torch.Tensor | None) -> np.ndarray | None:
    """``values`` as a numpy array (no copy on the CPU; the rows a rule visits are widened to float64)."""
    if values is None:
        return None
    values = values.detach().cpu()
    return (values if values.dtype in (torch.float32, torch.float64) else values.float()).numpy()


def sample_accept(tree: Tree, probs: torch.Tensor, generator: torch.Generator | None = None,
                  draft_probs: torch.Tensor | None = None, use_residual: bool = True) -> Acceptance:
    """Lossless multi-candidate speculative sampling over a tree (see the module docstring).

    Args:
        probs: ``[N, V]`` the target's warped distribution at every node (rows sum to 1).
        draft_probs: ``[N, V]`` row ``c`` is the distribution child ``c`` was drawn from; None when
            every child was chosen deterministically (top-k ranks).
        use_residual: only for tests showing that a wrong rule is caught: False resamples from
            ``p`` instead of the residual after a rejection (not lossless).
    """
    if probs.dim() != 2 or probs.shape[0] != tree.size:
        raise ValueError(f"probs must be [N={tree.size}, V]; got shape {tuple(probs.shape)}")
    uniforms = torch.rand(tree.size, generator=generator, dtype=torch.float64).numpy()
    path, token = _accept_row(tree.parents.tolist(), tree.tokens.tolist(), _host(probs), _host(draft_probs),
                              uniforms, use_residual)
    return Acceptance(torch.tensor(path, device=probs.device), token)


class _NodeProbabilities:
    """A row's target distributions ``[V]`` by node, each computed (warp, softmax) when the rule first
    visits the node: a rule visits the accepted path and its last node's children, a few of ``N``."""

    def __init__(self, logits: torch.Tensor, probabilities: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.logits, self.probabilities, self.rows = logits, probabilities, {}

    def __getitem__(self, node: int) -> np.ndarray:
        row = self.rows.get(node)
        if row is None:
            row = self.rows[node] = _host(self.probabilities(self.logits[node][None]))[0]
        return row


LAZY_ELEMENTS = 1 << 16
"""Logits of a step with more entries than this (nodes x vocabulary) are turned into distributions
only at the nodes the rule visits; smaller ones all at once (one softmax costs less than a few)."""


def sample_accept_batch(trees: TreeBatch, probs: torch.Tensor, generator: torch.Generator | None = None,
                        draft_probs: torch.Tensor | None = None, use_residual: bool = True,
                        probabilities: Callable[[torch.Tensor], torch.Tensor] | None = None) -> BatchAcceptance:
    """:func:`sample_accept` for every row of ``trees`` (``probs`` ``[R, N, V]``, ``draft_probs``
    ``[R, N, V]`` or None), the rows' draws taken in row order from one call to the generator and
    every row's arithmetic on the host (a few microseconds per tried child, against tens for tensor
    operations). With ``probabilities`` (logits ``[n, V]`` -> distributions), ``probs`` are logits,
    turned into distributions only at the nodes the rule visits."""
    rows, width = trees.tokens.shape
    uniforms = torch.rand(rows, width, generator=generator, dtype=torch.float64).numpy()
    p = None if probabilities is not None else _host(probs)
    q = _host(draft_probs)
    parents, tokens = trees.parents.tolist(), trees.tokens.tolist()
    sizes = [width] * rows if trees.uniform else trees.sizes.tolist()
    paths, next_tokens = [], []
    for row, size in enumerate(sizes):
        target = _NodeProbabilities(probs[row], probabilities) if p is None else p[row, :size]
        path, token = _accept_row(parents[row][:size], tokens[row][:size], target,
                                  None if q is None else q[row, :size], uniforms[row], use_residual)
        paths.append(path)
        next_tokens.append(token)
    longest = max(len(path) for path in paths)
    device = probs.device
    return BatchAcceptance(torch.tensor([path + path[-1:] * (longest - len(path)) for path in paths], device=device),
                           torch.tensor([len(path) for path in paths], device=device),
                           torch.tensor(next_tokens, device=device),
                           [[tokens[row][node] for node in path] + [token]
                            for row, (path, token) in enumerate(zip(paths, next_tokens))])


def typical_accept(tree: Tree, probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Medusa's typical acceptance (lossy). ``probs`` ``[N, V]`` as in :func:`sample_accept`."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # (N,)
    bound = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # (N,)
    parents = tree.parents.clamp(min=0)
    candidate_prob = probs[parents, tree.tokens]  # (N,) target prob of each node's token at its parent
    path = deepest_path(tree, candidate_prob > bound[parents])
    return Acceptance(path=path, next_token=_draw(probs[path[-1]], generator))


class AcceptanceRule:
    """How the loop picks the first token after the prompt and which tree path it keeps.

    The loop passes every call where its logits stand: ``batch_rows`` (the batch index of each row
    of ``logits``; rows leave the batch as they finish) and ``positions`` (the position id of each
    logits row's query, padding excluded: ``[R]`` for :meth:`first_tokens`, ``[R, N]`` for
    :meth:`accept_batch`). Rules whose draws are keyed by row and position
    (:class:`tree_attention.gumbel.GumbelRule`) need them; the others ignore them."""

    lossless = True
    deterministic = False
    """True when the kept path is a function of the tree's tokens and the logits alone (no draws):
    then verifying any sub-tree keeps exactly the nodes the whole tree would keep that it holds,
    and any cut of a proposed tree leaves the output unchanged."""
    key = "rule"
    """What acceptance depends on besides the drafts (rule and sampling settings): statistics of
    accepted lengths are only comparable under one key."""

    def for_prompts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> "AcceptanceRule":
        """The rule for one call on the left-padded prompts ``input_ids`` ``[B, T]``: this rule,
        unless its draws depend on the prompts (then a copy bound to them)."""
        return self

    def first_token(self, logits: torch.Tensor) -> int:  # logits (V,)
        raise NotImplementedError

    def first_tokens(self, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        """The first new token of every row: logits ``[R, V]`` → ``[R]`` long."""
        return torch.tensor([self.first_token(row) for row in logits], dtype=torch.long, device=logits.device)

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:  # logits (N, V)
        raise NotImplementedError

    def accept_batch(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> BatchAcceptance:
        """Every row of ``trees`` (logits ``[R, N, V]``), rows in order (draws stay in row order)."""
        return stack_acceptances([self.accept(tree, logits[index, :tree.size])
                                  for index, tree in enumerate(trees.trees())], logits.device)


class GreedyRule(AcceptanceRule):
    key = "greedy"
    deterministic = True

    def first_token(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def first_tokens(self, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        return last_axis_argmax(logits)

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        return greedy_accept(tree, logits)

    def accept_batch(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> BatchAcceptance:
        return greedy_accept_batch(trees, logits)


class SamplingRule(AcceptanceRule):
    """Lossless speculative sampling. ``warp`` maps logits ``[N, V]`` to warped logits (temperature,
    top-k, top-p, exactly as ``generate`` applies them); ``generator`` seeds every draw."""

    key = "sample"

    def __init__(self, warp: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None = None,
                 use_residual: bool = True) -> None:
        self.warp = warp
        self.generator = generator
        self.use_residual = use_residual

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.warp(logits.float()), dim=-1)

    def first_token(self, logits: torch.Tensor) -> int:
        return _draw(self.probabilities(logits[None])[0], self.generator)

    def first_tokens(self, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        """One draw per row of ``logits`` ``[R, V]`` from its warped distribution, in one call."""
        return torch.multinomial(self.probabilities(logits), 1, generator=self.generator)[:, 0]

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        _check_logits(tree, logits)
        return sample_accept(tree, self.probabilities(logits), self.generator, tree.draft_probs,
                             self.use_residual)

    def accept_batch(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> BatchAcceptance:
        if trees.width == 1:  # roots only, a plain step: each row's next token drawn from p
            return roots_acceptance(self.first_tokens(logits[:, 0]))
        if logits[0].numel() > LAZY_ELEMENTS:
            return sample_accept_batch(trees, logits, self.generator, trees.draft_probs, self.use_residual,
                                       probabilities=self.probabilities)
        probs = self.probabilities(logits.reshape(-1, logits.shape[-1])).view(logits.shape)
        return sample_accept_batch(trees, probs, self.generator, trees.draft_probs, self.use_residual)


class TypicalRule(SamplingRule):
    """Medusa's typical acceptance: faster at high temperature, **not** lossless."""

    lossless = False
    key = "typical"

    def __init__(self, warp, generator=None, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        super().__init__(warp, generator)
        if not posterior_threshold >= 0 or not posterior_alpha >= 0:
            raise ValueError("posterior_threshold and posterior_alpha must be >= 0; got "
                             f"{posterior_threshold!r}, {posterior_alpha!r}")
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha

    def accept_batch(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> BatchAcceptance:
        """Row by row (:func:`typical_accept`), roots-only steps included (lossy either way)."""
        return AcceptanceRule.accept_batch(self, trees, logits)

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        _check_logits(tree, logits)
        return typical_accept(tree, self.probabilities(logits), self.posterior_threshold, self.posterior_alpha,
                              self.generator)
