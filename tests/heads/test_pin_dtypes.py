"""The target pin holds across fp32 / fp16 / bf16 copies of one checkpoint and still refuses
another checkpoint and a fine-tune (issue 36, item 1)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import heads
from heads.fingerprint import ROUNDING_TOLERANCE, sample_mismatches, weight_sample

pytestmark = pytest.mark.fast  # in `make test-fast`

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "benchmarks" / "targets" / "stories260K"
SHIPPED = sorted(path for path in (ROOT / "benchmarks" / "adapters").glob("stories260K-*")
                 if (path / "adapter_config.json").is_file())
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_target(dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=dtype)


def fine_tuned(dtype: torch.dtype, relative: float = 1e-2):
    """The target with noise of ``relative`` x each matrix's std added to three matrices (fp32), then cast."""
    model = load_target(torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (model.model.layers[0].mlp.up_proj.weight, model.model.layers[2].self_attn.q_proj.weight,
                       model.model.layers[4].mlp.down_proj.weight):
            weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * relative)
    return model.to(dtype)


def other_checkpoint(dtype: torch.dtype):
    """A random initialisation of the target's config (same shapes, other weights)."""
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TARGET)).to(dtype)


def test_shipped_adapters_found():
    assert len(SHIPPED) >= 3, SHIPPED


@pytest.mark.parametrize("adapter", SHIPPED, ids=lambda path: path.name)
def test_shipped_adapter_loads_in_every_dtype_and_refuses_others(adapter):
    for dtype in DTYPES:
        spec = heads.load_heads(load_target(dtype), adapter)
        assert spec.kind in ("medusa", "eagle")
        with pytest.raises(heads.TargetMismatchError, match="weights"):
            heads.load_heads(fine_tuned(dtype), adapter)
        with pytest.raises(heads.TargetMismatchError, match="weights"):
            heads.load_heads(other_checkpoint(dtype), adapter)


def test_pin_of_one_checkpoint_matches_through_double_rounding():
    pin = heads.TargetPin.of(load_target(torch.float32))
    via_fp16 = load_target(torch.float16).to(torch.bfloat16)
    # the exact hash differs here (the bug: bf16 rounding of an fp16 value), the tolerant pin does not
    assert heads.TargetPin.of(via_fp16).recorded["weights_sha256"] != pin.recorded["weights_sha256"]
    assert pin.differences(heads.TargetPin.of(via_fp16)) == []
    assert heads.TargetPin.of(via_fp16).differences(pin) == []


def test_sample_tolerance_covers_every_rounding_chain():
    generator = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(257, 129, generator=generator) * scale
             for i, scale in enumerate((1e-6, 1e-3, 0.02, 1.0, 300.0))}
    recorded = weight_sample(state)
    chains = [(torch.float16,), (torch.bfloat16,), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)]
    for chain in chains:
        copy = dict(state)
        for dtype in chain:
            copy = {name: tensor.to(dtype) for name, tensor in copy.items()}
        assert sample_mismatches(recorded, weight_sample(copy), ("float32", str(chain[-1])[6:])) is None, chain
    for relative in (1e-2, 3 * ROUNDING_TOLERANCE):
        noisy = {name: tensor + torch.randn(tensor.shape, generator=generator) * tensor.std() * relative
                 for name, tensor in state.items()}
        assert sample_mismatches(recorded, weight_sample(noisy)) is not None


def _old_pin_copy(adapter: Path, destination: Path) -> Path:
    """``adapter`` as a format_version 1 adapter wrote it (no weights sample)."""
    shutil.copytree(adapter, destination)
    path = destination / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target"].pop("weights_sample", None)
    config["format_version"] = 1
    path.write_text(json.dumps(config))
    return destination


def test_old_pin_still_loads_and_says_when_it_cannot_check(tmp_path, caplog):
    old = _old_pin_copy(SHIPPED[0], tmp_path / "old")
    for dtype in (torch.float32, torch.bfloat16):  # exact: the bf16-rounded hash holds
        with caplog.at_level(logging.WARNING):
            heads.load_heads(load_target(dtype), old)
        assert "cannot be checked" not in caplog.text
        with pytest.raises(heads.TargetMismatchError, match="weights"):
            heads.load_heads(other_checkpoint(dtype), old)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        heads.load_heads(load_target(torch.float16), old)
    assert "cannot be checked against an fp16 copy" in caplog.text and "Re-save the adapter" in caplog.text


def test_saved_adapter_records_the_sample_and_version(tmp_path):
    model = load_target(torch.float16)
    spec = heads.load_heads(model, SHIPPED[0])
    spec.save_pretrained(tmp_path / "resaved")
    config = json.loads((tmp_path / "resaved" / "adapter_config.json").read_text())
    assert config["format_version"] == 3 and set(config["target"]["weights_sample"]) == {
        "per_tensor", "layout_sha256", "float32"}
    assert config["target"]["dtype"] == "float16"
    for dtype in DTYPES:  # pinned from an fp16 copy: fp32 and bf16 copies still match
        heads.load_heads(load_target(dtype), tmp_path / "resaved")
    with pytest.raises(heads.TargetMismatchError):
        heads.load_heads(fine_tuned(torch.float32), tmp_path / "resaved")
