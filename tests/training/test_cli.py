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
    assert config["training"]["divergence"] == "fkl" and config["acceptance"]["prompts"]["tau"] >= 1.0
    assert (adapter / "adapter_model.safetensors").is_file()
    assert len(list((tmp_path / "cache").glob("distill-*.safetensors"))) == 1

    bench_json = tmp_path / "bench.json"
    code = main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--max-new-tokens", "20", "--prompts", "3", "--json", str(bench_json)])
    report = json.loads(bench_json.read_text())
    assert code == 0 and report["identical"] is True
    for key in ("tokens_per_s_plain", "tokens_per_s_spec", "speedup", "tau", "acceptance_by_position"):
        assert key in report
    assert report["tau"] > 1.0

    code = main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
                 "--max-new-tokens", "12", "--prompts", "2", "--temperature", "0.7", "--json", str(bench_json)])
    report = json.loads(bench_json.read_text())
    assert code == 0 and report["identical"] is None and report["temperature"] == 0.7 and report["tau"] >= 1.0
    with pytest.raises(SystemExit, match="--temperature must be >= 0"):
        main(["bench", "--model", str(model_dir), "--adapter", str(adapter), "--data", str(data),
              "--temperature", "-1"])


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


def test_missing_data_file(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        main(_train_args(model_dir, tmp_path / "nothing.jsonl", tmp_path / "a", tmp_path / "c", tmp_path / "s.json"))


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
