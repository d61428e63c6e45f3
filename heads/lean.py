"""A lean inference forward for a drafter's Llama-style decoder copy.

On small targets a drafter forward is dominated by per-call Python: a one-layer copy of the
backbone's base model spends more time in its wrappers (output capturing, argument merging, mask
dispatch, cache bookkeeping) than in its arithmetic, and EAGLE runs one such forward per tree
level. :class:`LeanDecoder` runs the same modules' tensors directly: the family's own norms, MLP
and rotary table (``rotary_emb``) are called as modules; only the attention glue (projections,
rotary rotation, ``Cache.update``, scaled dot-product attention with the 4D mask, output
projection) is written out, and only for the decoder layers :func:`heads.families.lean_decoder_ok`
accepts as exactly that computation. Its output matches the decoder's public forward to float
rounding (tests/heads/test_lean.py); the decode loop verifies every drafted token against the
backbone anyway, so a drafter's rounding never changes what is generated.

Inference only: :meth:`EagleHeads.step <heads.eagle.modules.EagleHeads.step>` uses it when
gradients are off and falls back to the decoder's own forward otherwise.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from tree_attention.mask import AttentionMask


def _norm(module: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """An RMS norm module (``weight``, ``variance_epsilon``: normalise in float32, scale by
    ``weight``) or an identity. ``F.rms_norm`` is one dispatched op against five for the written-out
    form (10.7 against 14.7 us at [1, 5, 64] in float32 on the CPU)."""
    if isinstance(module, nn.Identity):
        return states
    shape = states.shape[-1:]
    if states.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(states, shape, module.weight, module.variance_epsilon)
    wide = F.rms_norm(states.float(), shape, None, module.variance_epsilon)
    return module.weight * wide.to(states.dtype)


def weights_state(tensors) -> tuple:
    """A key of ``tensors`` (None entries allowed) that changes when any of them is updated in place
    (an optimizer step, ``load_state_dict``) or moved (``.to()``): what a tensor derived from them and
    kept across calls (a fused or sliced copy) is checked against."""
    return tuple(None if tensor is None else (tensor.data_ptr(), tensor._version) for tensor in tensors)


STATIC_ROPE_TYPES = ("default", "linear", "llama3")
"""Rotary types whose tables depend on the position alone (no dependence on the sequence length
seen so far), so a table computed once by the model's own ``rotary_emb`` can be indexed."""


_full_precision = 0  # how many full_precision() contexts are open


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Within it, the lean forwards and :class:`LeanOutputHead` multiply by the weights themselves,
    never by float16 copies: a drafter's decode-time arithmetic then equals its training forward to
    float rounding (what tests comparing the two check)."""
    global _full_precision
    _full_precision += 1
    try:
        yield
    finally:
        _full_precision -= 1


class _Product(NamedTuple):
    """A linear layer's weight ``[out, in]`` and bias for inference, and on a CPU with float32 weights
    a float16 copy of both for products with a single row (batch 1, one query: a drafter's chain
    level). Such a product reads every weight once, so its time is the bytes read when the weights
    are not in the CPU's caches (in the decode loop the target's forward evicts them); with several
    rows float16 is no faster (no float16 kernels on a CPU: converted per call). Measurements:
    docs/eagle.md. The rounding (about 1e-3 relative) changes drafted tokens at most, never what is
    generated: every drafted token is verified by the target."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    half_weight: torch.Tensor | None
    half_bias: torch.Tensor | None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "_Product":
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return cls(weight, bias, None, None)
        return cls(weight, bias, weight.half(), None if bias is None else bias.half())

    def __call__(self, inputs: torch.Tensor, one_row: bool) -> torch.Tensor:
        if one_row and self.half_weight is not None and inputs.dtype == torch.float32 and not _full_precision:
            product = F.linear(inputs.half(), self.half_weight, self.half_bias)
            # float16 ends at 65504: an input or a sum past it (large activations) is computed again in
            # float32 rather than drafted from inf or nan (a cheap check on a CPU, where it runs)
            if bool(torch.isfinite(product).all()):
                return product.float()
        return F.linear(inputs, self.weight, self.bias)


class LeanDecoder:
    """Callable ``(inputs [B, T, d], position_ids [B, T], mask, cache) -> [B, T, d]`` equal (to float
    rounding) to ``decoder(inputs_embeds=inputs, position_ids=..., attention_mask=mask,
    cache).last_hidden_state`` for a decoder that :func:`heads.families.lean_decoder_ok` accepts."""

    def __init__(self, decoder: nn.Module, layer_types: list | None = None) -> None:
        self.decoder = decoder
        if layer_types is None:
            layer_types = list(getattr(decoder.config, "layer_types", None) or [None] * len(decoder.layers))
        self.layer_types = layer_types
        self.static_rope = getattr(decoder.rotary_emb, "rope_type", None) in STATIC_ROPE_TYPES
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused_weights: dict[int, tuple] = {}  # layer index -> (sources, their weights_state, fused tensors)

    def _rotary(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``[B, T, 1, D]`` at ``position_ids``: indexed from a table the model's own
        ``rotary_emb`` computed (static rope types), or from ``rotary_emb`` itself."""
        if not self.static_rope:
            cos, sin = self.decoder.rotary_emb(inputs, position_ids)
            return cos.unsqueeze(2), sin.unsqueeze(2)
        tables = self._tables
        needed = int(position_ids.max()) + 1
        if (tables is None or tables[0].shape[0] < needed or tables[0].dtype != inputs.dtype
                or tables[0].device != inputs.device):
            size = max(256, 2 * needed)
            positions = torch.arange(size, device=inputs.device)[None]
            cos, sin = self.decoder.rotary_emb(inputs, positions)
            tables = self._tables = (cos[0], sin[0])
        return tables[0][position_ids].unsqueeze(2), tables[1][position_ids].unsqueeze(2)

    def _fused(self, index: int, attention: nn.Module, mlp: nn.Module) -> tuple:
        """Layer ``index``'s products (its ``attention`` and ``mlp`` modules), rebuilt whenever a source
        weight changed (an optimizer step, ``.to()``): one projection ``[q; k; rot(q); rot(k); v]``
        whose ``rot`` rows are the q/k rows composed with the rotary half-rotation (so the rotation is
        ``qk * cos + rot(qk) * sin``, no per-call rotation), the output projection, one ``[gate; up]``
        projection and the down projection (each a :class:`_Product`); then the query heads and the
        query + key heads. (A weight tensor *replaced* by another object with the same storage is not
        noticed; in-place updates and moves are.)"""
        entry = self._fused_weights.get(index)
        if entry is not None and weights_state(entry[0]) == entry[1]:
            return entry[2]
        modules = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        sources = [module.weight for module in modules] + [module.bias for module in modules]
        head_dim, half = attention.head_dim, attention.head_dim // 2

        def rotated(rows: torch.Tensor) -> torch.Tensor:  # rot(x) = cat(-x[half:], x[:half]) per head, on the rows
            heads_rows = rows.reshape(-1, head_dim, *rows.shape[1:])
            return torch.cat([-heads_rows[:, half:], heads_rows[:, :half]], dim=1).reshape(rows.shape)

        def bias(module: nn.Linear) -> torch.Tensor:
            return module.bias if module.bias is not None else module.weight.new_zeros(module.weight.shape[0])

        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        weight = torch.cat([q.weight, k.weight, rotated(q.weight), rotated(k.weight), v.weight])
        qkv_bias = None
        if any(module.bias is not None for module in (q, k, v)):
            qkv_bias = torch.cat([bias(q), bias(k), rotated(bias(q)), rotated(bias(k)), bias(v)])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        gate_up_bias = None
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            gate_up_bias = torch.cat([bias(mlp.gate_proj), bias(mlp.up_proj)])
        queries = q.out_features // head_dim
        fused = (_Product.of(weight, qkv_bias), _Product.of(attention.o_proj.weight, attention.o_proj.bias),
                 _Product.of(gate_up, gate_up_bias), _Product.of(mlp.down_proj.weight, mlp.down_proj.bias),
                 queries, queries + k.out_features // head_dim)
        self._fused_weights[index] = (sources, weights_state(sources), fused)
        return fused

    def _layer(self, index: int, attention: nn.Module, mlp: nn.Module, post_norm: nn.Module, normed: torch.Tensor,
               residual: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask, cache) -> torch.Tensor:
        """One decoder layer from its normed attention input ``normed`` ``[B, T, d_in]`` and its residual
        stream ``residual`` ``[B, T, d]``: ``residual + attention``, then ``+ mlp(post_norm(.))``;
        keys and values go to ``cache`` layer ``index``."""
        qkv, output, gate_up, down, queries, rotated = self._fused(index, attention, mlp)
        batch, length = normed.shape[:2]
        one_row = batch * length == 1
        cos, sin = rotary
        head_dim = attention.head_dim
        projected = qkv(normed, one_row).view(batch, length, -1, head_dim)
        turned = projected[:, :, :rotated] * cos + projected[:, :, rotated:2 * rotated] * sin
        query = turned[:, :, :queries].transpose(1, 2)
        key = turned[:, :, queries:].transpose(1, 2)
        value = projected[:, :, 2 * rotated:].transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, index)
        if mask is not None:
            mask = mask[..., : key.shape[-2]].to(query.dtype)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attention.scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1])
        attended = attended.transpose(1, 2).reshape(batch, length, -1)
        hidden = residual + output(attended, one_row)
        gate, up = gate_up(_norm(post_norm, hidden), one_row).chunk(2, dim=-1)
        return hidden + down(mlp.act_fn(gate) * up, one_row)

    def __call__(self, inputs: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                 cache) -> torch.Tensor:
        rotary = self._rotary(inputs, position_ids)  # (B, T, 1, D) each: broadcast over heads
        hidden = inputs
        for index, layer in enumerate(self.decoder.layers):
            mask = attention_mask[self.layer_types[index]] if isinstance(attention_mask, dict) else attention_mask
            hidden = self._layer(index, layer.self_attn, layer.mlp, layer.post_attention_layernorm,
                                 _norm(layer.input_layernorm, hidden), hidden, rotary, mask, cache)
        return _norm(self.decoder.norm, hidden)


class LeanMidlayer(LeanDecoder):
    """Callable ``(hidden [B, T, d], token_embeddings [B, T, d], position_ids [B, T], mask, cache) ->
    [B, T, d]`` equal (to float rounding) to :class:`heads.eagle.modules.Eagle3Midlayer`'s forward (its
    pre-norm output) for a midlayer that :func:`heads.families.lean_midlayer_ok` accepts: the same
    layer body as :class:`LeanDecoder` on the attention input ``[input_layernorm(e); hidden_norm(h)]``
    (``2d`` wide) with ``h`` as the residual, keys and values in cache layer 0."""

    def __init__(self, midlayer: nn.Module) -> None:
        super().__init__(midlayer, layer_types=[None])

    def __call__(self, hidden: torch.Tensor, token_embeddings: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: AttentionMask, cache) -> torch.Tensor:
        layer = self.decoder
        normed = torch.cat([_norm(layer.input_layernorm, token_embeddings), _norm(layer.hidden_norm, hidden)], dim=-1)
        return self._layer(0, layer.self_attn, layer.mlp, layer.post_attention_layernorm, normed, hidden,
                           self._rotary(hidden, position_ids), attention_mask, cache)


class LeanOutputHead:
    """A drafter's output head for inference: ``features [..., d] -> float32 logits [..., V]`` with
    the family's post-processing (:meth:`heads.backbone.Backbone.logits`).

    A single row of features (batch 1: the feeding forward's root, a chain level) is multiplied as
    a :class:`_Product`: on a CPU with float32 weights by a float16 copy of the head's weights. A
    separate draft model's head is read from main memory at each draft forward (the target's forward
    between two of them evicts it from the caches), so its time is the bytes read; several rows keep
    the float32 weights, where float16 products cost about one single-row product per row
    (measurements: docs/draft.md). The copy follows the weights (:func:`weights_state`). Drafted
    tokens are verified by the target, so the rounding (about 1e-3 relative on a logit) can change
    which tokens are drafted and accepted, never what is generated. A head that is not one linear
    layer is called as it is."""

    def __init__(self, backbone) -> None:
        self.backbone = backbone
        self._product: tuple | None = None  # (weights_state of the head's tensors, _Product)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        head = self.backbone.output_head
        if type(head) is not nn.Linear:
            return self.backbone.logits(features).float()
        state = weights_state((head.weight, head.bias))
        if self._product is None or self._product[0] != state:
            self._product = (state, _Product.of(head.weight, head.bias))
        one_row = features.numel() == features.shape[-1]
        return self.backbone.postprocess(self._product[1](features, one_row)).float()
