"""Distillation data is cached under the user's cache directory, not the current one (issue 36,
item 6): ``$SELFDRAFT_CACHE/distill``, else ``$XDG_CACHE_HOME/selfdraft/distill``, else
``~/.cache/selfdraft/distill``; ``--cache-dir`` still chooses the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.test_cli import _tokenizer, _write_prompts
from training import distill_data
from training.cli import main


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "mine"))
    assert distill_data.default_cache_dir() == tmp_path / "mine" / "distill"
    monkeypatch.delenv("SELFDRAFT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert distill_data.default_cache_dir() == tmp_path / "xdg" / "selfdraft" / "distill"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert distill_data.default_cache_dir() == tmp_path / "home" / ".cache" / "selfdraft" / "distill"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("given", [False, True])
def test_train_caches_under_the_user_cache(toy_target, tmp_path, monkeypatch, given):
    model = tmp_path / "model"
    toy_target.save_pretrained(model)
    _tokenizer().save_pretrained(model)
    data = _write_prompts(tmp_path / "prompts.jsonl", 8, seed=1)
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "user-cache"))
    monkeypatch.chdir(tmp_path)
    seen = {}

    def record(*args, cache_dir=None, **kwargs):
        seen["cache_dir"] = Path(cache_dir)
        raise _Stop
    monkeypatch.setattr(distill_data, "generate_distillation_data", record)
    with pytest.raises(_Stop):
        main(["train", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "adapter"), "--steps", "1",
              "--num-heads", "2", "--max-new-tokens", "8", "--max-length", "16", "--no-progress",
              *(["--cache-dir", str(tmp_path / "chosen")] if given else [])])
    assert seen["cache_dir"] == (tmp_path / "chosen" if given else tmp_path / "user-cache" / "distill")
    assert not (tmp_path / ".selfdraft-cache").exists()
