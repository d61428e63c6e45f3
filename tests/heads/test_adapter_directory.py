"""The atomic directory writer (heads/adapter/directory.py): the old or the new directory is at the
path at every instant, symbolic links are followed, the umask is honoured, stale staging
directories are cleaned (issue 15 item 3)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import heads
from heads.adapter import AdapterError, directory as writer, write_directory
from tests.conftest import build_model


def _files(version: str) -> dict:
    return {name: (lambda path, name=name: path.write_text(f"{name} {version}\n")) for name in ("a.json", "b.bin")}


def _contents(path: Path) -> set[str]:
    return {entry.read_text() for entry in path.iterdir()}


def _complete(path: Path, *versions: str) -> bool:
    return any(_contents(path) == {f"a.json {v}\n", f"b.bin {v}\n"} for v in versions)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_a_failure_at_any_rename_leaves_the_old_or_the_new_directory(tmp_path, monkeypatch, exchange, failing_call):
    target = tmp_path / "adapter"
    write_directory(target, _files("old"))
    if not exchange:
        monkeypatch.setattr(writer, "exchange", lambda first, second: False)
    calls = []
    real_rename, real_replace = os.rename, os.replace

    def failing(real):
        def call(source, destination, *args, **kwargs):
            calls.append((str(source), str(destination)))
            if len(calls) == failing_call:
                raise OSError("disk failure (injected)")
            return real(source, destination, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "rename", failing(real_rename))
    monkeypatch.setattr(os, "replace", failing(real_replace))
    try:
        write_directory(target, _files("new"))
    except OSError:
        pass
    monkeypatch.undo()
    assert target.is_dir() and _complete(target, "old", "new"), (calls, list(tmp_path.iterdir()))
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # nothing left beside it


def test_the_exchange_is_one_system_call_here(tmp_path):
    """On this machine (Linux, ext4/tmpfs) the swap is the atomic exchange, not two renames."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "f").write_text("1")
    assert writer.exchange(first, second) is True
    assert (second / "f").read_text() == "1" and not (first / "f").exists()


def test_a_symbolic_link_is_followed(tmp_path):
    real, link = tmp_path / "store" / "adapter-v1", tmp_path / "adapter"
    write_directory(real, _files("old"))
    link.symlink_to(real)
    write_directory(link, _files("new"))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert _complete(real, "new") and sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "store"]


def test_a_dangling_or_odd_symbolic_link_is_refused_clearly(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    with pytest.raises(AdapterError, match=r"symbolic link to .*missing, which does not exist"):
        write_directory(tmp_path / "dangling", _files("new"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    with pytest.raises(AdapterError, match="which is not a directory"):
        write_directory(tmp_path / "to-file", _files("new"))
    with pytest.raises(AdapterError, match="is a file, not a directory"):
        write_directory(tmp_path / "file" / "adapter", _files("new"))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_created_directories_honour_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write_directory(tmp_path / "deep" / "adapter", _files("new"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "deep" / "adapter").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "deep").stat().st_mode) == mode


def test_a_replaced_directory_keeps_its_permissions(tmp_path):
    write_directory(tmp_path / "adapter", _files("old"))
    os.chmod(tmp_path / "adapter", 0o750)
    write_directory(tmp_path / "adapter", _files("new"))
    assert stat.S_IMODE((tmp_path / "adapter").stat().st_mode) == 0o750


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_staging_directories_are_cleaned(tmp_path):
    host, dead, alive = writer._host(), _dead_pid(), os.getppid()
    names = {kind: f".adapter.{kind}-{host}-{dead}-0abc" for kind in ("tmp", "old")}
    names["alive"] = f".adapter.tmp-{host}-{alive}-0abc"
    names["other-host"] = f".adapter.tmp-elsewhere{host}-{dead}-0abc"
    names["other-name"] = f".adapterX.tmp-{host}-{dead}-0abc"
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "half-written").write_text("x")
    # the path is missing: a dead writer's backup may be the only copy of the old adapter, so it stays
    assert writer.clean_stale_staging(tmp_path / "adapter") == [tmp_path / names["tmp"]]
    write_directory(tmp_path / "adapter", _files("new"))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["adapter", names["alive"], names["other-host"], names["other-name"]])


def test_save_pretrained_through_a_symlink_and_reload(tmp_path):
    model = build_model("llama", seed=2)
    spec = heads.attach_heads(model, num_heads=2)
    (tmp_path / "real").mkdir()
    (tmp_path / "adapter").symlink_to(tmp_path / "real")
    spec.save_pretrained(tmp_path / "adapter")
    spec.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter").is_symlink()
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert heads.load_heads(model, tmp_path / "adapter").config.num_heads == 2
