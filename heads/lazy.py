"""Lazy public names of a kind's package: its ``KIND`` and the rest of its entry module load with
torch on first use, so ``selfdraft --help`` (which reads only each kind's ``cli``) imports no torch."""

from __future__ import annotations

from types import ModuleType
from typing import Callable


def entry_names(package: str, load_entry: Callable[[], ModuleType]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that looks names up in the module ``load_entry()``
    returns (imported on first use); other names, such as a submodule not imported yet, which the
    import system then imports, are AttributeErrors."""

    def __getattr__(name: str):
        if name == "entry" or name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return getattr(load_entry(), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
