"""`selfdraft check`, `export` and `push` end to end on the toy target: check passes on the
unchanged target and fails after a few fine-tuning steps change it; export writes other layouts
and a hub folder with a model card; push fails with a clear message without a token or network."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from huggingface_hub import constants as hub_constants

import heads
from tests.conftest import VOCAB
from tests.training.test_cli import _tokenizer, _write_prompts
from training.cli import main


@pytest.fixture(scope="module")
def workspace(toy_target, tmp_path_factory) -> dict[str, Path]:
    """The toy target's model directory and a Medusa adapter trained on it with the acceptance on
    held-out prompts recorded at save time."""
    root = tmp_path_factory.mktemp("check")
    toy_target.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    data = _write_prompts(root / "prompts.jsonl", 24, seed=1)
    heldout = _write_prompts(root / "heldout.jsonl", 6, seed=2)
    code = main(["train", "--model", str(root / "model"), "--data", str(data), "--out", str(root / "adapter"),
                 "--steps", "60", "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "5", "--num-heads", "3",
                 "--max-new-tokens", "24", "--max-length", "32", "--cache-dir", str(root / "cache"),
                 "--eval-data", str(heldout), "--eval-prompts", "4", "--eval-max-new-tokens", "24", "--no-progress"])
    assert code == 0
    return {"root": root, "model": root / "model", "adapter": root / "adapter", "heldout": heldout}


def workspace_model(workspace):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(workspace["model"]).eval()


def _fine_tuned_copy(model_dir: Path, out: Path, steps: int = 20) -> Path:
    """The target after a few AdamW steps on progressions of stride 4-6 (a new domain)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, VOCAB - 3, (32, 1), generator=generator)
        strides = torch.randint(4, 7, (32, 1), generator=generator)
        batch = 3 + (starts + strides * torch.arange(24)) % (VOCAB - 3)
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return out


def _check(workspace, model_dir: Path, report: Path) -> tuple[int, dict]:
    code = main(["check", "--model", str(model_dir), "--adapter", str(workspace["adapter"]),
                 "--data", str(workspace["heldout"]), "--json", str(report)])
    return code, json.loads(report.read_text())


def test_train_records_the_acceptance_check_compares_with(workspace):
    config = json.loads((workspace["adapter"] / "adapter_config.json").read_text())
    entry, sampled = config["acceptance"]["heldout"]  # the default recipe: measured greedy and at 0.7
    assert sampled["temperature"] == 0.7 and config["training"]["serving"] == "any"
    assert entry["tau"] > 1.5 and entry["prompts"] == 4 and entry["max_new_tokens"] == 24
    assert "revision" in config["target"] and config["training"]["steps"] == 60


def test_check_passes_on_the_unchanged_target(workspace, tmp_path, capsys):
    code, report = _check(workspace, workspace["model"], tmp_path / "check.json")
    out = capsys.readouterr().out
    assert code == 0 and report["passed"] and report["target_matches"], out
    assert report["mix"] == "heldout" and report["tau_drop"] == pytest.approx(0.0)  # same prompts, greedy
    assert "matches" in out and "PASS" in out


def test_check_fails_when_the_target_changed(workspace, tmp_path, capsys):
    changed = _fine_tuned_copy(workspace["model"], tmp_path / "fine-tuned")
    with pytest.warns(UserWarning, match="trained on another target"):
        code, report = _check(workspace, changed, tmp_path / "check.json")
    out = capsys.readouterr().out
    assert code == 1 and not report["passed"] and not report["target_matches"]
    assert report["tau_drop"] > 0.1 and report["measured"]["identical"]  # slower, still exact
    assert "differs: weights" in out and "FAIL: tau fell by" in out


def test_check_without_recorded_acceptance(workspace, tmp_path, capsys):
    spec = heads.load_heads(workspace_model(workspace), workspace["adapter"])
    spec.save_pretrained(tmp_path / "bare", acceptance={})
    code = main(["check", "--model", str(workspace["model"]), "--adapter", str(tmp_path / "bare"),
                 "--data", str(workspace["heldout"]), "--prompts", "2", "--max-new-tokens", "8"])
    assert code == 2 and "nothing to compare with" in capsys.readouterr().out


def test_export_command(workspace, tmp_path, capsys):
    out = tmp_path / "vllm"
    assert main(["export", "--adapter", str(workspace["adapter"]), "--format", "medusa-vllm", "--out", str(out)]) == 0
    assert "config.json" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MedusaModel"]
    capsys.readouterr()
    assert main(["export", "--adapter", str(workspace["adapter"]), "--format", "eagle3", "--out", str(tmp_path / "e")]) == 2
    assert re.search("selfdraft export: error: .*holds eagle drafters", capsys.readouterr().err)
    assert main(["export", "--adapter", str(workspace["adapter"]), "--format", "medusa"]) == 2
    assert "selfdraft export: error: --format needs --out" in capsys.readouterr().err


def test_export_prints_and_writes_the_serving_commands(workspace, tmp_path, capsys):
    out = tmp_path / "vllm"
    assert main(["export", "--adapter", str(workspace["adapter"]), "--format", "medusa-vllm", "--out", str(out),
                 "--verifier", "owner/toy", "--num-speculative-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("vllm serve"))
    words = shlex.split(command)
    assert words[:3] == ["vllm", "serve", "owner/toy"]
    assert json.loads(words[words.index("--speculative-config") + 1]) == {
        "method": "medusa", "model": str(out), "num_speculative_tokens": 2}
    assert "SGLang" in printed and command in (out / "README.md").read_text()


@pytest.mark.parametrize("arguments, message", [
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be an integer >= 1"),
    (["--no-fc-bias"], "--no-fc-bias applies to --format eagle"),
])
def test_export_flags_are_checked(workspace, tmp_path, capsys, arguments, message):
    code = main(["export", "--adapter", str(workspace["adapter"]), "--format", "medusa-vllm", "--out",
                 str(tmp_path / "out"), *arguments])
    assert code == 2 and message in capsys.readouterr().err


def test_export_refuses_a_kind_mismatch_before_loading_the_model(workspace, tmp_path, capsys, monkeypatch):
    from training.commands import export

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr(export, "load_model", no_loading)
    code = main(["export", "--adapter", str(workspace["adapter"]), "--format", "eagle", "--model",
                 str(workspace["model"]), "--out", str(tmp_path / "out")])
    assert code == 2 and "format 'eagle' holds eagle drafters; this adapter is kind 'medusa'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hub_folder_and_model_card(workspace, tmp_path):
    hub = tmp_path / "hub"
    assert main(["export", "--adapter", str(workspace["adapter"]), "--hub-dir", str(hub), "--repo-id", "me/toy-medusa",
                 "--license", "apache-2.0"]) == 0
    assert sorted(p.name for p in hub.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = (hub / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "apache-2.0" and front["library_name"] == "selfdraft"
    assert "speculative-decoding" in front["tags"] and "base_model" not in front  # a local path is no hub id
    config = json.loads((hub / "adapter_config.json").read_text())
    greedy, sampled = config["acceptance"]["heldout"]
    assert f"| heldout | greedy | {greedy['tau']:.3g} |" in card and f"| heldout | 0.7 | {sampled['tau']:.3g} |" in card
    assert config["target"]["weights_sha256"] in card and '"fkl"' in card
    assert "spec = heads.load_heads(model, snapshot_download('me/toy-medusa'))" in card
    loaded = heads.load_heads(workspace_model(workspace), hub)  # the hub folder is itself an adapter
    assert loaded.config.num_heads == 3
    card_data = ModelCard.load(hub / "README.md").data  # huggingface_hub's own parser reads the metadata
    assert card_data.library_name == "selfdraft" and card_data.license == "apache-2.0"


def _snippet(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("repo_id", [None, "me/toy-medusa"])
def test_model_card_snippet_runs_as_written(workspace, tmp_path, monkeypatch, capsys, repo_id):
    import huggingface_hub

    hub = tmp_path / "hub"
    assert main(["export", "--adapter", str(workspace["adapter"]), "--hub-dir", str(hub),
                 *(["--repo-id", repo_id] if repo_id else [])]) == 0
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kwargs: str(hub))  # no network here
    capsys.readouterr()
    exec(compile(_snippet((hub / "README.md").read_text()), "model card", "exec"), {})
    assert capsys.readouterr().out.strip()  # the decoded generation


def test_published_files_are_readable_like_their_folder(workspace, tmp_path):
    previous = os.umask(0o022)
    try:
        main(["export", "--adapter", str(workspace["adapter"]), "--hub-dir", str(tmp_path / "hub")])
        main(["export", "--adapter", str(workspace["adapter"]), "--format", "medusa-vllm", "--out",
              str(tmp_path / "vllm")])
    finally:
        os.umask(previous)
    for folder in (tmp_path / "hub", tmp_path / "vllm"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        for path in folder.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def _no_token(monkeypatch, tmp_path) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


def test_push_needs_a_token(workspace, tmp_path, monkeypatch):
    _no_token(monkeypatch, tmp_path)
    main(["export", "--adapter", str(workspace["adapter"]), "--hub-dir", str(tmp_path / "hub")])
    with pytest.raises(SystemExit, match="selfdraft push: no Hugging Face token: run `hf auth login` or set HF_TOKEN"):
        main(["push", "--hub-dir", str(tmp_path / "hub"), "--repo-id", "me/toy-medusa"])


def test_push_needs_a_network(workspace, tmp_path, monkeypatch):
    _no_token(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    main(["export", "--adapter", str(workspace["adapter"]), "--hub-dir", str(tmp_path / "hub")])
    with pytest.raises(SystemExit, match=r"selfdraft push: no network: cannot reach the hub at http://127.0.0.1:9"):
        main(["push", "--hub-dir", str(tmp_path / "hub"), "--repo-id", "me/toy-medusa"])


def test_push_refuses_a_folder_that_is_not_a_hub_folder(tmp_path):
    with pytest.raises(SystemExit, match=r"lacks \['adapter_config.json', 'adapter_model.safetensors', 'README.md'\]"):
        main(["push", "--hub-dir", str(tmp_path), "--repo-id", "me/x"])
