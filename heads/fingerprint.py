"""Cheap, dtype-tolerant fingerprints of tensor collections (a target's weights, a LoRA's tensors)."""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch


def strided_sample(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """Every ``numel // count``-th element of ``tensor`` in row-major order (at most ``count``),
    as bfloat16 on the CPU. Reads only those elements: a strided view of a contiguous tensor, an
    index gather of a non-contiguous one (never a flattened copy of the whole tensor)."""
    tensor = tensor.detach()
    numel = tensor.numel()
    step = max(1, numel // count)
    if tensor.is_contiguous():
        sample = tensor.view(-1)[::step][:count]
    else:
        flat_index = torch.arange(0, numel, step, device=tensor.device)[:count]
        sample = tensor[torch.unravel_index(flat_index, tensor.shape)]
    return sample.to("cpu", torch.float32).to(torch.bfloat16)


def state_fingerprint(state: Mapping[str, torch.Tensor], samples_per_tensor: int = 1024,
                      prefix: bytes = b"") -> str:
    """sha256 over ``prefix`` and, per tensor in name order, its name, shape and a fixed strided
    sample rounded to bfloat16 (so fp32, fp16 and bf16 copies agree in almost all cases). Cost:
    ``O(samples_per_tensor)`` elements per tensor whatever its size."""
    digest = hashlib.sha256(prefix)
    for name, tensor in sorted(state.items()):
        sample = strided_sample(tensor, samples_per_tensor)
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
