"""Batches and files of token sequences: `collate` right-pads 1D sequences into a batch;
`save_sequences` / `load_sequences` keep them as safetensors (the distillation cache, the on-policy
pool of a checkpoint), written atomically."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .files import write_file_atomically

FORMAT_VERSION = 1
"""Version of the sequences file layout (``ids`` + ``offsets``)."""


def collate(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1D sequences into ``(input_ids [B, T], attention_mask [B, T])`` (long),
    ``T`` the longest length; padding is ``pad_id`` with mask 0."""
    if len(sequences) == 0:
        raise ValueError("collate needs at least one sequence")
    for index, sequence in enumerate(sequences):
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(
                f"sequence {index} must be a non-empty 1D tensor, got shape {tuple(sequence.shape)}"
            )
    length = max(sequence.numel() for sequence in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : sequence.numel()] = sequence
        attention_mask[row, : sequence.numel()] = 1
    return input_ids, attention_mask


def save_sequences(path: Path, sequences: Sequence[torch.Tensor], settings: dict[str, Any]) -> None:
    """Write sequences as safetensors ``ids`` (concatenated) + ``offsets`` ``[N + 1]``, with
    ``settings`` in the metadata, atomically."""
    from safetensors.torch import save_file

    lengths = torch.tensor([0] + [sequence.numel() for sequence in sequences], dtype=torch.long)
    tensors = {
        "ids": torch.cat([sequence.long() for sequence in sequences]).contiguous(),
        "offsets": torch.cumsum(lengths, dim=0),
    }
    metadata = {"format_version": str(FORMAT_VERSION), "settings": json.dumps(settings)}
    write_file_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


def load_sequences(path: Path, expected_count: int) -> list[torch.Tensor]:
    """The ``expected_count`` sequences `save_sequences` wrote to ``path`` (ValueError otherwise)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    ids, offsets = tensors.get("ids"), tensors.get("offsets")
    if ids is None or offsets is None or offsets.numel() != expected_count + 1:
        raise ValueError(
            f"sequences file {path} does not hold {expected_count} sequences as "
            "'ids' + 'offsets'; delete it to regenerate"
        )
    bounds = offsets.tolist()
    return [ids[start:end].clone() for start, end in zip(bounds[:-1], bounds[1:])]
