"""Tests for training/data.py: prompt files, tokenization, self-distillation data and its cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training import data
from training.data import DataFormatError

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran far away from the house",
    "User : hello there Assistant : System : be brief",
    "one two three four five six seven eight nine ten",
]
PROMPTS = ["the cat sat", "a dog ran far away", "one two three"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer trained on a few sentences (no downloads), < 64 tokens."""
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"])
    backend.train_from_iterator(SENTENCES, trainer)
    result = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )
    assert len(result) < 64
    return result


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


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, records: list[object]) -> Path:
    return write(path, [json.dumps(record) for record in records])


# ------------------------------------------------------------------ load_prompts


def test_prompt_and_text_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "first"}, {"text": "second\nline"}])
    assert data.load_prompts(path) == ["first", "second\nline"]


def test_sharegpt_conversation_rendered_up_to_first_human_turn(tmp_path: Path) -> None:
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "And 3+3?"},
        ]
    }
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    assert data.load_prompts(path) == ["System: Be brief.\nUser: What is 2+2?\nAssistant:"]


def test_openai_messages(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    assert data.load_prompts(path) == ["User: Hi\nAssistant:"]


def test_chat_template_used_when_tokenizer_has_one(tmp_path: Path) -> None:
    class TemplateTokenizer:
        chat_template = "some template"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # noqa: ANN001
            assert add_generation_prompt is True and tokenize is False
            return "|".join(f"{m['role']}={m['content']}" for m in messages) + "|assistant="

    record = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record, {"prompt": "plain"}])
    assert data.load_prompts(path, tokenizer=TemplateTokenizer()) == ["user=Q|assistant=", "plain"]


def test_real_chat_template(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    templated = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    templated.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    record = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    assert data.load_prompts(path, tokenizer=templated) == ["<system>S<user>U<assistant>"]
    # a tokenizer without a template falls back to the plain rendering
    assert data.load_prompts(path, tokenizer=tokenizer) == ["System: S\nUser: U\nAssistant:"]


@pytest.mark.parametrize("name", ["prompts.txt", "prompts", "prompts.md"])
def test_plain_text_paragraphs(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\nfirst para\nstill first\n\n  \n\nsecond\n\n\nthird\n", encoding="utf-8")
    assert data.load_prompts(path) == ["first para\nstill first", "second", "third"]


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    records = [{"conversations": [{"from": "human", "value": "hey"}]}, {"prompt": "p"}]
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    assert data.load_prompts(path) == ["User: hey\nAssistant:", "p"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "ok"}, {"nope": 1}]), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.json record 2: missing key"):
        data.load_prompts(bad)


def test_json_file_of_json_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert data.load_prompts(path) == ["a", "b"]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.jsonl", ['{"prompt": "ok"}', "", '{"prompt": "x"', "{}"])
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 3: invalid JSON") as info:
        data.load_prompts(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "q"}, r"line 2: missing key.*'prompt'.*'question'"),
        ({"prompt": 3}, r"line 2: 'prompt' must be a string, got int"),
        ({"text": None}, r"line 2: 'text' must be a string"),
        ({"prompt": "   "}, r"line 2: 'prompt' is empty"),
        (["prompt"], r"line 2: expected a JSON object, got list"),
        ({"conversations": [{"from": "gpt", "value": "hi"}]}, r"line 2: .*no human/user turn"),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, r"line 2: turn 1 .*'alien'"),
        ({"conversations": [{"from": "human"}]}, r"line 2: turn 1 .*'from' and 'value'"),
        ({"conversations": [{"from": "human", "value": 5}]}, r"line 2: turn 1 'value' must be"),
        ({"conversations": [{"from": "human", "value": ""}]}, r"line 2: .*user turn.* empty"),
        ({"messages": "hello"}, r"line 2: 'messages' must be a list"),
        ({"messages": [{"role": "user", "value": "x"}]}, r"line 2: turn 1 .*'role' and 'content'"),
    ],
)
def test_bad_records(tmp_path: Path, record: object, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, record])
    with pytest.raises(DataFormatError, match=message) as info:
        data.load_prompts(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt", "empty.json"])
def test_empty_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="no prompts") as info:
        data.load_prompts(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        data.load_prompts(path)


# ------------------------------------------------------------------ tokenization and collate


def test_tokenize_prompts(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = data.tokenize_prompts(tokenizer, PROMPTS, max_prompt_tokens=8, context_length=32)
    assert [sequence.tolist() for sequence in ids] == [
        tokenizer(prompt)["input_ids"] for prompt in PROMPTS
    ]
    assert all(sequence.dtype == torch.long and sequence.dim() == 1 for sequence in ids)


def test_prompt_too_long_names_index_and_lengths(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens.*limit of 4.*context_length=4"):
        data.tokenize_prompts(tokenizer, PROMPTS, context_length=4)
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens.*max_prompt_tokens=3"):
        data.tokenize_prompts(tokenizer, PROMPTS, max_prompt_tokens=3, context_length=32)
    truncated = data.tokenize_prompts(tokenizer, PROMPTS, context_length=2, truncate=True)
    assert truncated[1].tolist() == tokenizer(PROMPTS[1])["input_ids"][-2:]
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        data.tokenize_prompts(tokenizer, [""])


def test_text_sequences(tokenizer: PreTrainedTokenizerFast) -> None:
    sequences = data.text_sequences(tokenizer, SENTENCES[:2], max_length=4)
    assert sequences[0].tolist() == tokenizer(SENTENCES[0])["input_ids"][:4]
    assert [len(sequence) for sequence in sequences] == [4, 4]


def test_collate_right_pads() -> None:
    input_ids, attention_mask = data.collate([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=1)
    assert input_ids.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="at least one"):
        data.collate([], pad_id=0)
    with pytest.raises(ValueError, match="sequence 0"):
        data.collate([torch.zeros(2, 2, dtype=torch.long)], pad_id=0)


# ------------------------------------------------------------------ self-distillation data


def reference_greedy(model: LlamaForCausalLM, ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    output = model.generate(
        ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=1,
    )
    return output[0].tolist()


def test_greedy_matches_model_generate(model, tokenizer) -> None:  # noqa: ANN001
    sequences = data.generate_distillation_data(
        model, tokenizer, PROMPTS, max_new_tokens=6, target_id="tiny"
    )
    prompt_ids = data.tokenize_prompts(tokenizer, PROMPTS)
    assert len(sequences) == len(PROMPTS)
    for ids, sequence in zip(prompt_ids, sequences):
        assert sequence.dtype == torch.long
        assert sequence[: len(ids)].tolist() == ids.tolist()
        assert len(ids) < len(sequence) <= len(ids) + 6
        assert sequence.tolist() == reference_greedy(model, ids, 6)


def test_batched_greedy_equals_unbatched(model, tokenizer, monkeypatch) -> None:  # noqa: ANN001
    prompt_ids = data.tokenize_prompts(tokenizer, PROMPTS)
    # make prompt 0's second new token the eos so that rows finish at different steps and
    # generate pads the finished row; that padding must not reach the output
    eos = reference_greedy(model, prompt_ids[0], 2)[-1]
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    sequences = data.generate_distillation_data(
        model, tokenizer, PROMPTS, max_new_tokens=5, target_id="t", batch_size=3
    )
    expected = [reference_greedy(model, ids, 5) for ids in prompt_ids]
    new_counts = [len(e) - len(ids) for e, ids in zip(expected, prompt_ids)]
    assert expected[0][-1] == eos and new_counts[0] < max(new_counts)
    assert [s.tolist() for s in sequences] == expected


def test_cache_hit_skips_generation(model, tokenizer, tmp_path, monkeypatch, caplog) -> None:  # noqa: ANN001
    kwargs = dict(max_new_tokens=4, target_id="tiny-llama", cache_dir=tmp_path)
    first = data.generate_distillation_data(model, tokenizer, PROMPTS, **kwargs)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".safetensors"
    assert files[0].name.startswith("distill-") and len(files[0].stem) == len("distill-") + 64

    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("generate must not be called on a cache hit")

    monkeypatch.setattr(model, "generate", forbidden)
    with caplog.at_level(logging.INFO, logger="training.data"):
        second = data.generate_distillation_data(model, tokenizer, PROMPTS, **kwargs)
    assert [s.tolist() for s in second] == [s.tolist() for s in first]
    assert any("cache file" in record.getMessage() for record in caplog.records)

    with pytest.raises(AssertionError, match="must not be called"):  # other settings miss
        data.generate_distillation_data(model, tokenizer, PROMPTS[:2], **kwargs)


def test_cache_key_depends_on_settings(model, tokenizer, tmp_path) -> None:  # noqa: ANN001
    common = dict(max_new_tokens=3, cache_dir=tmp_path)
    data.generate_distillation_data(model, tokenizer, PROMPTS[:1], target_id="a", **common)
    data.generate_distillation_data(
        model, tokenizer, PROMPTS[:1], target_id="a", temperature=0.8, **common
    )
    data.generate_distillation_data(model, tokenizer, PROMPTS[:1], target_id="b", **common)
    data.generate_distillation_data(
        model, tokenizer, PROMPTS[:1], target_id="a", temperature=0.8, seed=5, **common
    )
    assert len(list(tmp_path.glob("distill-*.safetensors"))) == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_sampling_reproducible_and_global_rng_untouched(model, tokenizer) -> None:  # noqa: ANN001
    prompts = PROMPTS[:2]
    kwargs = dict(max_new_tokens=8, temperature=1.5, target_id="t")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = data.generate_distillation_data(model, tokenizer, prompts, seed=7, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    second = data.generate_distillation_data(model, tokenizer, prompts, seed=7, **kwargs)
    assert [s.tolist() for s in first] == [s.tolist() for s in second]
    # per-prompt seeds: prompt i of a run with seed s is prompt 0 of a run with seed s + i,
    # and a different seed gives a different sample (8 tokens at temperature 1.5 over 64)
    alone = data.generate_distillation_data(model, tokenizer, prompts[1:], seed=8, **kwargs)
    assert alone[0].tolist() == first[1].tolist()
    shifted = data.generate_distillation_data(model, tokenizer, prompts[:1], seed=8, **kwargs)
    assert shifted[0].tolist() != first[0].tolist()


def test_generation_errors(model, tokenizer) -> None:  # noqa: ANN001
    long_prompt = " ".join(["one"] * 30)
    with pytest.raises(ValueError, match=r"prompt 1 has 30 tokens.*limit of 22.*context_length=32"):
        data.generate_distillation_data(
            model, tokenizer, ["one", long_prompt], max_new_tokens=10, target_id="t"
        )
    truncated = data.generate_distillation_data(
        model, tokenizer, [long_prompt], max_new_tokens=10, target_id="t", truncate=True
    )
    assert truncated[0][:22].tolist() == tokenizer(long_prompt)["input_ids"][-22:]
    with pytest.raises(ValueError, match="max_new_tokens"):
        data.generate_distillation_data(model, tokenizer, PROMPTS, max_new_tokens=40, target_id="t")
    with pytest.raises(ValueError, match="temperature"):
        data.generate_distillation_data(
            model, tokenizer, PROMPTS, max_new_tokens=2, temperature=-1.0, target_id="t"
        )
