"""The default training recipe (issue 39 item 3): without a recipe flag `selfdraft train` distils on
greedy and sampled continuations mixed (Medusa: greedy continuations alone, its kind's own default)
and records that the adapter serves any temperature; any recipe flag specialises the run exactly as
before."""

from __future__ import annotations

import json

import pytest
import torch

from tests.training.test_cli import _train_args, _write_prompts, model_dir  # noqa: F401 (model_dir: a fixture)
from tests.training.test_distill_data import model, reference_greedy  # noqa: F401 (model: a fixture)
from tests.training.test_prompts import tokenizer  # noqa: F401 (a fixture)
from training import distill_data
from training.cli import build_parser, main
from training.commands.train import train_config
from training.prompts import tokenize_prompts
from training.recipe import DEFAULT_RECIPE, default_recipe, recipe

WORDS = ["the cat sat", "a dog ran far away", "one two three", "the dog sat", "a cat ran", "two three one",
         "far away the cat", "one dog"]


def _args(*flags: str):
    return build_parser().parse_args(["train", "--model", "m", "--data", "d", "--out", "o", *flags])


# ------------------------------------------------------------------ the data: shares, determinism


def test_mixed_data_draws_each_prompt_at_its_share_of_the_temperatures(model, tokenizer):  # noqa: F811
    settings = dict(max_new_tokens=8, seed=3, target_id="tiny")
    sequences, drawn_at = distill_data.generate_mixed_distillation_data(
        model, tokenizer, WORDS, temperatures=DEFAULT_RECIPE.data_temperatures, **settings)
    assert DEFAULT_RECIPE.data_temperatures == (0.0, 0.7)
    assert drawn_at == [0.0, 0.7] * 4 and len(sequences) == len(WORDS)
    prompt_ids = tokenize_prompts(tokenizer, WORDS)
    greedy = [sequence.tolist() == reference_greedy(model, ids, 8) for ids, sequence in zip(prompt_ids, sequences)]
    assert all(greedy[0::2])  # the greedy share is exactly the target's greedy continuation
    assert not all(greedy[1::2])  # the sampled share is sampled (a random tiny model at 0.7 strays)
    for ids, sequence in zip(prompt_ids, sequences):
        assert sequence[: len(ids)].tolist() == ids.tolist()
    again, _ = distill_data.generate_mixed_distillation_data(
        model, tokenizer, WORDS, temperatures=(0.0, 0.7), **settings)
    assert [s.tolist() for s in again] == [s.tolist() for s in sequences]  # seeded
    other, _ = distill_data.generate_mixed_distillation_data(
        model, tokenizer, WORDS, temperatures=(0.0, 0.7), **{**settings, "seed": 4})
    assert [s.tolist() for s in other[0::2]] == [s.tolist() for s in sequences[0::2]]
    assert [s.tolist() for s in other[1::2]] != [s.tolist() for s in sequences[1::2]]


def test_repeated_temperatures_set_the_shares(model, tokenizer):  # noqa: F811
    sequences, drawn_at = distill_data.generate_mixed_distillation_data(
        model, tokenizer, WORDS[:7], temperatures=(0.0, 0.0, 0.7), max_new_tokens=4, target_id="tiny")
    assert drawn_at == [0.0, 0.0, 0.7, 0.0, 0.0, 0.7, 0.0] and len(sequences) == 7
    with pytest.raises(ValueError, match="temperatures is empty"):
        distill_data.generate_mixed_distillation_data(model, tokenizer, WORDS, temperatures=(), max_new_tokens=4,
                                                      target_id="tiny")


# ------------------------------------------------------------------ flags: the default and what overrides it


def test_no_recipe_flag_is_the_default_recipe():
    for kind in ("eagle", "draft"):
        chosen = recipe(_args("--kind", kind))
        assert chosen is DEFAULT_RECIPE and chosen.serving == "any" and chosen.evaluated_at == (0.0, 0.7)
    config = train_config(_args("--kind", "eagle"))
    assert config.temperature == DEFAULT_RECIPE.temperature == 1.0
    assert config.on_policy_ratio == DEFAULT_RECIPE.on_policy_ratio
    # flags that tune a run without choosing what it is trained for keep the default
    assert recipe(_args("--kind", "eagle", "--steps", "5", "--on-policy-refresh", "7", "--loss", "jsd")) is DEFAULT_RECIPE


def test_medusas_default_recipe_distils_greedy_continuations_for_any_temperature():
    chosen = recipe(_args())  # --kind medusa, the default kind
    assert chosen == default_recipe("medusa") != DEFAULT_RECIPE
    assert chosen.data_temperatures == (0.0,)
    assert (chosen.serving, chosen.evaluated_at, chosen.temperature, chosen.on_policy_ratio) == (
        "any", (0.0, 0.7), DEFAULT_RECIPE.temperature, DEFAULT_RECIPE.on_policy_ratio)
    assert default_recipe(None) is default_recipe("eagle") is DEFAULT_RECIPE
    with pytest.raises(ValueError, match=r"kind must be one of .*got 'medusa2'"):
        default_recipe("medusa2")


@pytest.mark.parametrize("flags, temperature, data, ratio, evaluated", [
    (["--temperature", "0.7"], 0.7, (0.0,), 0.0, (0.0,)),
    (["--data-temperature", "0"], 1.0, (0.0,), 0.0, (0.0,)),
    (["--data-temperature", "0.7"], 1.0, (0.7,), 0.0, (0.0,)),
    (["--temperature", "0.7", "--data-temperature", "0.7", "--on-policy"], 0.7, (0.7,), 0.5, (0.0, 0.7)),
    (["--on-policy-ratio", "0.25", "--on-policy-temperature", "0.5"], 1.0, (0.0,), 0.25, (0.0, 0.5)),
    (["--original-text"], 1.0, (0.0,), 0.0, (0.0,)),
    (["--data-temperature", "0", "0", "1.0"], 1.0, (0.0, 0.0, 1.0), 0.0, (0.0,)),
])
def test_any_recipe_flag_specialises_as_before(flags, temperature, data, ratio, evaluated):
    chosen = recipe(_args(*flags))
    assert chosen.serving == "specialised"
    assert (chosen.temperature, chosen.data_temperatures, chosen.on_policy_ratio, chosen.evaluated_at) == (
        temperature, data, ratio, evaluated)
    config = train_config(_args(*flags))
    assert (config.temperature, config.on_policy_ratio) == (temperature, ratio)


@pytest.mark.parametrize("values", [["-0.5"], ["0", "-0.7"], ["nan"]])
def test_a_negative_data_temperature_is_refused_by_name(model_dir, tmp_path, capsys, values):  # noqa: F811
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    args = _train_args(model_dir, data, tmp_path / "adapter", tmp_path / "cache", tmp_path / "s.json")
    assert main([*args, "--data-temperature", *values]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("selfdraft train: error: --data-temperature must be a number >= 0"), err
    assert not (tmp_path / "adapter").exists()


# ------------------------------------------------------------------ end to end: the adapter records it


def test_the_default_recipe_is_recorded_and_measured_at_both_temperatures(model_dir, tmp_path):  # noqa: F811
    data = _write_prompts(tmp_path / "prompts.jsonl", 16, seed=5)
    cache = tmp_path / "cache"
    assert main(_train_args(model_dir, data, tmp_path / "default", cache, tmp_path / "d.json", steps=4)) == 0
    config = json.loads((tmp_path / "default" / "adapter_config.json").read_text())
    training = config["training"]  # Medusa's default recipe: greedy data, served at any temperature
    assert training["serving"] == "any" and training["serving_temperatures"] == [0.0, 0.7]
    assert training["data_temperature"] == 0.0 and training["temperature"] == 1.0
    assert training["on_policy"] is (DEFAULT_RECIPE.on_policy_ratio > 0)
    entries = config["acceptance"]["prompts"]
    assert [entry.get("temperature", 0.0) for entry in entries] == [0.0, 0.7]
    assert all(entry["split"] == "held-out" and entry["tau"] >= 1.0 for entry in entries)
    assert len(list(cache.glob("distill-*.safetensors"))) == 1  # one generation: greedy

    args = _train_args(model_dir, data, tmp_path / "sampled", cache, tmp_path / "s.json", steps=4)
    assert main([*args, "--data-temperature", "0.7"]) == 0
    training = json.loads((tmp_path / "sampled" / "adapter_config.json").read_text())["training"]
    assert training["serving"] == "specialised" and training["serving_temperatures"] == [0.0]
    assert training["data_temperature"] == 0.7 and training["on_policy"] is False
    acceptance = json.loads((tmp_path / "sampled" / "adapter_config.json").read_text())["acceptance"]
    assert isinstance(acceptance["prompts"], dict)  # one entry, greedy, as before
    assert len(list(cache.glob("distill-*.safetensors"))) == 2  # all prompts sampled: a new generation
    one = json.loads((tmp_path / "d.json").read_text())["losses"]
    two = json.loads((tmp_path / "s.json").read_text())["losses"]
    assert not torch.allclose(torch.tensor(one), torch.tensor(two))  # different data


def test_eagles_default_recipe_mixes_greedy_and_sampled_data(model_dir, tmp_path):  # noqa: F811
    data = _write_prompts(tmp_path / "prompts.jsonl", 16, seed=5)
    cache = tmp_path / "cache"
    args = _train_args(model_dir, data, tmp_path / "eagle", cache, tmp_path / "e.json", steps=2)
    at = args.index("--num-heads")
    del args[at:at + 2]  # (a Medusa flag)
    assert main([*args, "--kind", "eagle", "--for", "hf"]) == 0
    training = json.loads((tmp_path / "eagle" / "adapter_config.json").read_text())["training"]
    assert training["serving"] == "any" and training["serving_temperatures"] == [0.0, 0.7]
    assert training["data_temperature"] == [0.0, 0.7]
    assert len(list(cache.glob("distill-*.safetensors"))) == 2  # one generation per data temperature
