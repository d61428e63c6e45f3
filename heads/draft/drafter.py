"""The draft-model drafter: a separate small causal LM proposes chains or dynamic trees for all
rows of a batch, one draft forward per tree level, with its own ragged KV cache."""

from __future__ import annotations

import time

import torch

from tree_attention import cache as cache_ops
from tree_attention.draft_batch import DraftBatch
from tree_attention.dynamic import advance_growth, grow_dynamic_tree
from tree_attention.mask import causal_visibility
from tree_attention.tree import Tree, TreeBatch, chain_batch, chain_with_siblings

from .calibration import confidence_bin, confidence_bins, depth_bucket, dominance
from .config import DraftConfig
from .modules import DraftModel


class DraftModelDrafter:
    """Proposes one tree per row and step (``tree_attention.decode.Drafter``).

    The draft's cache (:class:`~tree_attention.cache.RaggedCache`) holds each row's committed
    tokens, its last root included: ``committed[r]`` of them, at positions ``0 .. committed[r] - 1``
    (the target's positions, left padding removed). A :meth:`propose` crops the previous tree's
    expansion away, appends every row's newly committed tokens and new root in one forward (rows
    right-aligned so the roots share the last column; shorter rows leave holes), whose last logits
    score the roots' children, then grows all rows' chains (``top_k`` 1; a row stops below a node
    its draft is less sure of than ``config.confidence``) or dynamic trees in lockstep, one draft
    forward per level.

    By default (``config.adaptive``) a chain's length is chosen per row and step, up to
    ``depth``: a node is kept while the chance that the target accepts it and all its ancestors
    (the calibrated acceptance of each node's confidence bin, multiplied along the chain) pays for
    one more verified node, and one more draft forward runs while the expected gain of the next
    node pays for that forward and its node (:mod:`heads.draft.calibration`; the heads'
    ``calibration`` and ``costs`` learn from every step). Each decision reads the draft's
    distributions and the tokens already drafted, never the token a decision is about.

    Candidates are the draft's top-k tokens (point masses for the sampling rule) unless
    :meth:`sample_with` set a warp: then chains (``top_k`` 1) draw each token from the draft's
    warped distribution q and carry q in ``draft_probs``.
    """

    def __init__(self, heads: DraftModel, config: DraftConfig) -> None:
        self.heads = heads
        self.draft = heads.backbone
        self.config = self.configured = config
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens
        self.calibration, self.costs = heads.calibration, heads.costs
        self.warp = self.generator = None
        self.planned = False  # resized by a planner, which decides whether a step drafts
        self.reset(1)

    nested = True
    """Chains and greedy dynamic trees list their nodes best first: a smaller size keeps the first
    nodes. Sampled drafts are chains, drawn token after token: a shorter chain is the start of a
    longer one in distribution, and a node's acceptance depends only on the nodes before it."""

    def resize(self, tree: int | None) -> None:
        """Draft the next steps' trees at ``tree`` drafted nodes, depth lowered to fit
        (:meth:`DraftConfig.with_tree`; None: the configured tree); the draft's cache is kept
        (``tree_attention.capabilities.SizedDrafter``)."""
        self.config = self.configured.with_tree(tree)
        self.depth, self.top_k, self.total_tokens = self.config.depth, self.config.top_k, self.config.total_tokens
        self.planned = tree is not None

    def sample_with(self, warp, generator: torch.Generator | None) -> None:
        """Draw chain tokens from ``softmax(warp(draft logits))`` with ``generator`` (the serving
        rule's warp and draws); ``warp=None``: top-k candidates again."""
        if warp is not None and self.top_k != 1:
            raise ValueError(f"sampled drafts are chains: top_k must be 1, got {self.top_k}")
        self.warp, self.generator = warp, generator

    @property
    def sampling(self) -> bool:
        return self.warp is not None

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences: an empty cache for ``batch_size`` rows."""
        device = self.draft.device
        self.cache = cache_ops.RaggedCache(batch_size, device)
        self.committed = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.started = False  # after the first propose, each batch's first token is the root already fed
        # the last adaptive chains: per row its tokens (root first), size, confidence bins and
        # alternatives ((level, rank, token, draft probability, verified) each); the mode
        self.chains = None
        self.proposed_at = None  # perf_counter when the last propose of this call returned
        self.pending: DraftBatch | None = None  # committed entries of plain steps, not fed to the draft yet
        self.plain_steps = 0  # plain steps in pending (each committed one token)
        self.caught_up = False  # the last drafted step's feeding forward also fed plain steps' tokens
        self.first = True  # the last drafted step was this call's first (its feeding forward fed the prompt)
        self.feed_seconds = None  # the seconds of the last drafted step's feeding forward
        self.costs.waited = self.costs.interval  # each call's first step drafts

    def retire(self, keep: torch.Tensor) -> None:
        """Drop the cache rows of sequences that left the batch."""
        keep = keep.to(self.committed.device)
        self.cache.select_rows(keep)
        self.committed = self.committed[keep]
        if self.chains is not None:
            tokens, sizes, bins, mode, others = self.chains
            rows = keep.tolist()
            self.chains = ([tokens[r] for r in rows], [sizes[r] for r in rows], [bins[r] for r in rows], mode,
                           [others[r] for r in rows])
        if self.pending is not None and keep.numel():
            self.pending = self.pending.select(keep)

    def _commit(self, batch: DraftBatch) -> torch.Tensor:
        """Feed each row's new tokens and its root; the draft's logits at the roots ``[R, V]``."""
        self.cache.crop()
        device = self.committed.device
        tokens = batch.tokens.to(device)
        skip = 1 if self.started else 0  # tokens[:, 0] is the previous root, already in the cache
        counts = batch.lengths.to(device) - skip + 1  # (R,) new tokens and the root
        rows, available = tokens.shape
        width = int(counts.max())
        columns = torch.arange(width, device=device)
        shift = (width - counts)[:, None]  # (R, 1) leading holes
        valid = columns[None, :] >= shift  # (R, W)
        source = (columns[None, :] - shift + skip).clamp(0, available - 1)
        query = tokens.gather(1, source).masked_fill(~valid, 0)
        query[:, -1] = batch.roots.to(device)
        positions = self.committed[:, None] + (columns[None, :] - shift).clamp(min=0)  # (R, W)
        visible = causal_visibility(width, device) & (valid[:, None, :] | torch.eye(width, dtype=torch.bool,
                                                                                     device=device)[None])
        mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype)
        features, logits = self.heads.decode(query, positions, mask, self.cache.cache, "last")
        if self.started and self.plain_steps and not self.sampling:
            self._replay(features[:, width - 1 - self.plain_steps:width - 1], query[:, width - self.plain_steps:])
        self.cache.extend(valid, positions)
        self.committed = self.committed + counts
        self.started = True
        return logits[:, -1]

    def _replay(self, features: torch.Tensor, following: torch.Tensor) -> None:
        """Greedy: what drafting would have gained at the plain steps just caught up on, for free
        from the catch-up forward: the draft's first token at each plain step's root (features
        ``[R, p, F]``) against the token the target committed after it (``following`` ``[R, p]``),
        counted as depth-1 verdicts of the calibration (the next-best tokens' as alternatives' verdicts)
        and as one-token drafted steps of the costs."""
        probabilities = torch.softmax(self.draft.logits(features).float(), dim=-1)  # (R, p, V)
        best = probabilities.topk(1 + self.config.siblings, dim=-1)  # (R, p, 1 + s)
        guess = best.indices[..., 0]
        kept = guess == following  # (R, p)
        bins = confidence_bins(dominance(probabilities, best.values[..., 0]))
        for index, verdict in zip(bins.view(-1).tolist(), kept.view(-1).tolist()):
            self.calibration.observe("greedy", 1, index, verdict)
        others = best.indices[..., 1:] == following[..., None]  # (R, p, s)
        for probability, verdict in zip(best.values[..., 1:].reshape(-1).tolist(), others.view(-1).tolist()):
            self.calibration.observe_alternative(1, probability, verdict)
        for gain in kept.float().mean(dim=0).tolist():
            self.costs.add_replayed(gain)

    def _children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k children tokens and their log-probabilities ``[m, top_k]`` from logits ``[m, V]``."""
        best = torch.topk(torch.log_softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return best.indices, best.values

    def _next(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A chain's next tokens ``[R]`` from logits ``[R, V]``, the largest probability of each
        row's distribution ``[R]``, its :func:`~heads.draft.calibration.dominance` ``[R]`` and, for
        sampled chains, the rows of q they were drawn from."""
        if not self.sampling:
            probabilities = torch.softmax(logits.float(), dim=-1)
            confidence, tokens = probabilities.max(dim=-1)
            return tokens, confidence, dominance(probabilities, confidence), None
        q = torch.softmax(self.warp(logits.float()), dim=-1)  # (R, V)
        tokens = torch.multinomial(q, 1, generator=self.generator)[:, 0]
        largest = q.amax(dim=-1)
        return tokens, largest, dominance(q, largest), q

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> TreeBatch:
        """One chain (``top_k`` 1) or dynamic tree per row of ``batch``."""
        started = time.perf_counter()
        self._observe(batch, started)
        if self.pending is not None:
            batch, self.pending = self.pending.then(batch), None
        adaptive = self.config.adaptive and self.top_k == 1 and self.depth and self.total_tokens
        if adaptive and not self.planned and not self.costs.draft_now():  # a plain step: caught up when it next drafts
            self.pending, self.plain_steps = batch, self.plain_steps + 1
            trees = TreeBatch.roots_only(batch.roots.to(self.committed.device))
            self.proposed_at = time.perf_counter()
            self.propose_seconds, self.width = self.proposed_at - started, 1
            return trees
        self.caught_up, self.first = self.plain_steps > 0, not self.started  # plain steps' tokens; the prompt
        fed = time.perf_counter()
        root_logits = self._commit(batch)  # (R, V)
        self.feed_seconds, self.plain_steps = time.perf_counter() - fed, 0
        self.cache.compact()
        if self.top_k != 1:
            trees = self._tree(batch.roots.tolist(), root_logits)
        elif adaptive:
            trees = self._adaptive_chain(batch.roots.to(root_logits.device), root_logits)
        else:
            trees = self._chain(batch.roots.to(root_logits.device), root_logits)
        self.proposed_at = time.perf_counter()
        self.propose_seconds, self.width = self.proposed_at - started, trees.width
        return trees

    def _observe(self, batch: DraftBatch, now: float) -> None:
        """Learn from what the target kept of the last step's chains: its verify seconds, and per
        row the verdict on each node whose parent was accepted (node ``k + 1`` after ``k`` accepted
        nodes was accepted exactly when the target's next token is that node's token). Rows whose
        committed tokens are not a prefix of their chain (a step the chain did not serve) teach
        nothing. Host arithmetic on a few ints per row."""
        lengths = batch.lengths.tolist()
        if self.proposed_at is not None:
            verify = now - self.proposed_at
            self.costs.add_step(self.width, verify, verify + self.propose_seconds, sum(lengths) / len(lengths))
        if self.chains is None:
            return
        chain, sizes, bins, mode, alternatives = self.chains
        self.chains = None
        committed = batch.tokens[:, :len(chain[0])].tolist()
        kept = []
        for nodes, size, row_bins, others, path, root, length in zip(chain, sizes, bins, alternatives, committed,
                                                                      batch.roots.tolist(), lengths):
            drafted = length - 1  # drafted tokens kept
            targets = path[1:length] + [root]  # the target's token at depths 1 .. length
            if path[1:length] == nodes[1:length]:
                accepted = drafted  # chain nodes kept
            elif drafted and path[1:drafted] == nodes[1:drafted] and any(
                    verified and level == drafted and token == path[drafted]
                    for level, _, token, _, verified in others):
                accepted = drafted - 1  # the last token kept is an alternative
            else:
                continue
            if accepted >= size:
                continue
            kept.append(drafted)
            for depth in range(1, min(accepted + 1, size - 1) + 1):
                self.calibration.observe(mode, depth, row_bins[depth - 1],
                                         depth <= accepted or nodes[depth] == targets[depth - 1])
            for level, _, token, probability, _ in others:  # verified or not: greedy knows the target's token
                if level <= accepted + 1:
                    self.calibration.observe_alternative(level, probability, token == targets[level - 1])
        if kept:
            self.costs.add_drafted(sum(kept) / len(kept), self.propose_seconds, self.width,
                                   feed_seconds=self.feed_seconds, caught_up=self.caught_up, first=self.first)

    def _chain(self, roots: torch.Tensor, logits: torch.Tensor) -> TreeBatch:
        """Every row's chain, one draft forward per level for all rows; a row stops growing below
        a node whose draft distribution is less confident than ``config.confidence``."""
        rows, device = roots.shape[0], roots.device
        depth = self.depth if self.total_tokens else 0
        tokens, draws = [roots], []
        sizes = torch.ones(rows, dtype=torch.long, device=device)
        growing = torch.ones(rows, dtype=torch.bool, device=device)
        start = self.committed - 1  # (R,) the roots' positions
        for level in range(1, depth + 1):
            token, confidence, _, q = self._next(logits)
            tokens.append(token)
            draws.append(q)
            sizes = sizes + growing.long()
            growing = growing & (confidence >= self.config.confidence)
            if level == depth or not bool(growing.any()):
                break
            logits = self._chain_level(token, start, level)
        return chain_batch(torch.stack(tokens, dim=1), sizes, draws if self.sampling else None)

    def _chain_level(self, token: torch.Tensor, start: torch.Tensor, level: int) -> torch.Tensor:
        """One draft forward of every row's chain token at ``level`` (``token`` ``[R]``, ``start``
        ``[R]`` the roots' positions), which sees the row's committed tokens and its chain so far;
        the logits ``[R, V]`` of the next level."""
        rows, device = token.shape[0], token.device
        positions = (start + level)[:, None]  # (R, 1)
        keys = start[:, None] + torch.arange(1, level + 1, device=device)[None, :]  # this step's chain slots
        visible = torch.ones(rows, 1, level, dtype=torch.bool, device=device)
        mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype, keys)
        _, logits = self.heads.decode(token[:, None], positions, mask, self.cache.cache, "last")
        return logits[:, -1]

    def _adaptive_chain(self, roots: torch.Tensor, logits: torch.Tensor) -> TreeBatch:
        """Every row's chain of the length its calibrated acceptance pays for (at most ``depth``),
        one draft forward per level for the rows still growing (others ride along); under greedy
        decoding, beside each chain node up to ``siblings`` of the draft's next-best tokens there,
        each kept while the chance that its parent is accepted times its calibrated acceptance pays
        for a verified node (leaves: they cost no draft forward). A step whose nodes together are
        expected to add fewer tokens than they cost, a drafted verify's jump over a plain one
        (:meth:`ChainCosts.jump_price`) included, verifies the roots alone. The decisions are host arithmetic
        on each row's draft probabilities (one transfer per level, where the loop synchronises
        anyway)."""
        rows, device = roots.shape[0], roots.device
        mode = "sampled" if self.sampling else "greedy"
        rates, next_rates = self.calibration.rate_lists(mode)
        side = 0 if self.sampling else self.config.siblings
        scales = self.calibration.alternative_scales() if side else None
        draft_price, node_price = self.costs.prices()  # tokens
        tokens, draws, side_tokens = [roots], [], []
        sizes, growing, chance = [1] * rows, [True] * rows, [1.0] * rows  # chance: the target accepts all so far
        expected = [0.0] * rows  # per row: the tokens its kept chain nodes are expected to add
        first = [0, 0.0]  # kept depth-1 nodes and their expected tokens (known before any token is drawn)
        bins: list[list[int]] = [[] for _ in range(rows)]
        alternatives: list[list[tuple[int, int, int, float, bool]]] = [[] for _ in range(rows)]
        worths: list[list[float]] = [[] for _ in range(rows)]  # each alternative's expected tokens
        start = self.committed - 1  # (R,) the roots' positions
        forward_began = None  # when the forward that made this level's logits began
        for level in range(1, self.depth + 1):
            if side:
                probabilities = torch.softmax(logits.float(), dim=-1)
                best = probabilities.topk(1 + side, dim=-1)  # (R, 1 + s)
                token, confidence, q = best.indices[:, 0], best.values[:, 0], None
                signal = dominance(probabilities, confidence)
                side_tokens.append(best.indices[:, 1:])
                other_tokens, other_probabilities = best.indices[:, 1:].tolist(), best.values[:, 1:].tolist()
            else:
                token, confidence, signal, q = self._next(logits)
            tokens.append(token)
            draws.append(q)
            wanted = False
            for row, (sure, stands_out) in enumerate(zip(confidence.tolist(), signal.tolist())):
                index = confidence_bin(stands_out)
                acceptance = rates[depth_bucket(level)][index]
                if level > 1 and growing[row]:  # what the forward bought the rows it ran for
                    self.calibration.observe_following(mode, level, bins[row][-1], index)
                bins[row].append(index)
                reach = chance[row]  # the chance that this level's parent is accepted
                chance[row] *= acceptance
                keep = growing[row] and chance[row] > node_price
                sizes[row] += keep
                expected[row] += chance[row] if keep else 0.0
                if level == 1 and keep:
                    first[0], first[1] = first[0] + 1, first[1] + chance[row]
                if growing[row] and side:  # this level has a parent: its alternatives are known after the step
                    scale = scales[depth_bucket(level)]
                    for rank, (other, probability) in enumerate(zip(other_tokens[row], other_probabilities[row])):
                        worth = reach * min(1.0, scale * probability)
                        verified = keep and worth > node_price
                        alternatives[row].append((level, rank, other, probability, verified))
                        worths[row].append(worth)
                gain = chance[row] * next_rates[depth_bucket(level + 1)][index]  # expected from one more level
                growing[row] = keep and sure >= self.config.confidence and gain > node_price
                wanted = wanted or (growing[row] and gain > draft_price + node_price)
            if forward_began is not None:  # a level costs its forward and the arithmetic on its logits
                self.costs.add_draft(time.perf_counter() - forward_began)
            if level == self.depth or not wanted:
                break
            forward_began = time.perf_counter()
            logits = self._chain_level(token, start, level)
        chain = torch.stack(tokens, dim=1)  # (R, W)
        real = None
        nodes, gain = sum(size - 1 for size in sizes), sum(expected)  # verified beyond the roots; their tokens
        for row, others in enumerate(alternatives):  # the budget counts them too, shallower first
            room = self.total_tokens - (sizes[row] - 1)
            for index, (level, rank, token, probability, verified) in enumerate(others):
                if verified and room > 0:
                    room -= 1
                    nodes, gain = nodes + 1, gain + worths[row][index]
                    if real is None:
                        real = torch.zeros(rows, (chain.shape[1] - 1) * side, dtype=torch.bool)
                    real[row, (level - 1) * side + rank] = True
                elif verified:
                    others[index] = (level, rank, token, probability, False)
        # nodes that do not pay for a drafted verify over a plain one: verify the roots alone (the
        # chains still teach the calibration its depth-1 verdicts)
        nodes, gain = self._jump_evidence((nodes, gain), tuple(first))
        unpaid = nodes and gain < rows * self.costs.jump_price() + nodes * node_price
        if unpaid:
            alternatives = [[(*other[:4], False) for other in others] for others in alternatives]
        self.chains = (chain.tolist(), sizes, bins, mode, alternatives)
        if unpaid:
            return TreeBatch.roots_only(roots)
        if real is not None:
            return chain_with_siblings(chain, torch.tensor(sizes, device=device), torch.cat(side_tokens, dim=1),
                                       real.to(device))
        return chain_batch(chain, torch.tensor(sizes, device=device), draws if self.sampling else None)

    def _jump_evidence(self, chains: tuple[int, float], first: tuple[int, float]) -> tuple[int, float]:
        """What decides whether a step's nodes pay for a drafted verify's jump: ``(nodes, expected
        tokens)`` of its kept chain nodes and alternatives (``chains``) or of its depth-1 nodes alone
        (``first``). Sampled chains decide from ``first``: deeper nodes' confidences follow the drawn
        depth-1 tokens, and dropping a drawn token for what it is would bias the output."""
        return first if self.sampling else chains

    def _tree(self, roots: list[int], root_logits: torch.Tensor) -> TreeBatch:
        """Every row's dynamic tree (EAGLE-2 growth), one draft forward per level for all rows."""
        count, device = len(roots), root_logits.device
        child_tokens, child_scores = self._children(root_logits)
        growths = [grow_dynamic_tree(root, (child_tokens[row], child_scores[row]), self.depth, self.top_k,
                                     self.total_tokens) for row, root in enumerate(roots)]
        trees: list[Tree | None] = [None] * count
        requests = [advance_growth(growth, None, trees, row) for row, growth in enumerate(growths)]
        expansion_positions = torch.zeros(count, 0, dtype=torch.long, device=device)
        columns: list[list[int]] = [[] for _ in range(count)]  # per row: expansion slot of each expanded node
        while any(request is not None for request in requests):
            width = max(request.tokens.numel() if request is not None else 0 for request in requests)
            grown = expansion_positions.shape[1]
            query = torch.zeros(count, width, dtype=torch.long, device=device)
            positions = (self.committed - 1)[:, None].repeat(1, width)  # the root's position
            visible = torch.zeros(count, width, grown + width, dtype=torch.bool, device=device)
            visible[:, :, grown:] = torch.eye(width, dtype=torch.bool, device=device)
            for row, request in enumerate(requests):
                if request is None:
                    continue
                size = request.tokens.numel()
                query[row, :size] = request.tokens
                positions[row, :size] += request.depth
                columns[row] = columns[row] + [grown + i for i in range(size)]
                # request.ancestors[i, j]: expanded node j (expansion order) is node i or its ancestor
                visible[row, :size, torch.tensor(columns[row], device=device)] = request.ancestors
            keys = torch.cat([expansion_positions, positions], dim=1)
            mask = self.cache.mask(positions, visible, self.draft.layout, self.draft.dtype, keys)
            _, logits = self.heads.decode(query, positions, mask, self.cache.cache, "all")  # (R, m, V)
            expansion_positions = keys
            sizes = [request.tokens.numel() if request is not None else 0 for request in requests]
            flat_tokens, flat_scores = self._children(
                torch.cat([logits[row, :size] for row, size in enumerate(sizes) if size]))
            start = 0
            for row, size in enumerate(sizes):
                if not size:
                    continue
                children = (flat_tokens[start:start + size], flat_scores[start:start + size])
                start += size
                requests[row] = advance_growth(growths[row], children, trees, row)
        return TreeBatch.from_trees(trees)
