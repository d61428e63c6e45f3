"""Adapters written by the previous layout of the code (wave 1, commit 65d7374: heads/medusa.py,
heads/eagle.py, heads/adapter.py) still load, tensor for tensor, and decode losslessly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import heads
from conftest import build_model, greedy_reference, random_prompt

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name, kind", [("wave1-medusa", "medusa"), ("wave1-eagle", "eagle")])
def test_wave1_adapter_loads_and_decodes(name, kind):
    model = build_model("llama", seed=11)  # the target the fixtures were saved on
    spec = heads.load_heads(model, FIXTURES / name)
    assert spec.kind == kind
    saved = load_file(str(FIXTURES / name / "adapter_model.safetensors"))
    state = spec.heads.state_dict()
    assert set(saved) == set(state) and all(torch.equal(saved[key], state[key]) for key in saved)
    prompt = random_prompt(8, seed=5)
    assert torch.equal(spec.generate(prompt, max_new_tokens=20), greedy_reference(model, prompt, 20))


def test_wave1_adapter_refuses_another_target():
    with pytest.raises(heads.TargetMismatchError):
        heads.load_heads(build_model("llama", seed=12), FIXTURES / "wave1-medusa")
