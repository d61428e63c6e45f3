"""EAGLE drafter: autoregressive drafting in the backbone's feature space.

At position ``t`` the drafter reads the backbone's top-layer feature ``f_t`` (after the final
norm, what :meth:`~heads.backbone.Backbone.features` returns) and the embedding ``e_{t+1}`` of
the next token (the backbone's own frozen input embeddings), projects ``[e_{t+1}; f_t]``
(``2d -> d``), runs it through a small decoder of the backbone's family and width and predicts
``f_{t+1}``; the backbone's frozen output head (with the family's soft-capping) turns that into
token logits. Drafting deeper feeds the predicted feature back in place of ``f_{t+1}``
(EAGLE-1), growing a dynamic tree (EAGLE-2, :func:`tree_attention.tree.dynamic_tree`).

The decoder is a ``num_layers``-layer copy of the backbone's own base model
(:func:`heads.backbone.decoder_copy`) run through its public forward with ``inputs_embeds``,
``position_ids``, a 4D mask and its own ``Cache``; there is no forked modeling code. Its token
embedding table is removed, so the adapter holds only drafter tensors.

Options (EAGLE-3 style):

* ``feature_layers=(low, mid, high)``: the drafter reads a linear fusion (``k·d -> d``) of those
  backbone layers' hidden states instead of ``f_t`` alone. Deeper drafting steps feed back the
  drafter's own output, so train with ``unroll_steps > 1`` (training-time test) for this option.
* ``draft_vocab_size``: logits over a reduced vocabulary, the rows of the frozen output head for
  the most frequent target tokens of the training data; the ``token_map`` buffer maps draft ids
  back to target ids and travels in the adapter. Until training sets it, the map is the first
  ``draft_vocab_size`` ids.

Deviations from EAGLE-1, all for a family-agnostic build: the family's input layernorm of the
first decoder layer is kept (EAGLE-1 drops it); the copy's final norm is kept and trained, so the
prediction lives in the post-norm space of ``f``; the projection has a bias (EAGLE-3's has none);
absolute-position families (GPT-2) keep the copy's own trainable position table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

import torch
from torch import nn

from tree_attention import cache as cache_ops
from tree_attention.mask import AttentionMask, layout_masks, tree_attention_mask, tree_position_ids
from tree_attention.tree import Expansion, Tree, dynamic_tree

from .backbone import Backbone, attention_layout, decoder_copy

# Defaults of the dynamic tree: the wall-clock optimum (highest speedup over model.generate, averaged over
# the code and prose mixes) of benchmarks/bench_speedup.py on the demo target, 2-core CPU, 1 thread, in two
# runs (results/speedup.json 1.10x, speedup_run1.json 1.11x): a chain (top_k 1) of 4. Chains win on code
# (1.27-1.29x) and lose on prose (0.91-0.95x); wider trees (top_k 2-10, 8-60 nodes) accept more (tau up to
# 3.6 against 2.8) but each drafting level costs about 3 ms here, a third of a target forward, so depth
# and width cost more than they gain. Where verification is nearly free (a GPU at batch 1), start from
# EAGLE-2's depth 7, top_k 10, 60 tokens. A node count alone (``with_tree(n)``) changes only the budget;
# widen the tree with ``top_k``.
DEFAULT_DEPTH = 4
DEFAULT_TOP_K = 1
DEFAULT_TOTAL_TOKENS = 4
_TREE_FIELDS = ("depth", "top_k", "total_tokens")


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

    def __post_init__(self) -> None:
        _positive_int(self.num_layers, "num_layers")
        _positive_int(self.depth, "depth")
        _positive_int(self.top_k, "top_k")
        _positive_int(self.total_tokens, "total_tokens", low=0)
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
        if tree is None:
            return self
        if isinstance(tree, Mapping):
            unknown = set(tree) - set(_TREE_FIELDS)
            if unknown:
                raise ValueError(f"EAGLE tree options are {_TREE_FIELDS}; got unknown {sorted(unknown)}")
            shape = dict(tree)
        elif isinstance(tree, bool) or not isinstance(tree, int):
            raise ValueError(f"an EAGLE tree is a node count (total_tokens) or a mapping of {_TREE_FIELDS}; "
                             f"got {tree!r}")
        else:
            shape = {"total_tokens": tree}
        total = shape.get("total_tokens")
        if "depth" not in shape and isinstance(total, int) and not isinstance(total, bool) and total >= 1:
            shape["depth"] = min(self.depth, total)
        return replace(self, **shape)

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.feature_layers is not None:
            data["feature_layers"] = list(self.feature_layers)
        return data


def unrolled_attention_mask(length: int, step: int, layout, dtype: torch.dtype,
                            device: torch.device | str) -> AttentionMask:
    """Mask of drafting step ``step`` (>= 1) over a sequence of ``length`` origins, for training.

    Keys are ``step`` blocks of ``length`` entries: block 1 holds the teacher-forced pairs,
    block ``i`` the pairs of unrolled step ``i``. The query of origin ``t`` at step ``step`` sits at
    position ``t + step - 1`` and sees block-1 entries ``<= t`` and its own chain's entries in
    blocks 2..step, exactly what a node at that depth of a draft tree sees at decode time.
    Returns ``[1, 1, length, step * length]`` (or a dict per layer type).
    """
    origins = torch.arange(length, device=device)
    blocks = [torch.ones(length, length, dtype=torch.bool, device=device).tril_()]
    blocks += [torch.eye(length, dtype=torch.bool, device=device)] * (step - 1)
    visible = torch.cat(blocks, dim=1).unsqueeze(0)  # (1, T, step*T)
    key_positions = torch.cat([origins + block for block in range(step)]).unsqueeze(0)
    return layout_masks(visible, (origins + step - 1).unsqueeze(0), key_positions, layout, dtype)


def _expand_batch(mask: AttentionMask, batch: int) -> AttentionMask:
    if isinstance(mask, dict):
        return {kind: value.expand(batch, -1, -1, -1) for kind, value in mask.items()}
    return mask.expand(batch, -1, -1, -1)


class EagleHeads(nn.Module):
    """The trainable drafter: fusion (option), projection and decoder copy; the only tensors in
    the adapter (plus ``token_map`` with a reduced vocabulary)."""

    def __init__(self, config: EagleConfig, target: Backbone) -> None:
        super().__init__()
        _check_against_target(config, target)
        self.config = config
        hidden = target.hidden_size
        self.hidden_size = hidden
        layers = config.feature_layers
        self.feature_size = hidden * (len(layers) if layers else 1)
        self.fusion = nn.Linear(self.feature_size, hidden, bias=False) if layers else None
        self.projection = nn.Linear(2 * hidden, hidden)
        self.decoder = decoder_copy(target, config.num_layers)
        self.layout = attention_layout(self.decoder.config)
        self._cache_keyword = cache_ops.cache_keyword(self.decoder)
        if config.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))
        else:
            self.token_map = None

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.token_map is None else int(self.token_map.numel())

    def set_token_map(self, token_ids: torch.Tensor) -> None:
        """Use ``token_ids`` ``[V']`` (distinct target ids) as the draft vocabulary."""
        if self.token_map is None:
            raise ValueError("set_token_map: this drafter has no reduced vocabulary (draft_vocab_size=None)")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.shape != self.token_map.shape or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(f"token_map must hold {self.token_map.numel()} distinct ids; got shape "
                             f"{tuple(token_ids.shape)}")
        self.token_map.copy_(token_ids)

    def draft_rows(self, target: Backbone):
        """Output-head rows of the draft vocabulary for ``target.logits`` (None: whole vocabulary)."""
        return None if self.token_map is None else target.output_rows(self.token_map)

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the identity without a reduced vocabulary)."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, T, F]`` backbone features → ``[B, T, d]`` drafter input (fusion or identity)."""
        if features.shape[-1] != self.feature_size:
            raise ValueError(f"features must have {self.feature_size} channels; got {features.shape[-1]}")
        return features if self.fusion is None else self.fusion(features)

    def step(self, features: torch.Tensor, token_embeddings: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: AttentionMask, cache) -> torch.Tensor:
        """One drafter application: features ``[B, T, d]`` and next-token embeddings ``[B, T, d]`` at
        positions ``[B, T]`` → predicted next features ``[B, T, d]``; appends ``T`` entries to ``cache``."""
        inputs = self.projection(torch.cat([token_embeddings, features], dim=-1))  # (B, T, d)
        outputs = self.decoder(inputs_embeds=inputs, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None, **{self._cache_keyword: cache})
        return outputs.last_hidden_state

    def forward(self, features: torch.Tensor, token_embeddings: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Training forward, unrolled ``steps`` drafting steps over whole sequences.

        Args:
            features: ``[B, T, F]`` the backbone's features at every position (noise already added).
            token_embeddings: ``[B, T, d]`` embeddings of the tokens at every position.
        Returns ``steps`` tensors ``[B, T, d]``; entry ``j - 1`` at origin ``t`` is the prediction of
        the feature at ``t + j`` after ``j - 1`` steps on the drafter's own predicted features
        (rows with ``t + j >= T`` are padding).
        """
        batch, length, _ = features.shape
        cache = cache_ops.new_cache()
        inputs = self.fuse(features)
        positions = torch.arange(length, device=features.device).expand(batch, length)
        padded = torch.cat([token_embeddings, token_embeddings.new_zeros(batch, steps, self.hidden_size)], dim=1)
        outputs = []
        for step in range(1, steps + 1):
            mask = unrolled_attention_mask(length, step, self.layout, inputs.dtype, features.device)
            inputs = self.step(inputs, padded[:, step:step + length], positions + step - 1,
                               _expand_batch(mask, batch), cache)  # (B, T, d)
            outputs.append(inputs)
        return outputs


def _check_against_target(config: EagleConfig, target: Backbone) -> None:
    if config.feature_layers is not None:
        bad = [index for index in config.feature_layers if index > target.num_layers]
        if bad:
            raise ValueError(
                f"EagleConfig.feature_layers {list(config.feature_layers)}: {bad} out of range 0..{target.num_layers} "
                f"for this {target.num_layers}-layer {target.model_type} (0: embeddings, {target.num_layers}: top layer)"
            )
    vocab = config.draft_vocab_size or target.vocab_size
    if config.draft_vocab_size is not None and config.draft_vocab_size > target.vocab_size:
        raise ValueError(f"EagleConfig.draft_vocab_size ({config.draft_vocab_size}) exceeds the backbone's "
                         f"vocabulary ({target.vocab_size})")
    if config.top_k > vocab:
        raise ValueError(f"EagleConfig.top_k ({config.top_k}) exceeds the draft vocabulary ({vocab})")


class EagleDrafter:
    """Proposes one dynamic tree per step (``tree_attention.decode.Drafter``).

    Keeps its own KV cache in step with the accepted path: ``cache`` holds ``committed_length``
    entries, entry ``i`` written by the pair (target feature at ``i``, token at ``i + 1``), plus
    whatever the last tree expansion appended; each :meth:`propose` crops the expansion away,
    appends the newly committed pairs and expands a new tree on top.
    """

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig) -> None:
        _check_against_target(config, target)
        self.heads = heads
        self.target = target
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens
        self.reset()

    def reset(self) -> None:
        """Forget the previous sequence: empty cache."""
        self.cache = cache_ops.new_cache()
        self.committed_length = 0

    def _children(self, hidden: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k next tokens (target ids) and their log-probabilities ``[m, top_k]`` from predicted
        features ``[m, d]``."""
        log_probs = torch.log_softmax(self.target.logits(hidden, rows).float(), dim=-1)  # (m, V')
        best = torch.topk(log_probs, self.top_k, dim=-1)
        return self.heads.target_ids(best.indices), best.values

    def _commit(self, features: torch.Tensor, tokens: torch.Tensor, root: int) -> torch.Tensor:
        """Append the pairs (features[i], tokens[i + 1]) and (features[-1], root); return the
        predicted feature at the root's position ``[d]``."""
        cache_ops.crop(self.cache, self.committed_length)
        count = tokens.shape[1]
        device = tokens.device
        next_tokens = torch.cat([tokens[0, 1:], torch.tensor([root], dtype=torch.long, device=device)])
        embeddings = self.target.input_embeddings(next_tokens).unsqueeze(0)  # (1, n, d)
        depths = torch.arange(count, device=device)
        chain = torch.ones(count, count, dtype=torch.bool, device=device).tril_()
        dtype = embeddings.dtype
        mask = tree_attention_mask(self.committed_length, chain, depths, self.heads.layout, dtype)
        positions = tree_position_ids(self.committed_length, depths)
        predicted = self.heads.step(self.heads.fuse(features.to(dtype)), embeddings, positions, mask, self.cache)
        self.committed_length += count
        return predicted[0, -1]

    @torch.no_grad()
    def propose(self, features: torch.Tensor, tokens: torch.Tensor, root: int) -> Tree:
        """A dynamic tree rooted at ``root``; ``features`` ``[1, n, F]`` and ``tokens`` ``[1, n]`` are
        the target's at the ``n`` positions committed since the last call."""
        root_feature = self._commit(features, tokens, root)  # (d,)
        rows = self.heads.draft_rows(self.target)
        child_tokens, child_log_probs = self._children(root_feature[None], rows)
        base = self.committed_length
        device = root_feature.device
        outputs = root_feature[None]  # (1 + E, d): the root's prediction, then each expanded node's
        key_positions = torch.arange(base, device=device)

        def expand(request: Expansion) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal outputs, key_positions
            parents = outputs[request.parents + 1]  # (m, d) the parents' predicted features
            count = request.tokens.numel()
            query_positions = torch.full((1, count), base - 1 + request.depth, dtype=torch.long, device=device)
            key_positions = torch.cat([key_positions, query_positions[0]])
            visible = torch.cat([request.ancestors.new_ones(count, base), request.ancestors], dim=1)[None]
            mask = layout_masks(visible, query_positions, key_positions[None], self.heads.layout, parents.dtype)
            embeddings = self.target.input_embeddings(request.tokens)[None]  # (1, m, d)
            predicted = self.heads.step(parents[None], embeddings, query_positions, mask, self.cache)[0]
            outputs = torch.cat([outputs, predicted])
            return self._children(predicted, rows)

        return dynamic_tree(root, (child_tokens[0], child_log_probs[0]), expand,
                            self.depth, self.top_k, self.total_tokens)
