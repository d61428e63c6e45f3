"""``selfdraft select`` on a tiny model: every kind of candidate ranked against plain generation,
with the bound's terms; argument mistakes refused in one line before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import heads
from tests.training.test_cli import _write_prompts
from tests.training.test_draft_cli import save_target_and_draft
from training.cli import main


@pytest.fixture(scope="module")
def dirs(toy_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("select")
    save_target_and_draft(toy_target, root)
    # the target as its own draft, saved as a draft adapter: every drafted token is accepted (11 = 1 + 2 x 5)
    heads.attach_heads(toy_target, kind="draft", draft_model=toy_target, depth=4, total_tokens=4,
                       adaptive=False).save_pretrained(root / "self-draft")
    _write_prompts(root / "prompts.jsonl", 6, seed=4)
    return {name: root / name for name in ("model", "draft", "self-draft", "prompts.jsonl")} | {"root": root}


def test_select_ranks_every_candidate(dirs, tmp_path, capsys):
    out = tmp_path / "select.json"
    code = main(["select", "--model", str(dirs["model"]), "--data", str(dirs["prompts.jsonl"]),
                 "--adapter", str(dirs["self-draft"]), "--draft", str(dirs["draft"]), "--lookup", "4",
                 "--prompts", "4", "--batch-size", "2", "--max-new-tokens", "11", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "bound" in printed and "model.generate" in printed
    report = json.loads(out.read_text())
    names = [entry["name"] for entry in report["ranking"]]
    assert sorted(names) == ["draft:draft", "lookup:4", "self-draft"]
    speedups = [entry["speedup"] for entry in report["ranking"]]
    assert speedups == sorted(speedups, reverse=True) and report["best"] == names[0]
    by_name = {entry["name"]: entry for entry in report["ranking"]}
    assert by_name["self-draft"]["tau"] > 3.5 and by_name["self-draft"]["acceptance_by_position"][0] == 1.0
    assert by_name["self-draft"]["tau"] > by_name["draft:draft"]["tau"]
    for entry in report["ranking"]:
        assert entry["identical"] is True and entry["draft_ms_per_step"] >= 0 and entry["verify_ms_per_step"] > 0
        assert entry["bound"] > 0
    assert report["batch_size"] == 2 and report["plain"]["step_ms"] > 0


def test_select_samples_at_the_serving_temperature(dirs, tmp_path):
    out = tmp_path / "select.json"
    assert main(["select", "--model", str(dirs["model"]), "--data", str(dirs["prompts.jsonl"]), "--draft",
                 str(dirs["draft"]), "--prompts", "2", "--max-new-tokens", "8", "--temperature", "0.8",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["temperature"] == 0.8 and "identical" not in report["ranking"][0]


@pytest.mark.parametrize("change, message", [
    ([], "give at least one candidate"),
    (["--lookup", "0"], "--lookup must be an integer >= 1"),
    (["--lookup", "2", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--lookup", "2", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--draft", "MISSING"], "MISSING: no such directory"),
    (["--adapter", "MISSING"], "MISSING: no such directory"),
    (["--lookup", "2", "--json", "ROOT"], "is a directory"),
])
def test_select_refuses_mistakes_in_one_line(dirs, capsys, monkeypatch, change, message):
    import training.commands.select as select

    monkeypatch.setattr(select, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    change = [str(dirs["root"]) if item == "ROOT" else str(dirs["root"] / item) if item == "MISSING" else item
              for item in change]
    code = main(["select", "--model", str(dirs["model"]), "--data", str(dirs["prompts.jsonl"]), *change])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("selfdraft select: error:")
    assert message in err, err


def test_select_refuses_a_bad_adapter(dirs, tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/adapter_config.json").write_text("{not json")
    code = main(["select", "--model", str(dirs["model"]), "--data", str(dirs["prompts.jsonl"]),
                 "--adapter", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not valid JSON" in err and len(err.splitlines()) == 1  # before the model is loaded
