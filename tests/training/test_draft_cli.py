"""``selfdraft train --kind draft``: DistillSpec from the command line (a LoRA on the draft, on-policy
data sampled by the draft), the output loaded by ``heads.load_heads``, mistakes refused in one line
before any work, and the same run under ``accelerate launch --cpu --num_processes 2``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import heads
from tests.training.test_cli import REPO, _tokenizer, _write_prompts
from training.cli import main


def save_target_and_draft(toy_target, root: Path) -> None:
    """``root/model``: the target with a tokenizer; ``root/draft``: a random 1-layer copy of its config."""
    toy_target.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    config = copy.deepcopy(toy_target.config)
    config.num_hidden_layers = 1
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(root / "draft")


@pytest.fixture(scope="module")
def dirs(toy_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-cli")
    save_target_and_draft(toy_target, root)
    _write_prompts(root / "prompts.jsonl", 16, seed=5)
    return {"root": root, "model": root / "model", "draft": root / "draft", "data": root / "prompts.jsonl"}


def _args(dirs, out, *extra, steps: int = 6) -> list[str]:
    return ["train", "--model", str(dirs["model"]), "--kind", "draft", "--draft", str(dirs["draft"]), "--data",
            str(dirs["data"]), "--out", str(out), "--steps", str(steps), "--batch-size", "4", "--lr", "5e-3",
            "--warmup-steps", "1", "--max-new-tokens", "12", "--max-length", "20", "--cache-dir",
            str(dirs["root"] / "cache"), "--no-progress", *extra]


def test_train_a_draft_lora_on_policy(dirs, toy_target, tmp_path):
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    assert main(_args(dirs, out, "--lora", "--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--divergence", "jsd",
                      "--jsd-beta", "0.3", "--temperature", "0.8", "--on-policy-ratio", "0.5", "--on-policy-refresh",
                      "3", "--on-policy-prompts", "4", "--eval-prompts", "2", "--eval-max-new-tokens", "8", "--json",
                      str(summary))) == 0
    result = json.loads(summary.read_text())
    assert result["on_policy_refreshes"] == [0, 3] and all(1.0 <= tau <= 5.0 for tau in result["on_policy_tau"])
    config = json.loads((out / "adapter_config.json").read_text())
    recipe = config["training"]["config"]
    assert recipe["draft_lora"] and recipe["lora_r"] == 4 and recipe["jsd_beta"] == 0.3
    assert config["drafter"]["model"]["base"] == str(dirs["draft"].resolve())
    spec = heads.load_heads(toy_target, out)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    expected = toy_target.generate(prompt, max_new_tokens=16, do_sample=False)
    assert torch.equal(spec.generate(prompt, max_new_tokens=16), expected)
    # a second run may write over the first output, its draft folder included
    assert main(_args(dirs, out, steps=2, *("--eval-prompts", "0"))) == 0
    assert sorted(path.name for path in out.iterdir()) == ["adapter_config.json", "draft_model"]


def _changed(args: list[str], flag: str, value: str | None) -> list[str]:
    """``args`` with ``flag`` set to ``value`` (appended when absent; None: the flag and its value removed)."""
    args = list(args)
    if flag in args:
        index = args.index(flag)
        if value is None:
            del args[index:index + 2]
        else:
            args[index + 1] = value
    elif value is not None:
        args += [flag, value]
    return args


@pytest.mark.parametrize("changes, extra, message", [
    ({"--draft": None}, [], "--kind draft needs --draft DIR"),
    ({}, ["--lora-r", "4"], "--lora-r: LoRA option(s); add --lora"),
    ({"--kind": "medusa"}, ["--lora"], "--lora trains a LoRA on a draft model"),
    ({"--kind": "eagle"}, ["--lora-alpha", "8"], "--kind eagle trains no LoRA"),
    ({"--draft": "MISSING"}, [], "no such directory"),
    ({}, ["--jsd-beta", "1"], "--jsd-beta must lie in (0, 1)"),
    ({}, ["--lora", "--lora-targets", "q_projj"], "name no module"),
])
def test_draft_training_refuses_mistakes(dirs, tmp_path, capsys, changes, extra, message):
    args = _args(dirs, tmp_path / "refused", "--eval-prompts", "0", *extra)
    for flag, value in changes.items():
        args = _changed(args, flag, str(tmp_path / value) if value == "MISSING" else value)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("selfdraft train: error:") and message in err, err
    assert not (tmp_path / "refused").exists()


def test_two_process_ddp_matches_one_process(dirs, tmp_path):
    common = ("--on-policy-ratio", "0.5", "--on-policy-refresh", "2", "--on-policy-prompts", "4", "--eval-prompts",
              "0", "--max-new-tokens", "8", "--max-length", "12", "--json")
    assert main(_args(dirs, tmp_path / "one", *common, str(tmp_path / "one.json"), steps=4)) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    launcher = Path(sys.executable).with_name("accelerate")
    command = [str(launcher), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
               "no", "--dynamo_backend", "no", "-m", "training.cli",
               *_args(dirs, tmp_path / "two", *common, str(tmp_path / "two.json"), steps=4)]
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    torch.testing.assert_close(torch.tensor(two["on_policy_tau"]), torch.tensor(one["on_policy_tau"]))
    # the same global batches; sequences of unequal length are averaged per process, so losses agree loosely
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=0.05, atol=0.05)
