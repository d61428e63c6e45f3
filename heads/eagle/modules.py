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

import torch
from torch import nn

from tree_attention import cache as cache_ops
from tree_attention.mask import AttentionMask, layout_masks

from ..backbone import Backbone, OutputRows, attention_layout
from ..blocks import ResidualBlock
from ..draft_vocab import check_token_map
from ..families import (check_eagle_layout, decoder_copy, eagle3_parts, lean_decoder_ok, lean_midlayer_ok,
                        rotary_attention)
from ..lean import LeanDecoder, LeanMidlayer, weights_state
from .calibration import ChainCalibration
from .config import EagleConfig


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


def parallel_attention_mask(length: int, parallel: int, layout, dtype: torch.dtype,
                            device: torch.device | str) -> AttentionMask:
    """Mask of the parallel-drafting training forward over one extended sequence of ``parallel``
    blocks of ``length`` entries (queries and keys alike).

    Block 0 holds the teacher-forced pairs at positions ``0..length-1`` (causal). Block ``j >= 1``
    holds mask query ``j`` of every anchor ``t``, at position ``t + j``: it sees block-0 entries
    ``<= t`` and the same anchor's mask queries in blocks ``1..j``, exactly what that query sees at
    decode time (the committed pairs up to ``t``, then the earlier mask queries of its row).
    Returns ``[1, 1, parallel * length, parallel * length]`` (or a dict per layer type).
    """
    origins = torch.arange(length, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
    same_anchor = torch.eye(length, dtype=torch.bool, device=device)
    nothing = torch.zeros(length, length, dtype=torch.bool, device=device)
    rows = [torch.cat([causal] + [same_anchor if 1 <= key <= query else nothing for key in range(1, parallel)], dim=1)
            for query in range(parallel)]
    visible = torch.cat(rows, dim=0).unsqueeze(0)  # (1, K*T, K*T)
    positions = torch.cat([origins + block for block in range(parallel)]).unsqueeze(0)
    return layout_masks(visible, positions, positions, layout, dtype)


def _expand_batch(mask: AttentionMask, batch: int) -> AttentionMask:
    if isinstance(mask, dict):
        return {kind: value.expand(batch, -1, -1, -1) for kind, value in mask.items()}
    return mask.expand(batch, -1, -1, -1)


class Eagle3Midlayer(nn.Module):
    """The EAGLE-3 midlayer, assembled from the family's own modules (:func:`heads.families.eagle3_parts`).

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
        inputs = torch.cat([self.input_layernorm(token_embeddings), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2d)
        attended = rotary_attention(self.self_attn, self.rotary_emb, inputs, position_ids, attention_mask,
                                    self._cache_keyword, cache)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DepthHead(ResidualBlock):
    """One depth of parallel drafting's ``heads`` mode (a Medusa head): the residual block over what
    the heads read at the root (``EagleConfig.head_input``), then its own output rows ``weight`` ``[V', d]`` (the draft
    vocabulary's), read through the backbone's logit post-processing. The block starts as the
    identity and the rows as the output head's, so an untrained head predicts the root's own next
    token."""

    def __init__(self, hidden: int, rows: int) -> None:
        super().__init__(hidden)
        self.weight = nn.Parameter(torch.zeros(rows, hidden))


class SequentialHead(nn.Module):
    """The block drafter's sequential head (``parallel_mode="block"``): refines the block's predicted
    feature ``h`` ``[..., d]`` of a depth from the embedding ``e`` ``[..., d]`` of the token drafted one
    depth above, ``h + W_out SiLU(W_in [h; e] + b)``. ``W_out`` starts at zero, so an untrained head is
    the identity (the block's mask-query prediction)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inner = nn.Linear(2 * hidden, hidden)
        self.outer = nn.Linear(hidden, hidden, bias=False)
        nn.init.zeros_(self.outer.weight)

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        inner = self.inner(torch.cat([hidden, embeddings.to(hidden.dtype)], dim=-1))
        return hidden + self.outer(nn.functional.silu(inner))

    def feature_part(self, hidden: torch.Tensor) -> torch.Tensor:
        """``W_in``'s feature half applied to ``hidden`` ``[..., d]``, with the bias: computed once per
        feature when many tokens are refined from it (:meth:`from_parts`)."""
        size = hidden.shape[-1]
        return nn.functional.linear(hidden, self.inner.weight[:, :size], self.inner.bias)

    def from_parts(self, hidden: torch.Tensor, part: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of ``hidden`` ``[..., d]`` (broadcast against ``embeddings`` ``[..., d]``)
        given its :meth:`feature_part` ``part``; equal to it to float rounding."""
        size = hidden.shape[-1]
        inner = part + nn.functional.linear(embeddings.to(hidden.dtype), self.inner.weight[:, size:])
        return hidden + self.outer(nn.functional.silu(inner))


class EagleHeads(nn.Module):
    """The trainable drafter: fusion (option), projection and decoder copy (``native``/``eagle1``
    layouts) or fusion and :class:`Eagle3Midlayer` (``eagle3``); the only tensors in the adapter
    (plus ``token_map`` with a reduced vocabulary)."""

    def __init__(self, config: EagleConfig, target: Backbone) -> None:
        super().__init__()
        check_against_target(config, target)
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
        self._draft_rows = None  # (source key, OutputRows) of the draft vocabulary, see draft_rows
        self._heads_cache = None  # (count, sources, their state, stacked tensors) of the parallel heads, see _fused_heads
        if self.projection is None:
            self._lean = LeanMidlayer(self.decoder) if lean_midlayer_ok(self.decoder) else None
        else:
            self._lean = LeanDecoder(self.decoder) if lean_decoder_ok(self.decoder) else None
        self.layout = attention_layout(self.decoder.config)
        self.mask_embedding = self.mask_feature = self.parallel_heads = self.sequential_head = None
        if config.parallel > 1 and config.parallel_mode in ("mask", "block"):  # mask queries' inputs (set from data)
            self.mask_embedding = nn.Parameter(torch.zeros(hidden))
            self.mask_feature = nn.Parameter(torch.zeros(hidden))
            if config.parallel_mode == "block":
                self.sequential_head = SequentialHead(hidden)
        elif config.parallel > 1:  # depths 2..K: Medusa-style heads on what head_input names
            rows = config.draft_vocab_size or target.vocab_size
            self.parallel_heads = nn.ModuleList(DepthHead(hidden, rows) for _ in range(config.parallel - 1))
        self.chain_calibration = ChainCalibration()  # serving statistics, not weights: never saved
        self.drafting_choices: dict = {}  # drafting="auto": per configuration, heads.eagle.switch.DraftingChoice
        if config.draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))
        else:
            self.token_map = None
        self.copy_depth_rows(target)

    @property
    def output_norm(self) -> nn.Module | None:
        """The drafter's final norm between its output and the output head (``eagle3`` only)."""
        return self.decoder.norm if self.projection is None else None

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.token_map is None else int(self.token_map.numel())

    def set_token_map(self, token_ids: torch.Tensor, target: Backbone | None = None) -> None:
        """Use ``token_ids`` ``[V']`` (distinct target ids) as the draft vocabulary; with ``target``,
        the parallel heads' output rows restart from its output head's rows of those tokens."""
        if self.token_map is None:
            raise ValueError("set_token_map: this drafter has no reduced vocabulary (draft_vocab_size=None)")
        self.token_map.copy_(check_token_map(token_ids, self.token_map.numel()))
        if target is not None:
            self.copy_depth_rows(target)

    @torch.no_grad()
    def replace_tokens(self, positions: torch.Tensor, token_ids: torch.Tensor, target: Backbone) -> None:
        """Draft ``token_ids`` ``[n]`` (target ids not in ``token_map``) at draft ids ``positions`` ``[n]``
        instead of the tokens there; the parallel heads' rows there restart from the output head's
        (online learning's vocabulary that follows traffic, ``heads.draft_vocab``)."""
        if self.token_map is None:
            raise ValueError("replace_tokens: this drafter has no reduced vocabulary (draft_vocab_size=None)")
        self.token_map[positions] = token_ids.to(self.token_map.device)
        check_token_map(self.token_map, self.token_map.numel())
        if self.parallel_heads is not None:
            rows = target.output_rows(self.token_map[positions]).weight
            for head in self.parallel_heads:
                head.weight[positions] = rows.to(head.weight.dtype)

    def draft_rows(self, target: Backbone):
        """What ``target.logits`` turns predicted features into logits with: the output-head rows
        of the draft vocabulary, after the drafter's own final norm (``eagle3``); None for the
        plain output head (whole vocabulary, no norm)."""
        if self.token_map is None and self.output_norm is None:
            return None
        if self.token_map is None:
            return target.output_rows(None, self.output_norm)
        # the draft vocabulary's rows are a copy: made once per (head, token map) state, not per level
        key = weights_state((target.output_head.weight, target.output_head.bias, self.token_map))
        cached = self._draft_rows
        if cached is None or cached[0] != key or cached[1].norm is not self.output_norm:
            cached = self._draft_rows = (key, target.output_rows(self.token_map, self.output_norm))
        return cached[1]

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
        lean = self._lean is not None and not torch.is_grad_enabled()
        if self.projection is None:
            if lean:
                return self._lean(features, token_embeddings, position_ids, attention_mask, cache)
            return self.decoder(features, token_embeddings, position_ids, attention_mask, cache)
        inputs = self.projection(torch.cat([token_embeddings, features], dim=-1))  # (B, T, d)
        if lean:
            return self._lean(inputs, position_ids, attention_mask, cache)
        outputs = self.decoder(inputs_embeds=inputs, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None, **{self._cache_keyword: cache})
        return outputs.last_hidden_state

    def forward(self, features: torch.Tensor, token_embeddings: torch.Tensor, steps: int = 1,
                parallel: bool = False) -> list[torch.Tensor]:
        """Training forward, unrolled ``steps`` drafting steps over whole sequences (``parallel``:
        :meth:`parallel_forward` instead, ``steps`` ignored).

        Args:
            features: ``[B, T, F]`` the backbone's features at every position (noise already added).
            token_embeddings: ``[B, T, d]`` embeddings of the tokens at every position.
        Returns ``steps`` tensors ``[B, T, d]``; entry ``j - 1`` at origin ``t`` is the prediction of
        the feature at ``t + j`` after ``j - 1`` steps on the drafter's own predicted features
        (rows with ``t + j >= T`` are padding).
        """
        if parallel:
            return self.parallel_forward(features, token_embeddings)
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

    @torch.no_grad()
    def copy_depth_rows(self, target: Backbone) -> None:
        """Start every parallel head's output rows as the output head's rows of the draft vocabulary
        (``heads`` mode; nothing otherwise). Called at build time and after :meth:`set_token_map`."""
        if self.parallel_heads is None:
            return
        rows = target.output_rows(self.token_map).weight
        for head in self.parallel_heads:
            head.weight.copy_(rows)

    def head_inputs(self, predicted: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``heads`` mode: what the parallel heads read at a root, ``[..., d]``, per
        ``config.head_input``: the drafter's depth-1 prediction there (``predicted``, its output for
        the root's pair, as the output head reads it) or the root's drafter input (``features``
        ``[..., F]``, the backbone's, through :meth:`fuse`)."""
        if self.config.head_input == "prediction":
            return self.head_features(predicted)
        return self.fuse(features)

    def depth_logits(self, target: Backbone, inputs: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
        """``heads`` mode: logits ``[..., V']`` of depths 2..K (2..``count + 1`` with ``count``) from
        the heads' inputs ``[..., d]`` at the roots (:meth:`head_inputs`; read with the gradient
        stopped)."""
        if self.parallel_heads is None:
            raise ValueError("this EAGLE drafter has no parallel heads (EagleConfig.parallel_mode is not 'heads')")
        stopped = inputs.detach()
        heads = list(self.parallel_heads)[:count]
        if not torch.is_grad_enabled():
            return list(self.served_depth_logits(target, stopped.reshape(-1, self.hidden_size), len(heads))
                        .view(*stopped.shape[:-1], len(heads), -1).unbind(-2))
        return [target.logits(head(stopped), OutputRows(head.weight, None)) for head in heads]

    def served_depth_logits(self, target: Backbone, inputs: torch.Tensor, count: int) -> torch.Tensor:
        """Serving (no gradients): the logits of depths 2..``count + 1`` from the heads' inputs ``[R, d]``
        as one tensor ``[R, count, V']``, all heads in a few dispatched ops (their tensors stacked
        once, :meth:`_fused_heads`); equal to :meth:`depth_logits` to float rounding."""
        linear, bias, rows = self._fused_heads(count)
        hidden = inputs.unsqueeze(1) + nn.functional.silu(nn.functional.linear(inputs, linear, bias)).view(
            -1, count, self.hidden_size)  # (R, H, d)
        return target.postprocess(torch.bmm(hidden.transpose(0, 1), rows)).transpose(0, 1)  # (R, H, V')

    def _fused_heads(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``count`` parallel heads' tensors stacked for serving: their blocks' weights
        ``[count * d, d]`` and biases, and their output rows ``[count, d, V']``; rebuilt whenever a
        source tensor is updated in place or moved (an optimizer step, ``load_state_dict``, ``.to()``;
        a parameter *replaced* by another object is not noticed, as in :class:`heads.lean.LeanDecoder`)."""
        cached = self._heads_cache
        if cached is not None and cached[0] == count and weights_state(cached[1]) == cached[2]:
            return cached[3]
        heads = list(self.parallel_heads)[:count]
        sources = tuple(tensor for head in heads for tensor in (head.linear.weight, head.linear.bias, head.weight))
        fused = (torch.cat([head.linear.weight for head in heads]).detach(),
                 torch.cat([head.linear.bias for head in heads]).detach(),
                 torch.stack([head.weight for head in heads]).transpose(1, 2).contiguous().detach())
        self._heads_cache = (count, sources, weights_state(sources), fused)
        return fused

    def mask_inputs(self, batch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of ``count`` mask queries per row: features and token embeddings ``[batch, count, d]``."""
        if self.mask_feature is None:
            raise ValueError("this EAGLE drafter has no mask queries (EagleConfig.parallel is 1)")
        shape = (batch, count, self.hidden_size)
        return self.mask_feature.expand(shape), self.mask_embedding.expand(shape)

    def refine(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``block`` mode: a depth's feature ``[..., d]`` from the block refined by the sequential head
        with the embeddings ``[..., d]`` of the tokens drafted one depth above."""
        if self.sequential_head is None:
            raise ValueError("this EAGLE drafter has no sequential head (EagleConfig.parallel_mode is not 'block')")
        return self.sequential_head(hidden, embeddings)

    def parallel_forward(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> list[torch.Tensor]:
        """Training forward of parallel drafting (``config.parallel = K``): one drafter forward over
        the teacher-forced pairs and ``K - 1`` blocks of mask queries (:func:`parallel_attention_mask`).

        Args and returns as :meth:`forward` with ``steps = K``: ``K`` tensors ``[B, T, d]``; entry
        ``j`` at anchor ``t`` predicts the feature at ``t + j + 1`` (entry 0: the pair at ``t`` itself,
        entry ``j >= 1``: anchor ``t``'s mask query ``j``). ``block`` mode: entry ``j >= 1`` is then
        refined by the sequential head with the embedding of the token at ``t + j + 1`` (teacher
        forced: the token a chain drafts at depth ``j`` whenever its depths so far are accepted, the
        only case in which depth ``j + 1`` counts).
        """
        if self.mask_feature is None:
            raise ValueError("parallel_forward trains mask queries (parallel_mode 'mask' or 'block'); a 'heads' drafter trains "
                             "its sequential step with forward() and its heads with depth_logits()")
        batch, length, _ = features.shape
        parallel = self.config.parallel
        mask_features, mask_embeddings = self.mask_inputs(batch, (parallel - 1) * length)
        next_embeddings = torch.cat([token_embeddings[:, 1:], token_embeddings.new_zeros(batch, 1, self.hidden_size)],
                                    dim=1)  # (B, T, d): e_{t+1}
        inputs = torch.cat([self.fuse(features), mask_features.to(features.dtype)], dim=1)  # (B, K*T, d)
        embeddings = torch.cat([next_embeddings, mask_embeddings.to(next_embeddings.dtype)], dim=1)
        origins = torch.arange(length, device=features.device)
        positions = torch.cat([origins + block for block in range(parallel)]).expand(batch, -1)  # (B, K*T)
        mask = parallel_attention_mask(length, parallel, self.layout, inputs.dtype, features.device)
        outputs = list(self.step(inputs, embeddings, positions, _expand_batch(mask, batch), None).split(length, dim=1))
        if self.sequential_head is not None:
            for depth in range(1, parallel):  # the token at t + depth + 1 (zeros past the sequence's end)
                drafted = torch.cat([token_embeddings[:, depth + 1:],
                                     token_embeddings.new_zeros(batch, min(depth + 1, length), self.hidden_size)],
                                    dim=1)[:, :length]
                outputs[depth] = self.refine(outputs[depth], drafted)
        return outputs


def check_against_target(config: EagleConfig, target: Backbone) -> None:
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
