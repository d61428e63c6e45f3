"""Tests for training/prompts.py: prompt files, chat rendering and tokenization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from training import prompts
from training.prompts import DataFormatError

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


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, records: list[object]) -> Path:
    return write(path, [json.dumps(record) for record in records])


# ------------------------------------------------------------------ load_prompts


def test_prompt_and_text_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "first"}, {"text": "second\nline"}])
    assert prompts.load_prompts(path) == ["first", "second\nline"]


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
    assert prompts.load_prompts(path) == ["System: Be brief.\nUser: What is 2+2?\nAssistant:"]


def test_openai_messages(tmp_path: Path) -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    assert prompts.load_prompts(path) == ["User: Hi\nAssistant:"]


def test_chat_template_used_when_tokenizer_has_one(tmp_path: Path) -> None:
    class TemplateTokenizer:
        chat_template = "some template"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # noqa: ANN001
            assert add_generation_prompt is True and tokenize is False
            return "|".join(f"{m['role']}={m['content']}" for m in messages) + "|assistant="

    record = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record, {"prompt": "plain"}])
    assert prompts.load_prompts(path, tokenizer=TemplateTokenizer()) == ["user=Q|assistant=", "plain"]


def test_real_chat_template(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    templated = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    templated.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    record = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    assert prompts.load_prompts(path, tokenizer=templated) == ["<system>S<user>U<assistant>"]
    # a tokenizer without a template falls back to the plain rendering
    assert prompts.load_prompts(path, tokenizer=tokenizer) == ["System: S\nUser: U\nAssistant:"]


@pytest.mark.parametrize("name", ["prompts.txt", "prompts", "prompts.md"])
def test_plain_text_paragraphs(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\nfirst para\nstill first\n\n  \n\nsecond\n\n\nthird\n", encoding="utf-8")
    assert prompts.load_prompts(path, paragraphs=True) == ["first para\nstill first", "second", "third"]


@pytest.mark.parametrize("name", ["prompts.txt", "prompts", "prompts.md"])
def test_plain_text_is_one_prompt_per_line(tmp_path: Path, name: str, caplog) -> None:
    """Issue 36 item 5: 76 lines in blank-line-separated groups became 9 prompts without a word."""
    path = tmp_path / name
    lines = [f"prompt number {index}" for index in range(76)]
    groups = ["\n".join(lines[start:start + 9]) for start in range(0, 76, 9)]
    path.write_text("\n\n".join(groups) + "\n", encoding="utf-8")
    with caplog.at_level("INFO", logger=prompts.logger.name):
        assert prompts.load_prompts(path) == lines
    assert f"read 76 prompts from {path} (plain text: one prompt per line" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger=prompts.logger.name):
        assert len(prompts.load_prompts(path, paragraphs=True)) == 9
    assert "read 9 prompts" in caplog.text and "one prompt per blank-line-separated paragraph" in caplog.text
    (tmp_path / "crlf.txt").write_bytes(b"  one \r\ntwo\r\n\r\n")
    assert prompts.load_prompts(tmp_path / "crlf.txt") == ["one", "two"]


def test_hold_out_is_seeded_and_keeps_file_order() -> None:
    texts = [str(index) for index in range(10)]
    kept, held = prompts.hold_out(texts, 3, seed=5)
    assert len(held) == 3 and sorted(kept + held, key=int) == texts
    assert kept == sorted(kept, key=int) and held == sorted(held, key=int)
    assert prompts.hold_out(texts, 3, seed=5) == (kept, held) and prompts.hold_out(texts, 0, seed=5) == (texts, [])
    with pytest.raises(ValueError, match="count must lie in 0..10"):
        prompts.hold_out(texts, 11, seed=0)


def test_json_array_file(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    records = [{"conversations": [{"from": "human", "value": "hey"}]}, {"prompt": "p"}]
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    assert prompts.load_prompts(path) == ["User: hey\nAssistant:", "p"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "ok"}, {"nope": 1}]), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.json record 2: missing key"):
        prompts.load_prompts(bad)


def test_json_file_of_json_lines(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    assert prompts.load_prompts(path) == ["a", "b"]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.jsonl", ['{"prompt": "ok"}', "", '{"prompt": "x"', "{}"])
    with pytest.raises(DataFormatError, match=r"broken\.jsonl line 3: invalid JSON") as info:
        prompts.load_prompts(path)
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
        prompts.load_prompts(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt", "empty.json"])
def test_empty_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="no prompts") as info:
        prompts.load_prompts(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        prompts.load_prompts(path)


# ------------------------------------------------------------------ tokenization


def test_tokenize_prompts(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = prompts.tokenize_prompts(tokenizer, PROMPTS, max_prompt_tokens=8, context_length=32)
    assert [sequence.tolist() for sequence in ids] == [
        tokenizer(prompt)["input_ids"] for prompt in PROMPTS
    ]
    assert all(sequence.dtype == torch.long and sequence.dim() == 1 for sequence in ids)


def test_prompt_too_long_names_index_and_lengths(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens.*limit of 4.*context_length=4"):
        prompts.tokenize_prompts(tokenizer, PROMPTS, context_length=4)
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens.*max_prompt_tokens=3"):
        prompts.tokenize_prompts(tokenizer, PROMPTS, max_prompt_tokens=3, context_length=32)
    truncated = prompts.tokenize_prompts(tokenizer, PROMPTS, context_length=2, truncate=True)
    assert truncated[1].tolist() == tokenizer(PROMPTS[1])["input_ids"][-2:]
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        prompts.tokenize_prompts(tokenizer, [""])


def test_text_sequences(tokenizer: PreTrainedTokenizerFast) -> None:
    sequences = prompts.text_sequences(tokenizer, SENTENCES[:2], max_length=4)
    assert sequences[0].tolist() == tokenizer(SENTENCES[0])["input_ids"][:4]
    assert [len(sequence) for sequence in sequences] == [4, 4]


def test_a_chat_template_bos_is_not_doubled(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """Issue 15 item 11: a template that writes ``bos_token`` and a tokenizer that adds BOS gave two."""
    from tokenizers import processors

    from training.evaluate import encode_prompts

    templated = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
                                        unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]")
    bos = templated.bos_token_id
    templated.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", bos)])
    templated.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert templated("the cat")["input_ids"][0] == bos  # the tokenizer adds a BOS
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "the cat sat"}]}) + "\n"
                    + json.dumps({"prompt": "the cat sat"}) + "\n")
    chat, plain = prompts.load_prompts(path, templated)
    assert chat.startswith("[BOS]")
    for ids in prompts.tokenize_prompts(templated, [chat, plain]) + [row[0] for row in encode_prompts(
            templated, [chat, plain])] + prompts.text_sequences(templated, [chat, plain], 16):
        assert ids[0] == bos and ids[1] != bos, ids
    assert torch.equal(prompts.tokenize_prompts(templated, [chat])[0], prompts.tokenize_prompts(templated, [plain])[0])
