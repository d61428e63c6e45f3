"""Single files written atomically: a temporary file in the same folder, then ``os.replace``, so a
reader sees the old file or the new one, never half of one. (Whole directories: the adapter
format's :func:`heads.adapter.write_directory`.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``write(temporary)`` writes the content; the temporary file then replaces ``path``
    (parents created). On any error the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one writer per process; umask modes
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, payload: object) -> Path:
    """``payload`` as indented JSON with a final newline, written atomically."""
    text = json.dumps(payload, indent=2) + "\n"
    return write_file_atomically(path, lambda temporary: temporary.write_text(text))
