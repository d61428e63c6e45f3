"""Cheap fingerprints of tensor collections (a target's weights, a LoRA's tensors).

Two kinds:

* :func:`state_fingerprint`: a sha256 of a strided sample rounded to bfloat16: exact identity,
  equal for fp32 and bf16 copies of one checkpoint, but not always for an fp16 copy (fp32 -> fp16
  -> bf16 rounds twice and lands on the other bf16 neighbour for a few percent of the values).
* :func:`weight_sample` / :func:`sample_mismatches`: the sampled values themselves (a few per
  tensor, float32), compared with a tolerance that covers any chain of fp32/fp16/bf16 roundings of
  one checkpoint. Another checkpoint or a fine-tune moves most sampled values far beyond it: a
  relative change of size ``e`` on weights of typical size moves a sample by more than the
  tolerance with probability ``P(|Cauchy| > tol / e)``, about 58% for ``e = 1e-2``.
"""

from __future__ import annotations

import base64
import hashlib
import math
from typing import Mapping

import torch

SAMPLE_BUDGET = 2048
"""Sampled values a weight sample aims at in all (``per_tensor`` = budget / tensors, clamped)."""
MIN_PER_TENSOR, MAX_PER_TENSOR = 4, 64
"""Bounds of the values sampled per tensor: every tensor is sampled (a fine-tune of one matrix is
seen), and a small model does not record more than it needs."""
ROUNDING_TOLERANCE = 2.0 ** -7
"""Relative tolerance of :func:`sample_mismatches`: 4 x bfloat16's unit roundoff (2^-9). Two
copies of one value x that went through any of fp32, fp16 and bf16 (in any order, at most twice
each side) differ by at most ``(2 u_bf16 + 2 u_fp16) |x|`` (about 2.5 u_bf16), below this."""
ABSOLUTE_TOLERANCE = 2.0 ** -23
"""Absolute part of the tolerance: fp16 keeps values below 2^-14 as subnormals with an absolute
spacing of 2^-24 (half of it lost per rounding), and flushes values below 2^-25 to zero."""
_UNIT_ROUNDOFF = {"float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}
"""Dtypes coarser than bf16 a pin may name: the tolerance grows to 4 x their unit roundoff."""


def strided_sample(tensor: torch.Tensor, count: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Every ``numel // count``-th element of ``tensor`` in row-major order (at most ``count``),
    as ``dtype`` on the CPU (through float32). Reads only those elements: a strided view of a
    contiguous tensor, an index gather of a non-contiguous one (never a flattened copy of the
    whole tensor)."""
    tensor = tensor.detach()
    numel = tensor.numel()
    step = max(1, numel // count)
    if tensor.is_contiguous():
        sample = tensor.view(-1)[::step][:count]
    else:
        flat_index = torch.arange(0, numel, step, device=tensor.device)[:count]
        sample = tensor[torch.unravel_index(flat_index, tensor.shape)]
    return sample.to("cpu", torch.float32).to(dtype)


def state_fingerprint(state: Mapping[str, torch.Tensor], samples_per_tensor: int = 1024,
                      prefix: bytes = b"") -> str:
    """sha256 over ``prefix`` and, per tensor in name order, its name, shape and a fixed strided
    sample rounded to bfloat16 (fp32 and bf16 copies agree; an fp16 copy may not, see the module
    docstring). Cost: ``O(samples_per_tensor)`` elements per tensor whatever its size."""
    digest = hashlib.sha256(prefix)
    for name, tensor in sorted(state.items()):
        sample = strided_sample(tensor, samples_per_tensor)
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def layout_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the tensors' names and shapes, in name order (no values)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(f"{name}{tuple(tensor.shape)};".encode())
    return digest.hexdigest()


def samples_per_tensor(tensor_count: int) -> int:
    """Values sampled per tensor for a state of ``tensor_count`` tensors."""
    return max(MIN_PER_TENSOR, min(MAX_PER_TENSOR, SAMPLE_BUDGET // max(1, tensor_count)))


def weight_sample(state: Mapping[str, torch.Tensor]) -> dict:
    """The dtype-tolerant part of a pin: ``{"per_tensor": k, "layout_sha256": names and shapes,
    "float32": base64 of the little-endian float32 strided samples}`` (k per tensor, fewer for a
    tensor with fewer elements, tensors in name order)."""
    per_tensor = samples_per_tensor(len(state))
    values = [strided_sample(tensor, per_tensor, torch.float32) for _, tensor in sorted(state.items())]
    flat = torch.cat(values) if values else torch.zeros(0)
    raw = flat.numpy().astype("<f4").tobytes()
    return {"per_tensor": per_tensor, "layout_sha256": layout_fingerprint(state),
            "float32": base64.b64encode(raw).decode("ascii")}


def decode_sample(sample: Mapping) -> torch.Tensor:
    """The float32 values of a :func:`weight_sample` (ValueError when not valid base64 of float32s)."""
    raw = base64.b64decode(sample["float32"], validate=True)
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of float32 values")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.zeros(0)


def relative_tolerance(*dtypes: str | None) -> float:
    """:data:`ROUNDING_TOLERANCE`, or 4 x the unit roundoff of a coarser dtype among ``dtypes``."""
    coarsest = max((_UNIT_ROUNDOFF.get(dtype or "", 0.0) for dtype in dtypes), default=0.0)
    return max(ROUNDING_TOLERANCE, 4 * coarsest)


def sample_mismatches(recorded: Mapping, current: Mapping, dtypes: tuple[str | None, ...] = ()) -> str | None:
    """None when ``current`` (a :func:`weight_sample` of a model) holds the values of
    ``recorded`` up to rounding through any of fp32/fp16/bf16 (and ``dtypes``, the two sides'
    dtypes); else what differs, in words."""
    if recorded.get("layout_sha256") != current.get("layout_sha256"):
        return "another set of tensors (names or shapes differ)"
    if recorded.get("per_tensor") != current.get("per_tensor"):
        return (f"sampled {recorded.get('per_tensor')!r} values per tensor, this model {current.get('per_tensor')!r} "
                "(the same tensors would give the same count)")
    before, after = decode_sample(recorded), decode_sample(current)
    if before.shape != after.shape:
        return f"{before.numel()} sampled values recorded, {after.numel()} in this model"
    rtol = relative_tolerance(*dtypes)
    both_nan = before.isnan() & after.isnan()
    scale = torch.maximum(before.abs(), after.abs())
    close = ((before - after).abs() <= ABSOLUTE_TOLERANCE + rtol * scale) | both_nan | (before == after)
    differing = int((~close).sum())
    if not differing:
        return None
    return (f"{differing} of {before.numel()} sampled values differ beyond what fp32/fp16/bf16 rounding explains "
            f"(relative tolerance {rtol:.2g}, i.e. {math.log2(1 / rtol):.0f} bits)")
