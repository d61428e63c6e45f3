"""Tests for training/distill_data.py: self-distillation data and its cache."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.training.test_prompts import PROMPTS, tokenizer  # noqa: F401 (tokenizer: a fixture)
from training import distill_data
from training.prompts import tokenize_prompts


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


# ------------------------------------------------------------------ self-distillation data


def reference_greedy(model: LlamaForCausalLM, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    output = model.generate(
        ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=1,
    )
    return output[0].tolist()


def test_greedy_matches_model_generate(model, tokenizer) -> None:  # noqa: ANN001
    sequences = distill_data.generate_distillation_data(
        model, tokenizer, PROMPTS, max_new_tokens=6, target_id="tiny"
    )
    prompt_ids = tokenize_prompts(tokenizer, PROMPTS)
    assert len(sequences) == len(PROMPTS)
    for ids, sequence in zip(prompt_ids, sequences):
        assert sequence.dtype == torch.long
        assert sequence[: len(ids)].tolist() == ids.tolist()
        assert len(ids) < len(sequence) <= len(ids) + 6
        assert sequence.tolist() == reference_greedy(model, ids, 6)


def test_batched_greedy_equals_unbatched(model, tokenizer, monkeypatch) -> None:  # noqa: ANN001
    prompt_ids = tokenize_prompts(tokenizer, PROMPTS)
    # make prompt 0's second new token the eos so that rows finish at different steps and
    # generate pads the finished row; that padding must not reach the output
    eos = reference_greedy(model, prompt_ids[0], 2)[-1]
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    sequences = distill_data.generate_distillation_data(
        model, tokenizer, PROMPTS, max_new_tokens=5, target_id="t", batch_size=3
    )
    expected = [reference_greedy(model, ids, 5) for ids in prompt_ids]
    new_counts = [len(e) - len(ids) for e, ids in zip(expected, prompt_ids)]
    assert expected[0][-1] == eos and new_counts[0] < max(new_counts)
    assert [s.tolist() for s in sequences] == expected


def test_cache_hit_skips_generation(model, tokenizer, tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    kwargs = dict(max_new_tokens=4, target_id="tiny-llama", cache_dir=tmp_path)
    first = distill_data.generate_distillation_data(model, tokenizer, PROMPTS, **kwargs)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors"
    assert files[0].name.startswith("distill-") and len(files[0].stem) == len("distill-") + 64

    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("generate must not be called on a cache hit")

    monkeypatch.setattr(model, "generate", forbidden)
    with caplog.at_level(logging.INFO, logger="training.distill_data"):
        second = distill_data.generate_distillation_data(model, tokenizer, PROMPTS, **kwargs)
    assert [s.tolist() for s in second] == [s.tolist() for s in first]
    assert any("cache file" in record.getMessage() for record in caplog.records)

    with pytest.raises(AssertionError, match="must not be called"):  # other settings miss
        distill_data.generate_distillation_data(model, tokenizer, PROMPTS[:2], **kwargs)


def test_cache_key_depends_on_settings(model, tokenizer, tmp_path) -> None:  # noqa: ANN001
    common = dict(max_new_tokens=3, cache_dir=tmp_path)
    distill_data.generate_distillation_data(model, tokenizer, PROMPTS[:1], target_id="a", **common)
    distill_data.generate_distillation_data(
        model, tokenizer, PROMPTS[:1], target_id="a", temperature=0.8, **common
    )
    distill_data.generate_distillation_data(model, tokenizer, PROMPTS[:1], target_id="b", **common)
    distill_data.generate_distillation_data(
        model, tokenizer, PROMPTS[:1], target_id="a", temperature=0.8, seed=5, **common
    )
    assert len(list(tmp_path.glob("distill-*.safetensors"))) == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_sampling_reproducible_and_global_rng_untouched(model, tokenizer) -> None:  # noqa: ANN001
    prompts = PROMPTS[:2]
    kwargs = dict(max_new_tokens=8, temperature=1.5, target_id="t")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = distill_data.generate_distillation_data(model, tokenizer, prompts, seed=7, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    second = distill_data.generate_distillation_data(model, tokenizer, prompts, seed=7, **kwargs)
    assert [s.tolist() for s in first] == [s.tolist() for s in second]
    # per-prompt seeds: prompt i of a run with seed s is prompt 0 of a run with seed s + i,
    # and a different seed gives a different sample (8 tokens at temperature 1.5 over 64)
    alone = distill_data.generate_distillation_data(model, tokenizer, prompts[1:], seed=8, **kwargs)
    assert alone[0].tolist() == first[1].tolist()
    shifted = distill_data.generate_distillation_data(model, tokenizer, prompts[:1], seed=8, **kwargs)
    assert shifted[0].tolist() != first[0].tolist()


def test_generation_errors(model, tokenizer) -> None:  # noqa: ANN001
    long_prompt = " ".join(["one"] * 30)
    with pytest.raises(ValueError, match=r"prompt 1 has 30 tokens.*limit of 22.*context_length=32"):
        distill_data.generate_distillation_data(
            model, tokenizer, ["one", long_prompt], max_new_tokens=10, target_id="t"
        )
    truncated = distill_data.generate_distillation_data(
        model, tokenizer, [long_prompt], max_new_tokens=10, target_id="t", truncate=True
    )
    assert truncated[0][:22].tolist() == tokenizer(long_prompt)["input_ids"][-22:]
    with pytest.raises(ValueError, match="max_new_tokens"):
        distill_data.generate_distillation_data(model, tokenizer, PROMPTS, max_new_tokens=40, target_id="t")
    with pytest.raises(ValueError, match="temperature"):
        distill_data.generate_distillation_data(
            model, tokenizer, PROMPTS, max_new_tokens=2, temperature=-1.0, target_id="t"
        )
