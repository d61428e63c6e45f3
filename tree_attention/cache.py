"""The only module that touches ``transformers`` ``Cache`` internals.

Verification appends all ``N`` tree nodes to the cache; afterwards only the accepted path may
stay. :func:`keep_path` moves the accepted nodes' keys and values to the front of the tree
region in place (``k`` entries copied per layer, not the whole cache) and drops the rest; in a
batch each row keeps its own path (:func:`gather`) and :func:`select_rows` drops finished rows.

The decode loop builds its own config-less :class:`~transformers.DynamicCache`, whose layers all
keep the full history; sliding windows are then applied by the mask (see ``mask.py``). A
sliding-window cache layer cannot be rolled back once it is full, which is why the loop does
not use the model's default cache.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import Cache, DynamicCache

try:  # transformers 5.x
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older layouts have no layer classes
    DynamicLayer = None


class UnsupportedCacheError(TypeError):
    """A cache layout whose entries cannot be rearranged after verification."""


class GrowingLayer(DynamicLayer):
    """A full-history cache layer that appends into spare room instead of concatenating.

    ``DynamicLayer.update`` concatenates, copying a layer's whole history on every forward; here
    ``keys`` and ``values`` are views ``[..., :length, :]`` of buffers with room to spare (capacity
    doubling), so a forward copies only its new entries. Whatever sets ``keys`` / ``values``
    (cropping keeps views of the buffers; a row selection or a foreign tensor does not) is noticed
    at the next update, which then moves the history into fresh buffers."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = None

    def _backed(self, length: int, key_states: torch.Tensor) -> bool:
        """Whether the history is the first ``length`` entries of the buffers and there is room after it
        for ``key_states``."""
        buffers = self._buffers
        if buffers is None:
            return False
        keys, values = buffers
        if keys.shape[-2] < length + key_states.shape[-2] or keys.dtype != key_states.dtype:
            return False
        if keys.shape[:2] != key_states.shape[:2] or keys.shape[-1] != key_states.shape[-1]:
            return False
        if length == 0:
            return True
        return (self.keys.data_ptr() == keys.data_ptr() and self.keys.stride() == keys.stride()
                and self.values.data_ptr() == values.data_ptr() and self.values.stride() == values.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # training through the cache (unrolled drafting steps): autograd keeps the history it read,
            # so it is concatenated into new tensors, never written over in place
            self._buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        if not self._backed(length, key_states):
            capacity = max(2 * end, 64)
            keys = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[-1])
            if length:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self._buffers = (keys, values)
        keys, values = self._buffers
        count = end - length
        keys.narrow(-2, length, count).copy_(key_states)
        values.narrow(-2, length, count).copy_(value_states)
        self.keys, self.values = keys.narrow(-2, 0, end), values.narrow(-2, 0, end)
        return self.keys, self.values

    def reset(self) -> None:
        self._buffers = None
        super().reset()


class GrowingCache(DynamicCache):
    """A :class:`~transformers.DynamicCache` of :class:`GrowingLayer` layers whose buffers, once every
    layer exists (after the first forward) and all have one shape, are slices of one pool per keys
    and values (``[layers, B, heads, capacity, head_dim]``): :func:`gather` then moves an accepted
    path's entries in all layers with one tensor call each for keys and values instead of two per
    layer (on stories260K, where every tensor call is overhead, the cache phase of a step went from
    144 to 115 us in the loop). The pool is (re)built at the first layer's update of a forward when a layer
    is not backed by it (a row selection, a foreign tensor) or the new entries do not fit."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        self._pool: tuple[torch.Tensor, torch.Tensor] | None = None
        self._slots: list[tuple] = []
        self._stale = False  # some layer found not backed by the pool since it was built: check all at the next forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and len(self.layers) > 1:
            self._repool(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def pooled(self, mark: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pools ``(keys, values)`` when every layer's history is the first entries of its pool
        slice (all layers equally long); None otherwise (``mark``: and have the next forward check
        every layer, not only the first, before appending into the pool)."""
        pool = self._pool
        if pool is None or len(self._slots) != len(self.layers):
            return None
        length = None
        for layer, slot in zip(self.layers, self._slots):
            keys, values = layer.keys, layer.values
            if (keys is None or values is None
                    or (keys.data_ptr(), values.data_ptr(), keys.stride(), values.stride()) != slot
                    or (length is not None and keys.shape[-2] != length)):
                self._stale = self._stale or mark
                return None
            length = keys.shape[-2]
        return pool

    def _repool(self, key_states: torch.Tensor) -> None:
        """Move every layer's history into fresh pools if the current ones do not back them all or
        have no room for ``key_states``; leave per-layer buffers when the layers' shapes differ."""
        layers = self.layers
        first = layers[0]
        if not first.is_initialized or first.keys is None or first.keys.dim() != 4:
            return
        length = first.keys.shape[-2]
        end = length + key_states.shape[-2]
        pool = self._pool
        if pool is not None and pool[0].shape[-2] >= end and pool[0].shape[1:3] == key_states.shape[:2]:
            keys, values = first.keys, first.values
            if not self._stale and (keys.data_ptr(), values.data_ptr(), keys.stride(), values.stride()) == self._slots[0]:
                return  # the first layer still backed (a gather that found another layer not backed marks stale)
            if self.pooled() is not None:
                self._stale = False
                return
        shapes = {(layer.keys.shape, layer.values.shape, layer.keys.dtype, layer.keys.device)
                  if layer.is_initialized and layer.keys.dim() == 4 else None for layer in layers}
        if len(shapes) != 1 or None in shapes or key_states.shape[:2] != first.keys.shape[:2]:
            self._pool = None
            return
        capacity = max(2 * end, 64)
        keys_pool = first.keys.new_empty(len(layers), *first.keys.shape[:2], capacity, first.keys.shape[-1])
        values_pool = first.values.new_empty(len(layers), *first.values.shape[:2], capacity,
                                             first.values.shape[-1])
        for index, layer in enumerate(layers):
            keys_pool[index, ..., :length, :] = layer.keys
            values_pool[index, ..., :length, :] = layer.values
            layer._buffers = (keys_pool[index], values_pool[index])
            layer.keys, layer.values = keys_pool[index, ..., :length, :], values_pool[index, ..., :length, :]
        self._pool = (keys_pool, values_pool)
        # where each layer's history starts and how it is laid out, while the pool backs it
        self._slots = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.keys.stride(), layer.values.stride())
                       for layer in layers]
        self._stale = False


def new_cache() -> DynamicCache:
    """An empty cache in which every layer keeps its full history (rollback-safe) and appends without
    copying what it holds."""
    return GrowingCache()


@lru_cache(maxsize=None)
def _cache_argument_for(forward_class: type) -> str:
    parameters = inspect.signature(forward_class.forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise UnsupportedCacheError(
        f"{forward_class.__name__}.forward takes neither `cache` nor `past_key_values`; "
        "selfdraft needs a model whose forward accepts a transformers Cache"
    )


def cache_keyword(module: torch.nn.Module) -> str:
    """Name of the keyword under which ``module.forward`` takes its ``Cache``."""
    return _cache_argument_for(type(module))


def _layers(cache: Cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UnsupportedCacheError(f"{type(cache).__name__} has no `layers`; expected a transformers 5 Cache")
    for layer in layers:
        if getattr(layer, "is_sliding", False) or (DynamicLayer is not None and not isinstance(layer, DynamicLayer)):
            raise UnsupportedCacheError(
                f"cache layer {type(layer).__name__} cannot be rearranged; use tree_attention.cache.new_cache()"
            )
        yield layer


def crop(cache: Cache, length: int, pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Keep the first ``length`` positions of every layer (views, no copy); ``pool``: the cache's
    pools, backing every layer at one length of at least ``length`` (:meth:`GrowingCache.pooled`), so
    every layer's views come from one slice and split of each pool (on demo-llama's eight layers,
    four tensor calls instead of sixteen)."""
    if pool is not None:
        keys, values = pool[0][..., :length, :].unbind(0), pool[1][..., :length, :].unbind(0)
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values):
            layer.keys, layer.values = layer_keys, layer_values
        return
    for layer in cache.layers if isinstance(cache, GrowingCache) else _layers(cache):
        if not layer.is_initialized or layer.keys.numel() == 0 or layer.keys.shape[-2] <= length:
            continue
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def gather(cache: Cache, start: int, index: torch.Tensor) -> None:
    """Rewrite every row's entries from ``start`` on: afterwards row ``b`` holds, at
    ``start + i``, what it held at ``start + index[b, i]``, and the cache ends at ``start + L``.

    ``index`` is ``[B, L]`` long (or ``[L]`` for every row alike); only ``L`` entries per row are
    copied, not the cache.
    """
    if index.dim() == 1:
        index = index.unsqueeze(0)
    count = int(index.shape[1])
    identity = list(range(count))
    pool = None
    if any(row != identity for row in index.tolist()):  # one host read, as a tensor test would need too
        pool = cache.pooled(mark=True) if isinstance(cache, GrowingCache) else None
        # the pool: every layer at once (layers, B, heads, capacity, head_dim); else layer by layer
        tensors = pool if pool is not None else [tensor for layer in _layers(cache)
                                                 if layer.is_initialized and layer.keys.numel()
                                                 for tensor in (layer.keys, layer.values)]
        if index.shape[0] == 1:  # one path for every row: one index_select each (27 -> 11 us on a pool)
            flat = index[0] + start
            for tensor in tensors:
                tensor[..., start:start + count, :] = tensor.index_select(-2, flat)
        else:
            sources = {}  # one gather index per shape (keys and values, and the layers, mostly share one)
            for tensor in tensors:  # (..., B, heads, S, head_dim): each row gathers its own entries
                shape = (*tensor.shape[:-2], count, tensor.shape[-1])
                source = sources.get(shape)
                if source is None:
                    leading = (1,) * (tensor.dim() - 4)
                    source = sources[shape] = (index + start).view(*leading, index.shape[0], 1, count, 1).expand(shape)
                tensor[..., start:start + count, :] = tensor.gather(-2, source)
    crop(cache, start + count, pool)


def keep_path(cache: Cache, prefix_length: int, node_indices: torch.Tensor) -> None:
    """Keep ``prefix_length`` entries plus the tree nodes ``node_indices`` (``[k]`` increasing,
    or ``[B, k]``: one path per row, padded by repeating an index the row keeps).

    Afterwards the cache holds ``prefix_length + k`` positions and entry ``prefix_length + i``
    is what node ``node_indices[i]`` wrote, as if those tokens had been fed one by one.
    """
    gather(cache, prefix_length, node_indices)


def select_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep the batch rows ``rows`` (``[R]`` long) of every layer, in that order."""
    for layer in _layers(cache):
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


class RaggedCache:
    """A batch's cache whose rows hold different numbers of live entries.

    Every forward appends the same number of slots to all rows; a row's slots that it does not
    keep (padding, rejected tree nodes) stay as holes. ``visible`` ``[R, S]`` says which slots
    each row attends to and ``positions`` ``[R, S]`` their position ids, so masks can be built
    with per-row positions and sliding windows (:meth:`mask`). :meth:`compact` squeezes the holes
    out once they fill half the cache; :meth:`select_rows` drops rows that finished.
    """

    def __init__(self, batch_size: int, device: torch.device | str) -> None:
        self.cache = new_cache()
        # slots kept whole by a one-row step while the cache had no hole, not yet in the tensors:
        # (positions [R, N], index [R, L]) each, their positions ``positions.gather(1, index)``
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.visible = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)

    def _settle(self) -> None:
        """Append the pending slots to ``visible`` and ``positions`` (all visible: the cache stays dense)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows = self._visible.shape[0]
        count = sum(int(index.shape[1]) for _, index in pending)
        self._visible = torch.cat([self._visible, self._visible.new_ones(rows, count)], dim=1)
        self._positions = torch.cat([self._positions] + [positions.gather(1, index) for positions, index in pending],
                                    dim=1)

    @property
    def visible(self) -> torch.Tensor:
        """``[R, S]`` bool: which slots each row attends to."""
        self._settle()
        return self._visible

    @visible.setter
    def visible(self, value: torch.Tensor) -> None:
        self._settle()
        self._visible = value
        self._width = int(value.shape[1])
        self._dense: bool | None = None  # dense(), read from the tensor at most once per change

    @property
    def positions(self) -> torch.Tensor:
        """``[R, S]`` long: each slot's position id."""
        self._settle()
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self._settle()
        self._positions = value

    @property
    def width(self) -> int:
        """Slots per row that the bookkeeping covers (the cache may hold more, see :meth:`crop`)."""
        return self._width

    def mask(self, query_positions: torch.Tensor, new_visible: torch.Tensor, layout, dtype: torch.dtype,
             new_key_positions: torch.Tensor | None = None):
        """Mask of queries ``[R, Q]`` at ``query_positions`` that see this cache's visible slots
        and, among the slots appended after it, what ``new_visible`` ``[R, Q, P]`` says (``P``
        slots at ``new_key_positions`` ``[R, P]``, by default the queries themselves)."""
        from .mask import appended_mask, layout_masks

        if layout is None and self.dense():  # every cached slot visible, no window: positions do not matter
            return appended_mask(self.width, new_visible, dtype)
        rows, queries = query_positions.shape
        visible = torch.cat([self.visible[:, None, :].expand(rows, queries, self.width), new_visible], dim=2)
        keys = torch.cat([self.positions, query_positions if new_key_positions is None else new_key_positions], dim=1)
        return layout_masks(visible, query_positions, keys, layout, dtype)

    def extend(self, visible: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Account for ``[R, n]`` slots a forward appended: which stay visible (None: all of them),
        their positions ``[R, n]``."""
        dense = self._dense
        if visible is None:
            visible = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        else:
            dense = None
        self.visible = torch.cat([self.visible, visible], dim=1)
        self._dense = dense
        self.positions = torch.cat([self.positions, positions], dim=1)

    def keep(self, index: torch.Tensor, kept: torch.Tensor | None, positions: torch.Tensor, full: bool = False) -> None:
        """After a forward appended ``N`` slots per row at ``positions`` ``[R, N]`` past
        :attr:`width`, row ``b`` keeps slots ``index[b]`` (``[R, L]``) of them, moved to the front
        of that region; ``kept`` ``[R, L]`` marks the real ones (the rest are holes; ``full``: the
        caller knows there are none, so a cache without holes stays one without a host read, and
        ``kept`` may be None)."""
        start = self.width
        if positions.shape[1] > 1:  # one appended slot (a plain step) is its own path: nothing moves
            keep_path(self.cache, start, index)
        if full and self._dense:  # still no hole: the bookkeeping waits until something reads it (a
            # dense cache without a window needs neither tensor for its masks; 3 tensor calls a step)
            self._pending.append((positions, index))
            self._width += int(index.shape[1])
            return
        dense = self._dense if full else None
        if kept is None:
            kept = torch.ones(index.shape, dtype=torch.bool, device=index.device)
        self.visible = torch.cat([self.visible, kept], dim=1)
        self._dense = dense
        self.positions = torch.cat([self.positions, positions.gather(1, index)], dim=1)

    def crop(self, width: int | None = None) -> None:
        """Drop slots from ``width`` on (default: everything the bookkeeping does not cover)."""
        width = self.width if width is None else width
        crop(self.cache, width)
        dense = True if self._dense else None  # dropping slots keeps a cache without holes so
        self.visible, self.positions = self.visible[:, :width], self.positions[:, :width]
        self._dense = dense

    def select_rows(self, rows: torch.Tensor) -> None:
        select_rows(self.cache, rows)
        self.visible, self.positions = self.visible[rows], self.positions[rows]

    def dense(self) -> bool:
        """True when no row has a hole (every slot the bookkeeping covers is visible)."""
        if self._dense is None:
            self._dense = bool(self._visible.all())
        return self._dense

    def compact(self) -> bool:
        """Squeeze the holes out (each row's live slots right-aligned) once they fill half the
        cache; True if it did."""
        if self.dense():
            return False
        counts = self.visible.sum(dim=1)
        longest = int(counts.max())
        if 2 * longest > self.width:
            return False
        order = torch.argsort((~self.visible).to(torch.int8), dim=1, stable=True)[:, :longest]  # live slots first
        shift = longest - counts  # (R,) leading holes per row
        columns = torch.arange(longest, device=order.device)
        index = order.gather(1, (columns[None, :] - shift[:, None]).clamp(min=0))
        gather(self.cache, 0, index)
        self.positions = self.positions.gather(1, index)
        self.visible = columns[None, :] >= shift[:, None]
        return True
