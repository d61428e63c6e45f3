"""Whole directories written atomically: adapters, exports, hub folders.

The guarantee of :func:`write_directory`: at every instant the path holds either the complete
old directory or the complete new one, never nothing and never a mix, whether the writer
fails, is killed or the machine stops at any point.

How: the new files are written into a staging directory beside the target
(``.NAME.tmp-HOST-PID-TOKEN``), then the staging directory and the target are **exchanged** in one
``renameat2(RENAME_EXCHANGE)`` (Linux) or ``renamex_np(RENAME_SWAP)`` (macOS) system call, and the
old directory, now at the staging name, is deleted. A first write (no old directory) is a plain
``rename``, atomic everywhere. Where the exchange is not available (another OS, or a filesystem
that refuses it, e.g. some network filesystems) the old directory is renamed aside
(``.NAME.old-HOST-PID-TOKEN``) and the new one renamed into place, which leaves the path empty
between the two renames; a failure of the second rename puts the old directory back, and a
warning says the swap was not atomic.

Other properties:

* a symbolic link at the path is followed: the directory it points to is replaced and the link
  stays; a dangling link is refused with an :class:`AdapterError` naming its target;
* directories are created with the permissions ``0o777 & ~umask`` (``tempfile.mkdtemp`` would
  give 0700); a replaced directory keeps its own permissions; files are made readable like the
  directory: ``0o666 & ~umask`` (safetensors' ``save_file`` creates them 0600), so a published
  adapter or export is readable by whoever can read its folder;
* staging and backup directories left by a writer on this host that no longer runs (checked by
  PID; the host name is part of the name, so writers on other machines sharing the filesystem are
  left alone) are removed by the next write to the same path; a backup is kept until the path
  holds a directory again, since until then it may be the only copy of the old one.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable

from .schema import AdapterError

logger = logging.getLogger(__name__)

_UMASK_LOCK = threading.Lock()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_RENAME_SWAP = 2  # macOS sys/stdio.h
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def current_umask() -> int:
    """The process's umask (read by setting and restoring it, under a lock)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _staging_pattern(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.(tmp|old)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]+$")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def clean_stale_staging(directory: Path) -> list[Path]:
    """Remove the ``.NAME.tmp-*`` / ``.NAME.old-*`` directories beside ``directory`` that a writer
    on this host left when it died (its PID no longer runs); the removed paths. A backup
    (``.old``) is kept while ``directory`` itself is missing."""
    parent, pattern, host = directory.parent, _staging_pattern(directory.name), _host()
    removed = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        match = pattern.match(entry.name)
        if not match or match["host"] != host or int(match["pid"]) == os.getpid():
            continue
        if _process_alive(int(match["pid"])) or entry.is_symlink() or not entry.is_dir():
            continue
        if match.group(1) == "old" and not directory.exists():
            logger.warning("%s is missing and %s holds its previous contents, left by a writer that died; "
                           "keeping it", directory, entry)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        logger.info("removed stale staging directories %s", [path.name for path in removed])
    return removed


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one system call; False when this OS or filesystem cannot (nothing
    changed then). OSError for any other failure (nothing changed either)."""
    libc = _libc()
    if sys.platform.startswith("linux") and libc is not None and hasattr(libc, "renameat2"):
        function = libc.renameat2
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        result = function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and libc is not None and hasattr(libc, "renamex_np"):
        function = libc.renamex_np
        function.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        result = function(os.fsencode(first), os.fsencode(second), _RENAME_SWAP)
    else:
        return False
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def resolve_target(directory: Path) -> Path:
    """The directory a write to ``directory`` replaces: ``directory`` itself, or where a symbolic
    link there points (AdapterError for a dangling link or one to something else than a directory)."""
    if not directory.is_symlink():
        return directory
    target = Path(os.path.realpath(directory))
    if not target.exists():
        raise AdapterError(f"{directory} is a symbolic link to {os.readlink(directory)}, which does not exist: "
                           "create that directory or remove the link")
    if not target.is_dir():
        raise AdapterError(f"{directory} is a symbolic link to {target}, which is not a directory")
    return target


def _swap_into_place(staging: Path, target: Path) -> None:
    """Put ``staging`` at ``target``, replacing a directory there (see the module docstring)."""
    if not target.exists():
        os.rename(staging, target)  # fails rather than replace a directory created meanwhile
        return
    if exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # the old directory, now at the staging name
        return
    logger.warning("%s: this filesystem cannot exchange two directories atomically; replacing it by two renames",
                   target)
    backup = staging.with_name(staging.name.replace(".tmp-", ".old-", 1))
    os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _readable_files(root: Path, mode: int) -> None:
    """Give every regular file under ``root`` (links left alone) the permissions ``mode``; folders
    a writer created inside get ``mode`` plus the search bits its read bits call for."""
    for folder, subfolders, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, mode)
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, mode | ((mode & 0o444) >> 2))


def write_directory(directory: Path, files: dict[str, Callable[[Path], None]],
                    replaceable: Iterable[str] = ()) -> None:
    """Write ``directory`` atomically: each ``files[name](path)`` writes one file into a staging
    directory beside it, which then takes its place (the guarantee is in the module docstring).

    An existing ``directory`` is replaced only when it holds nothing but names in ``files`` or
    ``replaceable`` (a previous write of the same kind); otherwise :class:`AdapterError`, so a
    mistyped output path never deletes unrelated files. A symbolic link is followed.
    """
    directory = Path(directory)
    target = resolve_target(directory)
    mode = None
    if target.exists():
        if not target.is_dir():
            raise AdapterError(f"{directory} exists and is not a directory")
        foreign = sorted(p.name for p in target.iterdir() if p.name not in set(files) | set(replaceable))
        if foreign:
            raise AdapterError(f"{directory} already holds other files ({', '.join(foreign[:5])}); "
                               "write into a new or empty directory")
        mode = stat.S_IMODE(target.stat().st_mode)
    parent = target.parent
    for ancestor in (parent, *parent.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise AdapterError(f"cannot write {directory}: {ancestor} is a file, not a directory")
            break
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(target)
    staging = parent / f".{target.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir(mode=0o700)
    try:
        os.chmod(staging, mode if mode is not None else 0o777 & ~current_umask())
        for name, write in files.items():
            write(staging / name)
        _readable_files(staging, 0o666 & ~current_umask())
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    clean_stale_staging(target)  # a dead writer's backup is obsolete once the new directory is in place
