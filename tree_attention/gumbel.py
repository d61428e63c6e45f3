"""Counter-based Gumbel noise: seeded sampling whose output depends on the seed, never on the drafts.

**Gumbel-max.** With ``G(v)`` i.i.d. standard Gumbel, ``argmax_v(w(v) + G(v))`` is an exact sample of
``softmax(w)`` (``w`` the warped logits: ``-inf`` entries are never drawn). If the noise of the token
at sequence position ``t`` is a fixed function ``G(key, t, v)`` of a row key and ``t``, every token
is a deterministic function of its prefix: sampling becomes greedy decoding on perturbed logits, and
speculative verification is the greedy rule on those perturbed logits: a drafted child is kept iff
its token equals the perturbed argmax at its parent. The committed text is then exactly what plain
sequential Gumbel-max sampling produces, whatever was drafted, however large the tree, in whichever
batch row; and it follows the target's distribution: the noise at position ``t`` is independent of
the noise at earlier positions, which alone decided the prefix, so given the prefix token ``t`` is an
exact draw from the target's distribution there.

**The stream.** ``G`` comes from a counter-based generator (no state): splitmix64's output function
applied to ``stream(key, t) + (v + 1) * golden``, read as a uniform ``u`` in (0, 1) (53 bits) and
mapped to ``-log(-log u)``. Integer arithmetic wraps modulo ``2**64`` on int64 tensors; right shifts
are made logical by masking. The same ``(key, t, v)`` gives the same 64-bit word in any tensor shape
(and on any device; the float64 logarithms after it agree to rounding), so only the noise of the
tokens a rule looks at is ever computed.

**Keys.** A row's key mixes the seed with a hash of its prompt tokens (padding excluded), so rows with
different prompts draw independent noise and a row's output does not depend on its place in a batch;
two rows with the same prompt and seed give the same text (give them different seeds to get
different samples). Positions are position ids (padding excluded): the token drawn after a query at
position ``p`` has position ``p + 1``.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import numpy as np
import torch

from .tree import Tree, TreeBatch
from .verify import Acceptance, BatchAcceptance, GreedyRule, accept_choices

GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64: splitmix64's increment
_MIX_1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX_2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_PROMPT = 0x5EED_0F_9E0  # domain constants: a prompt token's term and a position's stream differ
_POSITION = 0x7A11_0C_A7


def _shift(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``values`` (torch's ``>>`` keeps the sign)."""
    shifted = values >> bits
    shifted &= (1 << (64 - bits)) - 1
    return shifted


def mix(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 ``values`` (any shape; a new tensor): a bijection of
    64-bit words whose outputs for consecutive inputs look independent. In place on one copy (the
    noise of a step's tree is millions of words on a large vocabulary)."""
    values = values.clone()
    for bits, factor in ((30, _MIX_1), (27, _MIX_2)):
        values ^= _shift(values, bits)
        values *= factor
    values ^= _shift(values, 31)
    return values


def as_word(value: int) -> int:
    """A Python int reduced modulo ``2**64`` to the signed int64 with the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def row_keys(seeds: Sequence[int], input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``[B]`` int64 keys of left-padded prompts ``input_ids`` ``[B, T]`` (``attention_mask`` zeros
    first): row ``b`` mixes ``seeds[b]`` with its prompt's tokens and their places among the row's
    tokens, so the same prompt and seed give the same key wherever the row sits and however it is
    padded."""
    ids = input_ids.long()
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if len(seeds) != ids.shape[0]:
        raise ValueError(f"one seed per row: got {len(seeds)} seeds for {ids.shape[0]} rows")
    place = mask.long().cumsum(dim=1)  # (B, T) 1 at a row's first token
    terms = mix(mix(ids ^ _PROMPT) + place * GOLDEN)  # (B, T) order-dependent through the place
    prompt = (terms * mask.long()).sum(dim=1)  # (B,) wrapping sum: the same in any summation order
    seed = torch.tensor([as_word(int(seed)) for seed in seeds], dtype=torch.long, device=ids.device)
    return mix(mix(seed) ^ mix(prompt + mask.long().sum(dim=1)))


_WORDS = {name: np.uint64(value % (1 << 64)) for name, value in
          (("golden", GOLDEN), ("mix_1", _MIX_1), ("mix_2", _MIX_2), ("position", _POSITION))}


def _mix_host(values: np.ndarray) -> np.ndarray:
    """:func:`mix` on uint64 numpy ``values``, in place (the same bits: both wrap modulo ``2**64``),
    with one scratch array for the shifts (a vocabulary's words are re-read from memory per pass:
    fewer fresh arrays, fewer cache misses)."""
    scratch = np.empty_like(values)
    for bits, factor in ((30, _WORDS["mix_1"]), (27, _WORDS["mix_2"])):
        values ^= np.right_shift(values, np.uint64(bits), out=scratch)
        values *= factor
    values ^= np.right_shift(values, np.uint64(31), out=scratch)
    return values


_VOCABULARY: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
"""Vocabulary size -> the host tensor ``arange(V)`` a full-vocabulary draw passes as its tokens and
``(v + 1) * golden`` for every token ``v`` (uint64, read-only): that draw's per-token words, computed
once (recognised by the tensor's identity)."""


def vocabulary_tokens(vocab: int) -> torch.Tensor:
    """``arange(vocab)`` on the host, one tensor per size, whose words :func:`gumbel_noise` keeps."""
    entry = _VOCABULARY.get(vocab)
    if entry is None:
        with np.errstate(over="ignore"):
            words = np.arange(1, vocab + 1, dtype=np.uint64) * _WORDS["golden"]
        words.flags.writeable = False
        entry = _VOCABULARY.setdefault(vocab, (torch.arange(vocab), words))
    return entry[0]


_MASK = (1 << 64) - 1


def _mix_word(value: int) -> int:
    """:func:`mix` of one word as a Python int in ``[0, 2**64)`` (numpy's per-call cost is most of
    hashing one row's stream; Python integers do it in a few microseconds)."""
    for bits, factor in ((30, int(_WORDS["mix_1"])), (27, int(_WORDS["mix_2"]))):
        value = ((value ^ (value >> bits)) * factor) & _MASK
    return value ^ (value >> 31)


def _streams(keys: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
    """``stream(key, position)`` (uint64, shape of ``keys``): the start of each draw's sequence."""
    if keys.numel() == 1 and positions.numel() == 1:  # one draw (a step at batch 1)
        word = _mix_word(int(keys) & _MASK ^ _mix_word((int(positions) + int(_WORDS["position"])) & _MASK))
        return np.full(tuple(keys.shape), word, dtype=np.uint64)
    with np.errstate(over="ignore"):  # (multiplication wraps, by design)
        key = keys.long().numpy().astype(np.uint64)
        return _mix_host(key ^ _mix_host(positions.long().numpy().astype(np.uint64) + _WORDS["position"]))


def _host_noise(keys: torch.Tensor, positions: torch.Tensor, token_words: np.ndarray) -> torch.Tensor:
    """:func:`gumbel_noise` on the host from the tokens' words ``(token + 1) * golden`` (uint64,
    ``[..., K]`` or ``[K]``, not modified): the integer hashing and the logarithms in numpy, in place
    after one copy (numpy's float64 logarithm is about twice torch's speed on a vocabulary; the two
    agree to one unit in the last place)."""
    with np.errstate(over="ignore"):
        words = _mix_host(token_words + _streams(keys, positions)[..., None])
        np.right_shift(words, np.uint64(11), out=words)
    uniform = words.astype(np.float64)
    uniform += 0.5  # (0, 1) after the scaling: never log(0)
    uniform *= 2.0 ** -53
    for _ in range(2):  # -log(-log u)
        np.log(uniform, out=uniform)
        np.negative(uniform, out=uniform)
    return torch.from_numpy(uniform)


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``G(key, position, token)`` as float64 ``[..., K]`` for int64 ``keys``
    and ``positions`` ``[...]`` (the position of the token being drawn) and ``tokens`` ``[..., K]``
    (or ``[K]``, broadcast). On the host the words are hashed in numpy (about a dozen integer
    operations an entry, where torch's per-operation cost dominates a small step), bit for bit the
    words of the tensor path."""
    if keys.device.type == "cpu" and positions.device.type == "cpu" and tokens.device.type == "cpu":
        cached = _VOCABULARY.get(tokens.numel())
        if cached is not None and cached[0] is tokens:
            return _host_noise(keys, positions, cached[1])
        with np.errstate(over="ignore"):
            token_words = (tokens.long().numpy().astype(np.uint64) + np.uint64(1)) * _WORDS["golden"]
        return _host_noise(keys, positions, token_words)
    stream = mix(keys.long() ^ mix(positions.long() + _POSITION))[..., None]  # (..., 1)
    words = mix(stream + (tokens.long() + 1) * GOLDEN)  # (..., K) splitmix64's sequence from `stream`
    return _gumbel_of_words(_shift(words, 11).double())


NOISE_BLOCK = 1 << 13
"""Noise entries one host call computes for a small vocabulary: a row's next ``NOISE_BLOCK // V``
positions at once, kept for the steps that draw them (:class:`NoiseBlocks`). Numpy's cost per call, not
its arithmetic, is most of a draw over a few hundred tokens; the noise of a position is the same however
many are computed together."""


class NoiseBlocks:
    """Full-vocabulary host noise of a run of positions per row key, computed a block at a time
    (vocabularies of at most ``NOISE_BLOCK // 2`` tokens: others compute each draw's noise alone)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.span = vocab, NOISE_BLOCK // vocab
        self.blocks: dict[int, tuple[int, np.ndarray]] = {}  # key -> (first position, noise [span, V])

    def noise(self, keys: torch.Tensor, positions: torch.Tensor) -> np.ndarray:
        """:func:`gumbel_noise` over the whole vocabulary, bit for bit: a new float64 ``[n, V]`` array for
        ``keys`` and ``positions`` (host int64, ``n`` entries in all, flattened in order). A key's block
        starts at the first position asked of it that it does not hold (a row's positions only grow)."""
        flat_keys, flat_positions = keys.reshape(-1).tolist(), positions.reshape(-1).tolist()
        noise = np.empty((len(flat_keys), self.vocab))
        for index, (key, position) in enumerate(zip(flat_keys, flat_positions)):
            first, block = self.blocks.get(key, (0, None))
            if block is None or not first <= position < first + self.span:
                first, block = self.blocks[key] = (position, _host_noise_rows(key, position, self.span, self.vocab))
            noise[index] = block[position - first]
        return noise


def _host_noise_rows(key: int, first: int, count: int, vocab: int) -> np.ndarray:
    """Host noise ``[count, V]`` of row key ``key`` at positions ``first, ..., first + count - 1``."""
    return gumbel_noise(torch.full((count,), key, dtype=torch.long), torch.arange(first, first + count),
                        vocabulary_tokens(vocab)).numpy()


SUPPORT_SHARE = 4
"""Warped rows whose widest support (finite entries) is under 1/``SUPPORT_SHARE`` of the vocabulary
(top-k, top-p) get noise only on their support, found by one ``topk``; others on every entry."""


def perturbed_argmax(warped: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                     blocks: NoiseBlocks | None = None) -> torch.Tensor:
    """``argmax_v(warped[..., v] + G(keys, positions, v))``: the Gumbel-max draw of each row of
    ``warped`` ``[..., V]`` (warped logits, ``-inf`` outside the support), ``keys`` and
    ``positions`` ``[...]`` int64 (the position of the drawn token). Returns ``[...]`` long.

    The noise is evaluated in float64 and only where it can win (the support), so the result does
    not depend on how many rows are computed together."""
    return perturbed_top_k(warped, keys, positions, 1, blocks)[..., 0]


def perturbed_top_k(warped: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, count: int,
                    blocks: NoiseBlocks | None = None) -> torch.Tensor:
    """The ``count`` tokens with the largest ``warped + G(keys, positions, .)`` per row, best first
    (``[..., count]`` long; shapes as :func:`perturbed_argmax`). The first is the Gumbel-max draw of
    ``softmax(warped)``; all ``count`` are a draw without replacement from it (Gumbel-top-k).

    For a drafter this is *coupled* drafting: its candidates for the token at ``positions``, taken
    with the noise the target draws that token with, contain the target's draw with probability
    ``P(argmax(w_p + G) in top_count(w_q + G))``, which tends to 1 as the draft's distribution ``q``
    nears the target's ``p`` (independent draws from ``q`` reach only about ``sum_v p(v) q(v)``).
    ``blocks``: where the whole vocabulary's noise is read on the host, it comes from there.
    Past a row's support (fewer finite entries than ``count``) the remaining tokens are arbitrary
    tokens outside it, which no draw ever picks."""
    vocab = warped.shape[-1]
    if blocks is not None and blocks.vocab == vocab and warped.device.type == "cpu":
        # every entry's noise read from the blocks; -inf entries (outside the support) are never drawn
        noisy = blocks.noise(keys, positions)
        noisy += warped.detach().reshape(-1, vocab).numpy()  # (float32 widened: torch's float64 sum exactly)
        if count == 1:  # (numpy's argmax, as torch's, returns the first of equal maxima)
            return torch.from_numpy(noisy.argmax(axis=1)).view(*warped.shape[:-1], 1)
        return torch.topk(torch.from_numpy(noisy), count, dim=-1).indices.view(*warped.shape[:-1], count)
    scores = warped.double()
    if not scores.numel():
        support = 0
    else:  # (one reduction where nothing was truncated: a temperature alone)
        support = vocab if bool(scores.min() > -torch.inf) else int(torch.isfinite(scores).sum(dim=-1).max())
    if 0 < max(support, count) * SUPPORT_SHARE < vocab:
        values, tokens = torch.topk(scores, max(support, count), dim=-1)  # every finite entry of every row
        best = torch.topk(values + gumbel_noise(keys, positions, tokens), count, dim=-1).indices
        return tokens.gather(-1, best)
    tokens = vocabulary_tokens(vocab) if warped.device.type == "cpu" else torch.arange(vocab, device=warped.device)
    noise = gumbel_noise(keys, positions, tokens)
    scores = scores.add_(noise) if scores is not warped else scores + noise
    return scores.argmax(dim=-1, keepdim=True) if count == 1 else torch.topk(scores, count, dim=-1).indices


COUPLED_POOL = 32
"""A drafter distribution's best tokens among which :meth:`GumbelRule.coupled_pool` ranks coupled
candidates (the noise is read for these alone)."""

LAZY_ELEMENTS = 1 << 16
"""Trees whose logits hold more entries than this a row (nodes x vocabulary) get the target's draws
only at the nodes the walk reaches (:meth:`GumbelRule._walk`); smaller ones at every node at once
(a few tensor calls cost less than a round per depth)."""


class GumbelRule(GreedyRule):
    """Seeded lossless sampling: the greedy rule on Gumbel-perturbed warped logits (module
    docstring). ``warp`` maps logits ``[M, V]`` to warped logits (temperature, top-k, top-p, as
    ``generate`` applies them, after any context processors); ``seeds`` is one seed for every row or
    one per row. A :class:`GreedyRule` in every other respect: which tree is verified, or whether
    one is, never changes the output. Bind it to a call's prompts with :meth:`for_prompts`; the loop
    then passes ``batch_rows`` and ``positions`` with every call."""

    key = "gumbel"

    def __init__(self, warp: Callable[[torch.Tensor], torch.Tensor], seeds: int | Sequence[int]) -> None:
        self.warp = warp
        self.seeds = seeds
        self.keys: torch.Tensor | None = None  # (B,) int64 row keys, once bound
        self._rows: tuple | None = None  # ((batch rows, device), their keys) of the latest draw
        self._blocks: NoiseBlocks | None = None  # a small vocabulary's host noise, a block of positions at a time

    def for_prompts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> "GumbelRule":
        rows = int(input_ids.shape[0])
        seeds = [self.seeds] * rows if isinstance(self.seeds, int) else list(self.seeds)
        bound = copy.copy(self)
        bound.keys, bound._rows, bound._blocks = row_keys(seeds, input_ids, attention_mask), None, None
        return bound

    def _noise_blocks(self, vocab: int) -> NoiseBlocks | None:
        """This call's blocks of host noise for a vocabulary of ``vocab`` tokens (None: not small)."""
        if not 0 < vocab <= NOISE_BLOCK // 2:
            return None
        if self._blocks is None or self._blocks.vocab != vocab:
            self._blocks = NoiseBlocks(vocab)
        return self._blocks

    def choices(self, logits: torch.Tensor, batch_rows: list[int] | None, positions: torch.Tensor | None
                ) -> torch.Tensor:
        """The token drawn after each query: ``logits`` ``[R, ..., V]``, ``positions`` ``[R, ...]`` the
        queries' position ids, ``batch_rows`` ``[R]``; returns ``[R, ...]`` long."""
        if self.keys is None or batch_rows is None or positions is None:
            raise ValueError("GumbelRule draws by row and position: bind it with for_prompts() and pass "
                             "batch_rows and positions with every call")
        keys, warped = self._keyed(logits, batch_rows, positions)
        return perturbed_argmax(warped, keys, positions.to(logits.device) + 1, blocks=self._noise_blocks(logits.shape[-1]))

    def _keyed(self, logits: torch.Tensor, batch_rows: Sequence[int], positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys broadcast to ``positions`` ``[R, ...]`` and ``logits`` ``[R, ..., V]`` warped
        (float32), both on the logits' device."""
        rows = (tuple(batch_rows), logits.device)
        if self._rows is None or self._rows[0] != rows:  # (the rows change only when some finish)
            index = torch.as_tensor(rows[0], dtype=torch.long, device=self.keys.device)
            self._rows = (rows, self.keys[index].to(logits.device))
        keys = self._rows[1].view(-1, *([1] * (positions.dim() - 1))).expand(positions.shape)
        return keys, self.warp(logits.reshape(-1, logits.shape[-1]).float()).view(logits.shape)

    def coupled_candidates(self, draft_logits: torch.Tensor, batch_rows: list[int], positions: torch.Tensor,
                           count: int) -> torch.Tensor:
        """A drafter's ``count`` candidates for the tokens at ``positions`` ``[R, ...]`` (the drafted
        tokens' own positions, not their queries'), from its logits ``[R, ..., V]`` warped as the
        target's and perturbed with the target's noise there (:func:`perturbed_top_k`): with the
        draft's logits equal to the target's, the first candidate is the target's draw. Returns
        ``[R, ..., count]`` long. The output never depends on it; only acceptance does."""
        keys, warped = self._keyed(draft_logits, batch_rows, positions)
        return perturbed_top_k(warped, keys, positions.to(draft_logits.device), count,
                               self._noise_blocks(draft_logits.shape[-1]))

    def coupled_pool(self, draft_logits: torch.Tensor, batch_rows: Sequence[int], positions: torch.Tensor,
                     count: int, pool: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`coupled_candidates` among each row's ``pool`` best warped draft tokens only: the
        columns of ``draft_logits`` ``[R, ..., count]``, best first (``token_ids`` ``[V']``: the
        target id of each column, whose noise it reads; None: the same ids). The noise is read for
        ``pool`` tokens a row, not the whole vocabulary. A drafter's candidates need not be an exact
        draw (the rule verifies whatever is proposed); the pool holds the target's draw whenever the
        draft's distribution ranks it among its ``pool`` best."""
        keys, warped = self._keyed(draft_logits, batch_rows, positions)
        vocab = draft_logits.shape[-1]
        values, columns = torch.topk(warped, min(max(pool, count), vocab), dim=-1)  # (R, ..., M)
        ids = columns if token_ids is None else token_ids[columns]
        noise = gumbel_noise(keys, positions.to(draft_logits.device), ids)
        best = torch.topk(values.double() + noise.to(values.device), count, dim=-1).indices
        return columns.gather(-1, best)

    def first_token(self, logits: torch.Tensor) -> int:
        raise ValueError("GumbelRule draws by row and position: use first_tokens with batch_rows and positions")

    def first_tokens(self, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.choices(logits, batch_rows, positions)

    def accept(self, tree: Tree, logits: torch.Tensor) -> Acceptance:
        raise ValueError("GumbelRule draws by row and position: use accept_batch with batch_rows and positions")

    def accept_batch(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None = None,
                     positions: torch.Tensor | None = None) -> BatchAcceptance:
        if trees.width == 1 or logits[0].numel() <= LAZY_ELEMENTS:
            return accept_choices(trees, self.choices(logits, batch_rows, positions))
        return self._walk(trees, logits, batch_rows, positions)

    def _walk(self, trees: TreeBatch, logits: torch.Tensor, batch_rows: list[int] | None,
              positions: torch.Tensor | None) -> BatchAcceptance:
        """:func:`accept_choices` with the target's choice computed only at the nodes whose root path
        holds the choices so far (one round per depth, all rows at once): the accepted path, and any
        sibling holding the same token as a node on it, instead of all ``N`` nodes."""
        if batch_rows is None or positions is None:
            self.choices(logits[:, :1], batch_rows, positions)  # raises, naming what is missing
        rows, width = trees.tokens.shape
        tokens, parents, depths = torch.stack([trees.tokens, trees.parents, trees.depths]).tolist()
        sizes = [width] * rows if trees.uniform else trees.sizes.tolist()
        children = [[[] for _ in range(size)] for size in sizes]  # per row and node: its children
        for row, size in enumerate(sizes):
            for node in range(1, size):
                children[row][parents[row][node]].append(node)
        chosen: dict[tuple[int, int], int] = {}
        correct: list[list[int]] = [[0] for _ in range(rows)]  # nodes whose root path holds the choices
        frontier = [(row, 0) for row in range(rows)]
        while frontier:
            row_index = torch.tensor([row for row, _ in frontier], device=logits.device)
            node_index = torch.tensor([node for _, node in frontier], device=logits.device)
            draws = self.choices(logits[row_index, node_index], [batch_rows[row] for row, _ in frontier],
                                 positions[row_index.to(positions.device), node_index.to(positions.device)]).tolist()
            following = []
            for (row, node), draw in zip(frontier, draws):
                chosen[(row, node)] = draw
                for child in children[row][node]:
                    if tokens[row][child] == draw:
                        correct[row].append(child)
                        following.append((row, child))
            frontier = following
        bests = [min(nodes, key=lambda node, row=row: (-depths[row][node], node)) for row, nodes in enumerate(correct)]
        paths, chunks = [], []
        for row, best in enumerate(bests):
            path = [best]
            while path[-1] != 0:
                path.append(parents[row][path[-1]])
            path.reverse()
            paths.append(path)
            chunks.append([tokens[row][node] for node in path] + [chosen[(row, best)]])
        longest = max(len(path) for path in paths)
        device = logits.device
        return BatchAcceptance(torch.tensor([path + path[-1:] * (longest - len(path)) for path in paths], device=device),
                               torch.tensor([len(path) for path in paths], device=device),
                               torch.tensor([chunk[-1] for chunk in chunks], device=device), chunks)

    def plain_processor(self, attention_mask: torch.Tensor | None) -> "PlainGumbelProcessor":
        """This bound rule as a transformers logits processor for the backbone's own greedy
        ``generate`` (``do_sample=False``; it runs after ``generate``'s context processors), so that
        ``generate`` commits exactly the tokens this rule commits. ``attention_mask`` ``[B, T]``: the
        prompts' (zeros first); ``generate`` keeps every row in place to the end."""
        if self.keys is None:
            raise ValueError("bind the rule to the call's prompts with for_prompts() first")
        return PlainGumbelProcessor(self.warp, self.keys, attention_mask)


class PlainGumbelProcessor:
    """A logits processor ``(input_ids [B, L], scores [B, V]) -> scores`` for greedy ``generate``:
    0 at each row's Gumbel-max draw (:func:`perturbed_argmax` of the warped scores, at the position
    after the row's ``L`` tokens less its prompt padding), ``-inf`` elsewhere."""

    def __init__(self, warp: Callable[[torch.Tensor], torch.Tensor], keys: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> None:
        self.warp, self.keys = warp, keys
        self.padding = None if attention_mask is None else (attention_mask == 0).long().sum(dim=1)  # (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = torch.full((scores.shape[0],), input_ids.shape[1], dtype=torch.long, device=scores.device)
        if self.padding is not None:
            positions = positions - self.padding.to(scores.device)  # the drawn token's position id
        draws = perturbed_argmax(self.warp(scores.float()), self.keys.to(scores.device), positions)
        return torch.full_like(scores, -torch.inf).scatter_(1, draws[:, None], 0.0)
