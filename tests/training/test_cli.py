"""The `selfdraft` command: train and bench end to end on a tiny model directory, and the same
training under `accelerate launch --cpu --num_processes 2` (DDP) giving the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import heads
from tests.conftest import VOCAB, progression_batch
from training.cli import main

REPO = Path(__file__).resolve().parents[2]


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer whose token "t{i}" is id i, matching the toy target's vocabulary."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[PAD]",
                                   bos_token="[BOS]", eos_token="[EOS]")


@pytest.fixture(scope="module")
def model_dir(toy_target, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("toy-model")
    toy_target.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def _write_prompts(path: Path, count: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    lines = [json.dumps({"prompt": " ".join(f"t{int(i)}" for i in progression_batch(1, 5, generator)[0])})
             for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _train_args(model_dir, data, out, cache, summary, steps=6):
    return ["train", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--batch-size", "4", "--lr", "5e-3", "--warmup-steps", "2", "--num-heads", "2", "--max-new-tokens",
            "16", "--max-length", "24", "--cache-dir", str(cache), "--eval-prompts", "2",
            "--eval-max-new-tokens", "12", "--json", str(summary), "--no-progress"]


def test_train_then_bench(model_dir, tmp_path):
    data = _write_prompts(tmp_path / "prompts.jsonl", 24, seed=1)
    adapter = tmp_path / "adapter"
    assert main(_train_args(model_dir, data, adapter, tmp_path / "cache", tmp_path / "train.json", steps=30)) == 0
    summary = json.loads((tmp_path / "train.json").read_text())
    assert summary["losses"][-1] < summary["losses"][0]
    config = json.loads((adapter / "adapter_config.json").read_text())
    greedy, sampled = config["acceptance"]["prompts"]  # the default recipe: measured greedy and at 0.7
    assert config["training"]["divergence"] == "fkl" and greedy["tau"] >= 1.0 and sampled["temperature"] == 0.7
    assert (adapter / "adapter_model.safetensors").is_file()
    assert len(list((tmp_path / "cache").glob("distill-*.safetensors"))) == 1  # Medusa's default: greedy data

    bench_json = tmp_path / "bench.json"
    code = main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--max-new-tokens", "20", "--prompts", "3", "--json", str(bench_json)])
    report = json.loads(bench_json.read_text())
    assert code == 0 and report["identical"] is True
    for key in ("tokens_per_s_plain", "tokens_per_s_spec", "speedup", "tau", "acceptance_by_position",
                "prefix_survival", "conditional_acceptance"):
        assert key in report
    assert report["tau"] > 1.0

    code = main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--max-new-tokens", "12", "--prompts", "2", "--temperature", "0.7", "--json", str(bench_json)])
    report = json.loads(bench_json.read_text())
    assert code == 0 and report["identical"] is None and report["temperature"] == 0.7 and report["tau"] >= 1.0
    assert main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--temperature", "-1"]) == 2


def test_two_process_ddp_matches_one_process(model_dir, tmp_path):
    data = _write_prompts(tmp_path / "prompts.jsonl", 16, seed=2)
    cache = tmp_path / "cache"
    assert main(_train_args(model_dir, data, tmp_path / "one", cache, tmp_path / "one.json")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = Path(sys.executable).with_name("accelerate")
    command = [str(launcher), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "training.cli",
               *_train_args(model_dir, data, tmp_path / "two", cache, tmp_path / "two.json")]
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    one = json.loads((tmp_path / "one.json").read_text())["losses"]
    two = json.loads((tmp_path / "two.json").read_text())["losses"]
    assert len(one) == len(two) == 6
    # same global batch, equal-length sequences: the DDP mean equals the one-process mean up to rounding
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=1e-5)


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--divergence", "--temperature", "--steps", "--original-text", "--data-temperature", "--resume"):
        assert flag in text


def test_missing_data_file(model_dir, tmp_path, capsys):
    assert main(_train_args(model_dir, tmp_path / "nothing.jsonl", tmp_path / "a", tmp_path / "c",
                            tmp_path / "s.json")) == 2
    assert "--data " + str(tmp_path / "nothing.jsonl") + ": no such file" in capsys.readouterr().err


def test_train_flags_come_from_the_registry():
    import argparse

    from heads import kinds
    from training.cli import build_parser
    from training.commands.train import _KindArguments, drafter_options

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    kind = next(action for action in train._actions if action.dest == "kind")
    assert tuple(kind.choices) == kinds.trainable() and "lookup" not in kind.choices
    args = train.parse_args(["--model", "m", "--data", "d", "--out", "o", "--kind", "eagle", "--num-heads", "3"])
    assert drafter_options(args)["num_heads"] == 3  # another kind's flag reaches attach_heads, which refuses it
    # a flag two kinds declare alike is added once, with both helps; declared differently, it is an error
    parser, added = argparse.ArgumentParser(), {}
    _KindArguments(parser, added).add_argument("--num-layers", type=int, default=1, help="blocks per head")
    _KindArguments(parser, added).add_argument("--num-layers", type=int, default=1, help="drafter layers")
    assert added["--num-layers"].help == "blocks per head; drafter layers"
    with pytest.raises(ValueError, match="declare it differently"):
        _KindArguments(parser, added).add_argument("--num-layers", type=int, default=2)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading a model fails the test: the refusals below must come before any expensive work."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    for module in ("train", "bench", "check", "export"):
        monkeypatch.setattr(f"training.commands.{module}.load_model", refuse)


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"selfdraft {command}: error: "), err
    return last


@pytest.mark.parametrize("change, message", [
    ({"--out": "{full}"}, "--out .*already holds other files"),
    ({"--out": "{file}/adapter"}, "--out .*is a file, not a directory"),
    ({"--out": "{file}"}, "--out .*exists and is not a directory"),
    ({"--model": "/nonexistent"}, "--model /nonexistent: no such directory"),
    ({"--max-length": "0"}, "--max-length must be an integer >= 3"),
    ({"--max-new-tokens": "0"}, "--max-new-tokens must be an integer >= 1"),
    ({"--data": "{bad}"}, "--data: .*bad.jsonl line 2: invalid JSON"),
    ({"--json": "{file}/summary.json"}, "--json .*is a file"),
    # issue 15 item 9: counts that used to slice or checkpoint every step
    ({"--checkpoint-every": "-1", "--checkpoint-dir": "{tmp}/ckpt"}, "--checkpoint-every must be an integer >= 0"),
    ({"--checkpoint-every": "2"}, "--checkpoint-every 2 needs --checkpoint-dir"),
    ({"--eval-prompts": "-1"}, "--eval-prompts must be an integer >= 0"),
    ({"--max-prompts": "-1"}, "--max-prompts must be an integer >= 1"),
    ({"--lr": "0"}, "--lr must be a number > 0"),
    ({"--resume": None}, "--resume needs --checkpoint-dir"),
    ({"--resume": None, "--checkpoint-dir": "{tmp}/empty"}, "no checkpoint under"),
    ({"--num-heads": "0"}, "num_heads must be a positive int"),
])
def test_train_refuses_a_mistake_before_any_work(model_dir, tmp_path, capsys, no_model_loading, change, message):
    """Issue 15 items 8 and 9: one line, exit 2, before the model is loaded."""
    import re

    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "t3 t4"}\n{"prompt": \n')
    (tmp_path / "empty").mkdir()
    names = {"full": tmp_path / "full", "file": tmp_path / "a-file", "bad": tmp_path / "bad.jsonl", "tmp": tmp_path}
    args = _train_args(model_dir, data, tmp_path / "adapter", tmp_path / "cache", tmp_path / "s.json")
    for flag, value in change.items():
        value = None if value is None else value.format(**names)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag] if value is None else [flag, value]
    assert main(args) == 2
    assert re.search(message, _one_line_error(capsys, "train"))
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine" and not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("command, extra, message", [
    ("bench", ["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    ("bench", ["--prompts", "0"], "--prompts must be an integer >= 1"),
    ("bench", ["--prompts", "-2"], "--prompts must be an integer >= 1"),
    ("bench", ["--tree", "-1"], "--tree must be an integer >= 0"),
    ("check", ["--prompts", "0"], "--prompts must be an integer >= 1"),
    ("check", ["--max-new-tokens", "-3"], "--max-new-tokens must be an integer >= 1"),
    ("check", ["--threshold", "1.5"], r"--threshold must lie in \[0, 1\)"),
])
def test_bench_and_check_refuse_bad_counts(model_dir, tmp_path, capsys, no_model_loading, command, extra, message):
    """Issue 15 items 8 and 9: bench --max-new-tokens 0 showed transformers' traceback; --prompts 0 / -2 sliced."""
    import re

    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    (tmp_path / "adapter").mkdir()
    assert main([command, "--model", str(model_dir), "--adapter", str(tmp_path / "adapter"), "--data", str(data),
                 *extra]) == 2
    assert re.search(message, _one_line_error(capsys, command))


def test_encode_prompts_refuses_a_limit_below_one():
    from training.evaluate import encode_prompts

    with pytest.raises(ValueError, match="limit must be None or >= 1"):
        encode_prompts(_tokenizer(), ["t3 t4", "t5"], 0)


def test_resume_through_the_command(model_dir, tmp_path, capsys):
    """Issue 15 item 10: a resume with a changed recipe is refused by name before any work; a
    resume of a finished run saves the adapter and exits 0."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 12, seed=4)
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    args = _train_args(model_dir, data, tmp_path / "adapter", tmp_path / "cache", tmp_path / "s.json", steps=4)
    args[args.index("--eval-prompts") + 1] = "0"
    assert main(args + checkpoints) == 0
    first = json.loads((tmp_path / "s.json").read_text())
    changed = list(args)
    changed[changed.index("--lr") + 1] = "1e-2"
    assert main(changed + checkpoints + ["--resume"]) == 2
    assert "another recipe: learning_rate 0.005 (now 0.01)" in _one_line_error(capsys, "train")
    (tmp_path / "adapter" / "adapter_config.json").unlink()
    assert main(args + checkpoints + ["--resume"]) == 0
    assert "(the checkpoint had finished the run: no step trained)" in capsys.readouterr().out
    again = json.loads((tmp_path / "s.json").read_text())
    assert again["losses"] == first["losses"] and again["final_loss"] == first["final_loss"]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_lookup_from_the_command_line(model_dir, tmp_path, capsys):
    """bench the lookup kind with no adapter (and a corpus), train a hybrid and bench it."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 12, seed=3)
    corpus = _write_prompts(tmp_path / "corpus.jsonl", 6, seed=4)
    report_path = tmp_path / "lookup.json"
    assert main(["bench", "--model", str(model_dir), "--lookup", "6", "--lookup-corpus", str(corpus), "--data",
                 str(data), "--max-new-tokens", "12", "--prompts", "2", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["identical"] is True and report["tau"] >= 1.0
    assert main(["bench", "--model", str(model_dir), "--data", str(data)]) == 2
    assert "--lookup N" in capsys.readouterr().err
    adapter = tmp_path / "hybrid"
    assert main(_train_args(model_dir, data, adapter, tmp_path / "cache", tmp_path / "train.json", steps=3)
                + ["--lookup", "4"]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["lookup"]["budget"] == 4
    assert main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--max-new-tokens", "12", "--prompts", "2", "--json", str(report_path)]) == 0
    assert json.loads(report_path.read_text())["identical"] is True
    assert main(_train_args(model_dir, data, tmp_path / "bad", tmp_path / "cache", tmp_path / "t.json")
                + ["--lookup", "0"]) == 2


def test_corpus_of_the_targets_own_outputs(model_dir, toy_target, tmp_path, capsys, monkeypatch):
    """`selfdraft corpus` writes prompt + exactly generate's greedy continuation per prompt, as texts
    `--lookup-corpus` reads; bad arguments are refused before the model loads, and a failed write
    leaves no file behind."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 5, seed=6)
    out = tmp_path / "corpus.jsonl"
    assert main(["corpus", "--model", str(model_dir), "--data", str(data), "--out", str(out),
                 "--prompts", "3", "--max-new-tokens", "10"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and all(set(record) == {"text"} for record in records)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()][:3]
    for prompt, record in zip(prompts, records):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = toy_target.generate(ids, max_new_tokens=10, do_sample=False)
        assert record["text"] == tokenizer.decode(expected[0], skip_special_tokens=True)
    assert main(["bench", "--model", str(model_dir), "--lookup", "6", "--lookup-corpus", str(out), "--data",
                 str(data), "--max-new-tokens", "8", "--prompts", "2"]) == 0
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("training.commands.corpus.load_model", refuse)
    base = ["corpus", "--model", str(model_dir), "--data", str(data)]
    for extra, message in ((["--out", str(out), "--max-new-tokens", "0"], "--max-new-tokens"),
                           (["--out", str(out), "--prompts", "0"], "--prompts"),
                           (["--out", str(tmp_path)], "is a directory")):
        assert main(base + extra) == 2
        assert message in _one_line_error(capsys, "corpus")
    assert main(["corpus", "--model", str(model_dir), "--data", str(tmp_path / "missing.jsonl"), "--out",
                 str(tmp_path / "new.jsonl")]) == 2
    assert not (tmp_path / "new.jsonl").exists()


def test_eagle_resume_with_the_automatic_draft_vocabulary(model_dir, tmp_path, capsys, monkeypatch):
    """``--draft-vocab-size auto`` is resolved against the target before the resume check, so a
    resumed run compares the same drafter; the adapter records the resolved size."""
    from heads import draft_vocab_flags as draft_vocab  # the flag and what auto resolves to

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(draft_vocab, "DRAFT_VOCAB_FROM", 2)  # the toy vocabulary counts as large
    data = _write_prompts(tmp_path / "prompts.jsonl", 12, seed=5)
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    args = _train_args(model_dir, data, tmp_path / "adapter", tmp_path / "cache", tmp_path / "s.json", steps=4)
    at = args.index("--num-heads")
    args[at:at + 2] = ["--kind", "eagle", "--for", "hf"]  # (a 2-layer target's engine default is EAGLE-1: no draft vocabulary)
    args[args.index("--eval-prompts") + 1] = "0"
    assert main(args + checkpoints) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["drafter"]["draft_vocab_size"] == vocab // draft_vocab.DRAFT_VOCAB_SHARE
    assert main(args + checkpoints + ["--resume"]) == 0
    assert "(the checkpoint had finished the run: no step trained)" in capsys.readouterr().out
    assert main(args + checkpoints + ["--resume", "--draft-vocab-size", "full"]) == 2
    assert "draft_vocab_size" in _one_line_error(capsys, "train")


def test_medusa_draft_vocabulary_flag(model_dir, tmp_path, capsys, monkeypatch):
    """``--draft-vocab-size`` (shared with EAGLE) gives Medusa heads a draft vocabulary: ``auto``
    from the target's size, ``full`` or ``--share-lm-head`` the whole vocabulary, a count that
    size; a count with ``--share-lm-head`` is refused before training."""
    from heads import draft_vocab_flags as draft_vocab  # the flag and what auto resolves to

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    data = _write_prompts(tmp_path / "prompts.jsonl", 12, seed=6)

    def trained(name: str, *extra: str):
        args = _train_args(model_dir, data, tmp_path / name, tmp_path / "cache", tmp_path / f"{name}.json", steps=2)
        args[args.index("--eval-prompts") + 1] = "0"
        code = main(args + list(extra))
        if code:
            return code
        return json.loads((tmp_path / name / "adapter_config.json").read_text())["drafter"]["draft_vocab_size"]

    assert trained("default") is None  # a small vocabulary: all of it
    monkeypatch.setattr(draft_vocab, "DRAFT_VOCAB_FROM", 2)  # the toy vocabulary counts as large
    assert trained("auto") == vocab // draft_vocab.DRAFT_VOCAB_SHARE
    assert trained("full", "--draft-vocab-size", "full") is None
    assert trained("shared", "--share-lm-head") is None
    assert trained("count", "--draft-vocab-size", "20") == 20
    capsys.readouterr()
    assert trained("refused", "--draft-vocab-size", "20", "--share-lm-head") == 2
    assert "share_lm_head" in _one_line_error(capsys, "train")
    assert not (tmp_path / "refused").exists()
