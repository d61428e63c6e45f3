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

Layouts (``EagleConfig.layout``):

* ``native`` (default, any family that passes the probe). Deviations from EAGLE-1, all for a
  family-agnostic build: the family's input layernorm of the first decoder layer is kept (EAGLE-1
  drops it); the copy's final norm is kept and trained, so the prediction lives in the post-norm
  space of ``f``; absolute-position families (GPT-2) keep the copy's own trainable position table.
  The projection has a bias, as in EAGLE-1 (EAGLE-3's fc has none).
* ``eagle1`` (llama, mistral, qwen2): exactly the EAGLE-1 layer (SafeAILab ``cnets1.py``, vLLM
  ``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``): ``fc`` (the projection, with bias)
  over ``[e_{t+1}; f_t]``, the copy's first input layernorm and final norm replaced by identities,
  so the layer's residual output goes straight into the output head and is regressed onto the
  post-norm ``f``, as EAGLE-1 does.
* ``eagle3`` (llama; three ``feature_layers``): the EAGLE-3 midlayer (SpecForge
  ``llama3_eagle.py``, SGLang/vLLM ``llama_eagle3.py``), :class:`Eagle3Midlayer`: ``fusion`` is
  ``fc``; no projection; attention over ``[input_layernorm(e); hidden_norm(h)]`` with ``2d``-input
  q/k/v and residual ``h``; the pre-norm output is fed back at deeper steps and the drafter's
  ``norm`` is applied before the output head (through :meth:`EagleHeads.draft_rows`). The output
  head stays the target's frozen one (its draft-vocabulary rows), where an EAGLE-3 checkpoint holds
  its own ``lm_head`` (exported as those rows); training keeps the feature regression, on
  ``norm(output)`` (EAGLE-3 has none: set ``feature_weight=0`` for its recipe).

The two external layouts export to those checkpoint formats (:mod:`heads.interop_eagle`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

import torch
from torch import nn

from tree_attention import cache as cache_ops
from tree_attention.mask import AttentionMask, layout_masks
from tree_attention.tree import Tree, grow_dynamic_tree

from .backbone import EAGLE_LAYOUT_FAMILIES, Backbone, attention_layout, check_eagle_layout, decoder_copy, eagle3_parts

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
LAYOUTS = tuple(EAGLE_LAYOUT_FAMILIES)


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

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"EagleConfig.layout must be one of {LAYOUTS}; got {self.layout!r}")
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


class Eagle3Midlayer(nn.Module):
    """The EAGLE-3 midlayer, assembled from the family's own modules (:func:`heads.backbone.eagle3_parts`).

    ``residual = h``; attention over ``[input_layernorm(e); hidden_norm(h)]`` (``2d``, q/k/v take
    ``2d`` inputs); ``+ residual``; ``post_attention_layernorm`` and ``mlp`` with a residual. Returns
    the pre-norm output, which deeper drafting steps feed back; ``norm`` (applied by
    :meth:`EagleHeads.draft_rows` through ``Backbone.logits``) maps it to the output head.
    """

    def __init__(self, target: Backbone) -> None:
        super().__init__()
        parts = eagle3_parts(target)
        self.config = parts.pop("config")
        for name, module in parts.items():
            setattr(self, name, module)
        self._cache_keyword = cache_ops.cache_keyword(self.self_attn)

    def forward(self, hidden: torch.Tensor, token_embeddings: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: AttentionMask, cache) -> torch.Tensor:
        """``hidden`` and ``token_embeddings`` ``[B, T, d]`` at ``position_ids`` ``[B, T]`` → ``[B, T, d]``
        (pre-norm); appends ``T`` entries to ``cache`` (layer 0)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        inputs = torch.cat([self.input_layernorm(token_embeddings), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2d)
        attended, _ = self.self_attn(hidden_states=inputs, position_embeddings=position_embeddings,
                                     attention_mask=attention_mask, **{self._cache_keyword: cache})
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHeads(nn.Module):
    """The trainable drafter: fusion (option), projection and decoder copy (``native``/``eagle1``
    layouts) or fusion and :class:`Eagle3Midlayer` (``eagle3``); the only tensors in the adapter
    (plus ``token_map`` with a reduced vocabulary)."""

    def __init__(self, config: EagleConfig, target: Backbone) -> None:
        super().__init__()
        _check_against_target(config, target)
        self.config = config
        hidden = target.hidden_size
        self.hidden_size = hidden
        layers = config.feature_layers
        self.feature_size = hidden * (len(layers) if layers else 1)
        self.fusion = nn.Linear(self.feature_size, hidden, bias=False) if layers else None
        if config.layout == "eagle3":
            self.projection = None
            self.decoder = Eagle3Midlayer(target)
        else:
            self.projection = nn.Linear(2 * hidden, hidden)
            self.decoder = decoder_copy(target, config.num_layers, config.layout)
            self._cache_keyword = cache_ops.cache_keyword(self.decoder)
        self.layout = attention_layout(self.decoder.config)
        if config.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))
        else:
            self.token_map = None

    @property
    def output_norm(self) -> nn.Module | None:
        """The drafter's final norm between its output and the output head (``eagle3`` only)."""
        return self.decoder.norm if self.projection is None else None

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
        """What ``target.logits`` turns predicted features into logits with: the output-head rows
        of the draft vocabulary, after the drafter's own final norm (``eagle3``); None for the
        plain output head (whole vocabulary, no norm)."""
        if self.token_map is None and self.output_norm is None:
            return None
        return target.output_rows(self.token_map, self.output_norm)

    def head_features(self, predicted: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[..., d]`` as the output head reads them (after ``eagle3``'s final
        norm; the features themselves otherwise), comparable with the backbone's top features."""
        return predicted if self.output_norm is None else self.output_norm(predicted)

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
        positions ``[B, T]`` → predicted next features ``[B, T, d]``; appends ``T`` entries to ``cache``.
        (``eagle3``: the midlayer's pre-norm output; see :meth:`draft_rows`.)"""
        if self.projection is None:
            return self.decoder(features, token_embeddings, position_ids, attention_mask, cache)
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
    check_eagle_layout(target, config.layout)
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
    """Proposes one dynamic tree per row and step (``tree_attention.decode.Drafter``), all rows
    of a batch in one drafter forward per tree level.

    Keeps its own batch cache (:class:`~tree_attention.cache.RaggedCache`) in step with each
    row's accepted path: a row's live entries are its committed pairs, entry ``i`` written by
    (target feature at ``i``, token at ``i + 1``); the last tree expansion sits past the
    bookkeeping's width. Each :meth:`propose` crops the expansion away, appends every row's newly
    committed pairs (ragged: shorter rows leave holes) and grows all rows' trees in lockstep
    (:func:`tree_attention.tree.grow_dynamic_tree`).
    """

    def __init__(self, heads: EagleHeads, target: Backbone, config: EagleConfig) -> None:
        _check_against_target(config, target)
        self.heads = heads
        self.target = target
        self.depth, self.top_k, self.total_tokens = config.depth, config.top_k, config.total_tokens
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        """Forget earlier sequences: an empty cache for ``batch_size`` rows."""
        device = next(self.heads.parameters()).device
        self.cache = cache_ops.RaggedCache(batch_size, device)
        self.rows = list(range(batch_size))
        self.committed = torch.zeros(batch_size, dtype=torch.long, device=device)  # pairs per row

    def _children(self, hidden: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k next tokens (target ids) and their log-probabilities ``[m, top_k]`` from predicted
        features ``[m, d]``."""
        log_probs = torch.log_softmax(self.target.logits(hidden, rows).float(), dim=-1)  # (m, V')
        best = torch.topk(log_probs, self.top_k, dim=-1)
        return self.heads.target_ids(best.indices), best.values

    def _follow(self, rows: Sequence[int]) -> None:
        """Drop the cache rows of sequences that left the batch."""
        if list(rows) != self.rows:
            index = torch.tensor([self.rows.index(row) for row in rows], device=self.committed.device)
            self.cache.select_rows(index)
            self.committed = self.committed[index]
            self.rows = list(rows)

    def _commit(self, features: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                roots: Sequence[int]) -> torch.Tensor:
        """Append each row's pairs (features[i], tokens[i + 1]) and (features[-1], root); return
        the predicted features at the roots' positions ``[R, d]``."""
        self.cache.crop()
        counts = [row_tokens.shape[1] for row_tokens in tokens]
        width = max(counts)
        device = self.committed.device
        dtype = self.target.dtype
        rows = len(counts)
        padded_features = torch.zeros(rows, width, features[0].shape[-1], dtype=dtype, device=device)
        next_tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
        for row, (row_features, row_tokens, root) in enumerate(zip(features, tokens, roots)):
            count = counts[row]
            padded_features[row, :count] = row_features[0].to(dtype)
            next_tokens[row, :count - 1] = row_tokens[0, 1:]
            next_tokens[row, count - 1] = root
        columns = torch.arange(width, device=device)
        valid = columns[None, :] < torch.tensor(counts, device=device)[:, None]  # (R, n)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril_()
        visible = causal[None] & (valid[:, None, :] | torch.eye(width, dtype=torch.bool, device=device)[None])
        positions = self.committed[:, None] + columns[None, :]
        mask = self.cache.mask(positions, visible, self.heads.layout, dtype)
        embeddings = self.target.input_embeddings(next_tokens)  # (R, n, d)
        predicted = self.heads.step(self.heads.fuse(padded_features), embeddings, positions, mask, self.cache.cache)
        self.cache.extend(valid, positions)
        self.committed = self.committed + valid.sum(dim=1)
        last = torch.tensor(counts, device=device) - 1
        return predicted[torch.arange(rows, device=device), last]  # (R, d)

    @torch.no_grad()
    def propose(self, rows, features, tokens, roots) -> list[Tree]:
        """One dynamic tree per row; ``features[i]`` ``[1, n, F]`` and ``tokens[i]`` ``[1, n]`` are
        row ``rows[i]``'s target features and tokens at the positions committed since the last call."""
        self._follow(rows)
        root_features = self._commit(features, tokens, roots)  # (R, d)
        self.cache.compact()
        draft_rows = self.heads.draft_rows(self.target)
        child_tokens, child_log_probs = self._children(root_features, draft_rows)
        count, device = len(roots), root_features.device
        growths = [grow_dynamic_tree(root, (child_tokens[row], child_log_probs[row]), self.depth, self.top_k,
                                     self.total_tokens) for row, root in enumerate(roots)]
        trees: list[Tree | None] = [None] * count
        requests = [self._advance(growth, None, trees, row) for row, growth in enumerate(growths)]
        outputs = [root_features[row:row + 1] for row in range(count)]  # per row: the root's, then each expanded node's
        columns: list[list[int]] = [[] for _ in range(count)]  # per row: expansion slot of each expanded node
        expansion_positions = torch.zeros(count, 0, dtype=torch.long, device=device)
        while any(request is not None for request in requests):
            width = max(request.tokens.numel() if request is not None else 0 for request in requests) or 1
            grown = expansion_positions.shape[1]
            parents = torch.zeros(count, width, root_features.shape[-1], dtype=root_features.dtype, device=device)
            query_tokens = torch.zeros(count, width, dtype=torch.long, device=device)
            query_positions = (self.committed - 1)[:, None].repeat(1, width)
            visible = torch.zeros(count, width, grown + width, dtype=torch.bool, device=device)
            visible[:, :, grown:] = torch.eye(width, dtype=torch.bool, device=device)
            for row, request in enumerate(requests):
                if request is None:
                    continue
                size = request.tokens.numel()
                parents[row, :size] = outputs[row][request.parents + 1]
                query_tokens[row, :size] = request.tokens
                query_positions[row, :size] += request.depth
                columns[row] = columns[row] + [grown + i for i in range(size)]
                # request.ancestors[i, j]: expanded node j (expansion order) is node i or its ancestor
                visible[row, :size, torch.tensor(columns[row], device=device)] = request.ancestors
            keys = torch.cat([expansion_positions, query_positions], dim=1)
            mask = self.cache.mask(query_positions, visible, self.heads.layout, parents.dtype, keys)
            embeddings = self.target.input_embeddings(query_tokens)  # (R, m, d)
            predicted = self.heads.step(parents, embeddings, query_positions, mask, self.cache.cache)  # (R, m, d)
            expansion_positions = keys
            sizes = [request.tokens.numel() if request is not None else 0 for request in requests]
            flat = torch.cat([predicted[row, :size] for row, size in enumerate(sizes) if size])
            flat_tokens, flat_log_probs = self._children(flat, draft_rows)
            start = 0
            for row, size in enumerate(sizes):
                if not size:
                    continue
                outputs[row] = torch.cat([outputs[row], predicted[row, :size]])
                children = (flat_tokens[start:start + size], flat_log_probs[start:start + size])
                start += size
                requests[row] = self._advance(growths[row], children, trees, row)
        return trees

    @staticmethod
    def _advance(growth, children, trees: list, row: int):
        """Send ``children`` to a row's growing tree; its next request, or None once it is done."""
        try:
            return next(growth) if children is None else growth.send(children)
        except StopIteration as finished:
            trees[row] = finished.value
            return None
