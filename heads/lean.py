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

import torch
from torch import nn
from torch.nn import functional as F

from tree_attention.mask import AttentionMask


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary rotation of ``[B, H, T, D]`` by tables ``[B, 1, T, D]`` (the half-split convention)."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin


def _norm(module: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """An RMS norm module (``weight``, ``variance_epsilon``: normalise in float32, scale by
    ``weight``) or an identity. (``F.rms_norm`` is not fused on CPU and costs more.)"""
    if isinstance(module, nn.Identity):
        return states
    wide = states.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * wide.to(states.dtype)


STATIC_ROPE_TYPES = ("default", "linear", "llama3")
"""Rotary types whose tables depend on the position alone (no dependence on the sequence length
seen so far), so a table computed once by the model's own ``rotary_emb`` can be indexed."""


class LeanDecoder:
    """Callable ``(inputs [B, T, d], position_ids [B, T], mask, cache) -> [B, T, d]`` equal (to float
    rounding) to ``decoder(inputs_embeds=inputs, position_ids=..., attention_mask=mask,
    cache).last_hidden_state`` for a decoder that :func:`heads.families.lean_decoder_ok` accepts."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        config = decoder.config
        self.layer_types = list(getattr(config, "layer_types", None) or [None] * len(decoder.layers))
        self.static_rope = getattr(decoder.rotary_emb, "rope_type", None) in STATIC_ROPE_TYPES
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rotary(self, inputs: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``[B, 1, T, D]`` at ``position_ids``: indexed from a table the model's own
        ``rotary_emb`` computed (static rope types), or from ``rotary_emb`` itself."""
        if not self.static_rope:
            cos, sin = self.decoder.rotary_emb(inputs, position_ids)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        tables = self._tables
        needed = int(position_ids.max()) + 1
        if (tables is None or tables[0].shape[0] < needed or tables[0].dtype != inputs.dtype
                or tables[0].device != inputs.device):
            size = max(256, 2 * needed)
            positions = torch.arange(size, device=inputs.device)[None]
            cos, sin = self.decoder.rotary_emb(inputs, positions)
            tables = self._tables = (cos[0], sin[0])
        return tables[0][position_ids].unsqueeze(1), tables[1][position_ids].unsqueeze(1)

    def __call__(self, inputs: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionMask,
                 cache) -> torch.Tensor:
        decoder = self.decoder
        batch, length, _ = inputs.shape
        cos, sin = self._rotary(inputs, position_ids)
        hidden = inputs
        for index, layer in enumerate(decoder.layers):
            mask = attention_mask[self.layer_types[index]] if isinstance(attention_mask, dict) else attention_mask
            attention, mlp = layer.self_attn, layer.mlp
            normed = _norm(layer.input_layernorm, hidden)
            head_dim = attention.head_dim
            query = F.linear(normed, attention.q_proj.weight, attention.q_proj.bias)
            key = F.linear(normed, attention.k_proj.weight, attention.k_proj.bias)
            value = F.linear(normed, attention.v_proj.weight, attention.v_proj.bias)
            query = query.view(batch, length, -1, head_dim).transpose(1, 2)
            key = key.view(batch, length, -1, head_dim).transpose(1, 2)
            value = value.view(batch, length, -1, head_dim).transpose(1, 2)
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            if cache is not None:
                key, value = cache.update(key, value, index)
            if mask is not None:
                mask = mask[..., : key.shape[-2]].to(query.dtype)
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attention.scaling,
                                                      enable_gqa=query.shape[1] != key.shape[1])
            attended = attended.transpose(1, 2).reshape(batch, length, -1)
            hidden = hidden + F.linear(attended, attention.o_proj.weight, attention.o_proj.bias)
            normed = _norm(layer.post_attention_layernorm, hidden)
            gate = F.linear(normed, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(normed, mlp.up_proj.weight, mlp.up_proj.bias)
            hidden = hidden + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return _norm(decoder.norm, hidden)
