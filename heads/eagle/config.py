"""Hyper-parameters of an EAGLE drafter and its dynamic draft tree."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

from tree_attention.dynamic import DYNAMIC_FIELDS, check_dynamic_size, dynamic_shape_overrides
from tree_attention.tree import check_tree_size

from ..families import EAGLE_LAYOUT_FAMILIES
from ..kind import SAMPLE_MODES

# Defaults of the dynamic tree: a chain (top_k 1) up to 8 deep that stops where its calibrated chance of
# being accepted in full falls below one half (min_acceptance; the calibration is learned while serving).
# Wider trees (top_k 2-10) accept more, but each drafting level costs a sizeable share of a target
# forward on a CPU; where verification is nearly free (a GPU at batch 1), start from EAGLE-2's depth 7,
# top_k 10, 60 tokens. The runs that chose these are in CHANGELOG.md (2026-12-03).
# A node count alone (``with_tree(n)``) changes only the budget; widen the tree with ``top_k``.
DEFAULT_DEPTH = 8
DEFAULT_TOP_K = 1
DEFAULT_TOTAL_TOKENS = 8
DEFAULT_MIN_ACCEPTANCE = 0.5
DEFAULT_SIBLINGS = 1
# A block drafter's levels cost a small head, not a drafter forward, so its default is a tree: every
# depth the block predicts, the 4 best children per node, the 16 best paths (attach_heads and
# selfdraft train with --parallel-mode block, when no shape is given; CHANGELOG.md, 2026-12-06).
DEFAULT_BLOCK_TOP_K = 4
DEFAULT_BLOCK_TOTAL_TOKENS = 16
_TREE_FIELDS = DYNAMIC_FIELDS
LAYOUTS = tuple(EAGLE_LAYOUT_FAMILIES)
DRAFTING_MODES = ("sequential", "parallel", "auto")
PARALLEL_MODES = ("heads", "mask", "block")
HEAD_INPUTS = ("prediction", "feature")


def _positive_int(value: object, name: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"EagleConfig.{name} must be an int >= {low}; got {value!r}")


@dataclass
class EagleConfig:
    """Hyper-parameters of an EAGLE drafter and its dynamic draft tree."""

    num_layers: int = 1
    """Decoder layers of the drafter (EAGLE uses 1)."""
    depth: int = DEFAULT_DEPTH
    """Deepest level of the draft tree: drafter forwards per step beyond the first."""
    top_k: int = DEFAULT_TOP_K
    """Children per expanded node, and nodes expanded per level (EAGLE-2)."""
    total_tokens: int = DEFAULT_TOTAL_TOKENS
    """Drafted nodes verified per step (the best by path probability; root excluded). At least
    ``depth``; 0 drafts nothing (every step verifies the root alone: plain decoding, tau 1)."""
    feature_layers: Sequence[int] | None = None
    """Backbone hidden states fused as the drafter's input (EAGLE-3): 0 is the embedding output,
    i the output of decoder layer i, num_hidden_layers the top-layer features. None: top only."""
    draft_vocab_size: int | None = None
    """Size of a reduced draft vocabulary (EAGLE-3); None: the backbone's whole vocabulary."""
    layout: str = "native"
    """Drafter architecture: ``native`` (selfdraft's, any family), ``eagle1`` (the EAGLE-1 layer:
    no first input layernorm, no final norm) or ``eagle3`` (the EAGLE-3 midlayer; needs three
    ``feature_layers``). The last two export to the EAGLE/EAGLE-3 checkpoint layouts."""
    parallel: int = 1
    """Depths drafted from one drafter forward per step (parallel drafting). 1: EAGLE's
    sequential drafting (one drafter forward per tree level, dynamic tree). ``K > 1``: the forward
    that commits the new pairs gives depth 1 and ``parallel_mode``'s heads or mask queries depths
    2..K, all at once; the tree is then a static top-k tree
    over those depths (:mod:`heads.eagle.parallel`): ``min(depth, K)`` deep, at most ``top_k``
    candidates per depth, ``total_tokens`` nodes chosen best-first by measured (else prior)
    per-depth, per-rank accuracy. Where depths 2..K come from: ``parallel_mode``."""
    parallel_mode: str | None = None
    """``parallel`` > 1 only: where the one-forward tree's depths 2..K come from. ``heads``
    (``attach_heads`` and ``selfdraft train``'s default): ``K - 1`` Medusa-style heads
    (``parallel_heads``: a residual block and their own output rows over the draft vocabulary,
    started from the output head's) read what ``head_input`` names at the root with its gradient
    stopped; depth 1 is the drafter's own prediction.
    Nothing they learn touches the drafter's layer, which trains exactly as a sequential drafter's.
    ``mask``: ``K - 1`` learned mask queries (``mask_feature``, ``mask_embedding``) run in the
    committing forward after each row's last pair (P-EAGLE/PARD style); they share the layer and
    pull it their way (``mask_query_weight``). ``block``: a block drafter with a sequential head
    (DSpark style, :mod:`heads.eagle.block`): the mask queries of ``mask`` mode give each depth's
    feature in one forward, and a small head (``sequential_head``) refines depth ``j + 1``'s from the
    token drafted at depth ``j``, so a node's children depend on its own token; trees grow
    dynamically (best-first by path probability, or sampled) up to ``min(depth, K)`` deep, each level
    costing the head, not a drafter forward. None: ``mask`` (adapters written before this field)."""
    head_input: str | None = None
    """``heads`` mode only: what the parallel heads read, with its gradient stopped. ``prediction``
    (``attach_heads`` and ``selfdraft train``'s default): the drafter's own depth-1 prediction at the
    root (the feature it predicts for the root's position, as the output head reads it), which has
    attended over the drafter's cache and seen the root token; ``feature``: the root's drafter input
    feature (the backbone's top feature, or the fused ones), as Medusa's heads read it. The
    prediction carries the root token's information, so later depths accept more (CHANGELOG.md,
    2026-12-04). None: ``feature`` (adapters written before this field)."""
    drafting: str | None = None
    """How a drafter trained with ``parallel = K > 1`` drafts: ``parallel`` (one forward per step,
    the static tree above), ``sequential`` (EAGLE's dynamic tree of ``depth``/``top_k``/
    ``total_tokens``, one forward per level; the parallel depths unused) or ``auto``: greedy calls
    measure the tokens per second of each mode on this machine and draft with the faster
    (:mod:`heads.eagle.switch`), the parallel mode with a tree of ``parallel_tokens`` nodes; a
    lossless sampled call drafts in one mode throughout, the one whole calls at its sampling
    settings measured faster (the other now and then); typical-acceptance calls draft sequentially.
    Which mode drafts never changes a greedy output. None: ``sequential``
    for ``parallel`` 1, ``parallel`` otherwise (adapters written before this field). ``selfdraft
    train --kind eagle`` trains ``parallel`` 3 with ``auto`` by default."""
    parallel_tokens: int = 16
    """``drafting="auto"`` only: drafted nodes of the parallel mode's static tree (best-first over
    all ``K`` depths and the ranks of the measured accuracy table)."""

    confidence: float = 0.0
    """Chains (``top_k`` 1) only: a row's chain stops below a node whose drafter distribution gives
    its top token less than this probability (like transformers' ``assistant_confidence_threshold``
    and the draft kind's ``confidence``), so a deep chain costs its drafter forwards only where the
    drafter is sure. 0: always ``depth`` nodes."""
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE
    """Chains (``top_k`` 1) only: a row's chain stops growing once the estimated probability that
    every node so far is accepted falls below this. Each node's acceptance is estimated from its
    drafter probability through a calibration learned while serving (the acceptance rate of this
    drafter's earlier chain nodes of similar probability, :class:`heads.eagle.drafter.ChainCalibration`;
    optimistic until there is evidence), so one setting holds across adapters whose raw
    probabilities differ (unlike ``confidence``). A level is worth its drafter forward when this
    probability exceeds about ``tau x t_level / t_step`` (0.15-0.2 on the shipped targets). 0: off."""
    siblings: int = DEFAULT_SIBLINGS
    """Chains (``top_k`` 1) with top-k candidates only (greedy decoding, typical acceptance; not
    sampled draws): at each level where the chain is unsure, the drafter's next ``siblings`` best
    tokens join the tree as leaves beside the chain's node, at no extra drafter forward. A level
    gets them when the chance that the chain reaches it and its node is rejected (the calibration's
    estimate, see ``min_acceptance``) exceeds :data:`heads.eagle.drafter.SIBLING_GAIN`, within the
    ``total_tokens`` budget left by the chain (shallower levels first): they pay where a chain's
    node is often rejected, as a chain's second token is on prose (CHANGELOG.md, 2026-12-04).
    0: plain chains."""
    sample: str = "auto"
    """Candidates under lossless sampling (``do_sample=True``): ``auto`` (and ``always``, the same
    here) draws each expanded node's ``top_k`` children without replacement from the drafter's
    distribution warped like the target's and keeps the ``total_tokens`` best slots by a key fixed
    before their tokens are drawn (:func:`tree_attention.sampled.grow_sampled_tree`: every node
    that can still enter the budget is expanded, so a level may expand more than ``top_k`` nodes);
    ``never`` keeps EAGLE-2's tree of top-k tokens (point masses). Greedy decoding and typical
    acceptance always draft the top-k tree."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"EagleConfig.layout must be one of {LAYOUTS}; got {self.layout!r}")
        _positive_int(self.num_layers, "num_layers")
        if self.sample not in SAMPLE_MODES:
            raise ValueError(f"EagleConfig.sample must be one of {SAMPLE_MODES}; got {self.sample!r}")
        _positive_int(self.depth, "depth")
        _positive_int(self.top_k, "top_k")
        _positive_int(self.total_tokens, "total_tokens", low=0)
        _positive_int(self.parallel, "parallel")
        _positive_int(self.parallel_tokens, "parallel_tokens")
        _positive_int(self.siblings, "siblings", low=0)
        check_dynamic_size(self.depth, self.top_k, self.total_tokens, "EagleConfig")
        check_tree_size(self.parallel_tokens, "EagleConfig.parallel_tokens")
        check_tree_size(self.siblings, "EagleConfig.siblings")
        if self.parallel_mode is None:
            self.parallel_mode = "mask"
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"EagleConfig.parallel_mode must be one of {PARALLEL_MODES}; got {self.parallel_mode!r}")
        if self.head_input is None:
            self.head_input = "feature"
        if self.head_input not in HEAD_INPUTS:
            raise ValueError(f"EagleConfig.head_input must be one of {HEAD_INPUTS}; got {self.head_input!r}")
        if self.drafting is None:
            self.drafting = "sequential" if self.parallel == 1 else "parallel"
        if self.drafting not in DRAFTING_MODES:
            raise ValueError(f"EagleConfig.drafting must be one of {DRAFTING_MODES}; got {self.drafting!r}")
        if self.parallel_mode == "block" and self.drafting == "auto":
            raise ValueError("EagleConfig.drafting 'auto' switches between sequential drafting and a static parallel "
                             "tree; a 'block' drafter grows its trees with its sequential head: use drafting "
                             "'parallel' (the block drafter) or 'sequential'")
        if self.drafting != "sequential" and self.parallel == 1:
            raise ValueError(f"EagleConfig.drafting {self.drafting!r} needs a drafter trained for parallel drafting "
                             f"(parallel >= 2); this one has parallel=1")
        if isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float)) or \
                not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"EagleConfig.confidence must be a probability in [0, 1); got {self.confidence!r}")
        if isinstance(self.min_acceptance, bool) or not isinstance(self.min_acceptance, (int, float)) or \
                not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"EagleConfig.min_acceptance must be a probability in [0, 1); got {self.min_acceptance!r}")
        if 0 < self.total_tokens < self.depth:
            raise ValueError(f"EagleConfig.total_tokens ({self.total_tokens}) must be >= depth ({self.depth}): a "
                             f"tree of {self.total_tokens} drafted nodes is at most {self.total_tokens} deep "
                             f"(total_tokens=0: no drafting)")
        if self.feature_layers is not None:
            if isinstance(self.feature_layers, (str, bytes)) or not isinstance(self.feature_layers, Sequence):
                raise ValueError(f"EagleConfig.feature_layers must be a list of layer indices; got "
                                 f"{self.feature_layers!r}")
            layers = tuple(self.feature_layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"EagleConfig.feature_layers must be non-negative layer indices; got {list(layers)}")
            if len(set(layers)) != len(layers):
                raise ValueError(f"EagleConfig.feature_layers has repeated layers: {list(layers)}")
            self.feature_layers = layers
        if self.draft_vocab_size is not None:
            _positive_int(self.draft_vocab_size, "draft_vocab_size")
            if self.draft_vocab_size < self.top_k:
                raise ValueError(f"EagleConfig.draft_vocab_size ({self.draft_vocab_size}) must be >= "
                                 f"top_k ({self.top_k})")
            if self.draft_vocab_size <= self.siblings:
                raise ValueError(f"EagleConfig.draft_vocab_size ({self.draft_vocab_size}) must exceed "
                                 f"siblings ({self.siblings}): a chain node and its siblings are distinct tokens")
        if self.layout == "eagle3":
            if self.feature_layers is None or len(self.feature_layers) != 3:
                raise ValueError("EagleConfig.layout 'eagle3' fuses exactly three backbone layers (fc: 3d -> d); "
                                 f"give feature_layers of length 3, got {self.feature_layers!r}")
            if self.num_layers != 1:
                raise ValueError(f"EagleConfig.layout 'eagle3' has one midlayer; num_layers must be 1, "
                                 f"got {self.num_layers}")

    @property
    def tree(self) -> dict:
        """The configured dynamic tree shape (what ``SpeculativeModel.set_tree(None)`` uses)."""
        return {name: getattr(self, name) for name in _TREE_FIELDS}

    def with_tree(self, tree: int | Mapping[str, int] | None) -> "EagleConfig":
        """This config with another tree shape: a total node count, or a mapping of
        ``depth``/``top_k``/``total_tokens`` overrides (None: unchanged).

        A shape that sets ``total_tokens`` (>= 1) but not ``depth`` lowers ``depth`` to fit it:
        ``with_tree(4)`` of a depth-6 config gives depth 4. An explicit ``depth`` deeper than
        ``total_tokens`` is a ValueError, as in the constructor."""
        shape = dynamic_shape_overrides(tree, self.depth, "EAGLE")
        if shape is None:
            return self
        return replace(self, **shape)

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.feature_layers is not None:
            data["feature_layers"] = list(self.feature_layers)
        return data
