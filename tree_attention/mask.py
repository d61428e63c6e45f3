"""4D attention masks and position ids for tree verification.

The mask handed to the model is additive (0 where attention is allowed, the dtype's minimum
where not) with shape ``[B, 1, Q, K]``. Both the eager and the sdpa attention of transformers
accept that form (a boolean mask would be *added* as 0/1 by eager attention: silently wrong).

Models with several attention kinds (Gemma-2's sliding and full layers) take a dict of masks
keyed by layer type; :data:`MaskLayout` describes which form the model expects:

* ``None`` or an int: a single mask, with that sliding window (``None``: full attention);
* a mapping ``{layer_type: window or None}``: one mask per layer type.

Sliding windows follow transformers' rule: query at position ``q`` sees key ``k`` when
``q - k < window``.
"""

from __future__ import annotations

from typing import Mapping, Union

import torch

MaskLayout = Union[None, int, Mapping[str, Union[int, None]]]
AttentionMask = Union[torch.Tensor, dict[str, torch.Tensor]]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, Q, K]`` bool → ``[B, 1, Q, K]`` additive float mask of ``dtype``."""
    blocked = torch.finfo(dtype).min
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, blocked)
    return mask.unsqueeze(1)


def _apply_window(visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                  window: int | None) -> torch.Tensor:
    if window is None:
        return visible
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, Q, K)
    return visible & (distance < window)


def layout_masks(visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                 layout: MaskLayout, dtype: torch.dtype) -> AttentionMask:
    """Masks in the form ``layout`` asks for.

    Args:
        visible: ``[B, Q, K]`` bool, which keys each query may see before any sliding window.
        query_positions: ``[B, Q]`` long, absolute positions of the queries.
        key_positions: ``[B, K]`` long, absolute positions of the keys (cache then new tokens).
    """
    if isinstance(layout, Mapping):
        return {
            layer_type: additive_mask(_apply_window(visible, query_positions, key_positions, window), dtype)
            for layer_type, window in layout.items()
        }
    return additive_mask(_apply_window(visible, query_positions, key_positions, layout), dtype)


_FILLS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def appended_mask(cache_width: int, new_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[R, 1, Q, W + P]`` additive mask of queries that see all ``W`` cached slots (a cache without
    holes, full attention) and, among ``P`` appended ones, what ``new_visible`` ``[R, Q, P]`` says:
    the same mask as :func:`layout_masks` with layout None, in two tensor calls (a ``where`` between
    two kept scalars, then zeros padded in front) instead of about ten (a step's mask phase on
    stories260K went from about 65 to 25 us with four calls; 8.6 -> 6.4 us hot with two)."""
    key = (dtype, new_visible.device)
    fills = _FILLS.get(key)
    if fills is None:
        fills = _FILLS[key] = (torch.zeros((), dtype=dtype, device=new_visible.device),
                               torch.full((), torch.finfo(dtype).min, dtype=dtype, device=new_visible.device))
    part = torch.where(new_visible, *fills)  # (R, Q, P)
    return torch.nn.functional.pad(part, (cache_width, 0)).unsqueeze(1)


def causal_visibility(length: int, device: torch.device | str) -> torch.Tensor:
    """``[1, T, T]`` bool lower-triangular visibility for a prefill of ``length`` tokens."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril_().unsqueeze(0)


_CAUSAL_EXTENSIONS: dict[tuple, torch.Tensor] = {}


def causal_extension_mask(cache_width: int, queries: int, dtype: torch.dtype,
                          device: torch.device | str) -> torch.Tensor:
    """``[1, 1, Q, W + Q]`` additive mask of ``Q`` new tokens appended causally after ``W`` cached
    slots that all stay visible (no holes, no sliding window): the same mask as ``additive_mask``
    of the causal visibility, as a read-only view of a buffer kept per ``Q``, dtype and device
    (``[Q, C]``: query ``q`` sees columns up to ``C - Q + q``; the mask is its last ``W + Q`` columns)."""
    key = (queries, dtype, torch.device(device))
    buffer = _CAUSAL_EXTENSIONS.get(key)
    needed = cache_width + queries
    if buffer is None or buffer.shape[1] < needed:
        capacity = max(256, 2 * needed)
        columns = torch.arange(capacity, device=device)
        limits = capacity - queries + torch.arange(queries, device=device)
        buffer = torch.zeros(queries, capacity, dtype=dtype, device=device)
        buffer.masked_fill_(columns[None, :] > limits[:, None], torch.finfo(dtype).min)
        _CAUSAL_EXTENSIONS[key] = buffer
    return buffer[None, None, :, buffer.shape[1] - needed:]


def tree_visibility(prefix_length: int, ancestors: torch.Tensor) -> torch.Tensor:
    """``[1, N, prefix_length + N]`` bool: every node sees the whole prefix and its own ancestors."""
    count = ancestors.shape[0]
    visible = torch.ones(1, count, prefix_length + count, dtype=torch.bool, device=ancestors.device)
    visible[0, :, prefix_length:] = ancestors
    return visible


def tree_position_ids(prefix_length: int, depths: torch.Tensor) -> torch.Tensor:
    """``[1, N]`` position ids: the prefix length plus each node's depth."""
    return (depths + prefix_length).unsqueeze(0)


def tree_attention_mask(prefix_length: int, ancestors: torch.Tensor, depths: torch.Tensor,
                        layout: MaskLayout, dtype: torch.dtype) -> AttentionMask:
    """Mask for verifying a tree of ``N`` nodes on top of ``prefix_length`` cached tokens (batch 1).

    The causal mask over the cache and the tree's ancestor mask are merged into one
    ``[1, 1, N, prefix_length + N]`` mask (or a dict of them, see :data:`MaskLayout`).
    """
    device = ancestors.device
    visible = tree_visibility(prefix_length, ancestors)
    query_positions = tree_position_ids(prefix_length, depths)
    if layout is None:
        return additive_mask(visible, dtype)
    key_positions = torch.cat(
        [torch.arange(prefix_length, device=device), depths + prefix_length]
    ).unsqueeze(0)
    return layout_masks(visible, query_positions, key_positions, layout, dtype)


def prefill_attention_mask(length: int, layout: MaskLayout, dtype: torch.dtype,
                           device: torch.device | str) -> AttentionMask:
    """Causal mask (with sliding windows where the layout has them) for a ``length``-token prefill."""
    positions = torch.arange(length, device=device).unsqueeze(0)
    return layout_masks(causal_visibility(length, device), positions, positions, layout, dtype)
