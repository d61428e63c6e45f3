"""Tests for training/sequences.py and training/files.py: batches of sequences, their file format and
the atomic single-file writer."""

from __future__ import annotations

import pytest
import torch

from training import sequences
from training.files import write_file_atomically, write_json


def test_collate_right_pads() -> None:
    input_ids, attention_mask = sequences.collate([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=1)
    assert input_ids.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="at least one"):
        sequences.collate([], pad_id=0)
    with pytest.raises(ValueError, match="sequence 0"):
        sequences.collate([torch.zeros(2, 2, dtype=torch.long)], pad_id=0)


def test_sequences_round_trip_and_count_check(tmp_path) -> None:
    original = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([1, 2])]
    path = tmp_path / "deep" / "pool.safetensors"
    sequences.save_sequences(path, original, {"note": "test"})
    assert [s.tolist() for s in sequences.load_sequences(path, 3)] == [[5, 6, 7], [8], [1, 2]]
    with pytest.raises(ValueError, match="does not hold 2 sequences"):
        sequences.load_sequences(path, 2)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path) -> None:
    path = write_json(tmp_path / "report.json", {"a": 1})
    assert path.read_text() == '{\n  "a": 1\n}\n'

    def failing(temporary):
        temporary.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_file_atomically(path, failing)
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
