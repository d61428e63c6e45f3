"""The manual's Python examples run as written: every ```python block of README.md and docs/*.md
that starts with its own imports and reads only the repository's shipped targets and adapters is
executed from the repository root (a block that continues an earlier one, or needs a hub model or
a second model the reader supplies, is not standalone and is skipped by that rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def standalone_examples() -> list[tuple[str, str]]:
    examples = []
    for page in PAGES:
        for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            first = block.lstrip().splitlines()[0] if block.strip() else ""
            paths = re.findall(r'"((?:benchmarks)/[^"]+)"', block)
            if first.startswith(("import ", "from ")) and paths and all((ROOT / path).exists() for path in paths):
                examples.append((f"{page.relative_to(ROOT)}[{index}]", block))
    return examples


EXAMPLES = standalone_examples()


def test_the_manual_has_runnable_examples():
    assert len(EXAMPLES) >= 5, [name for name, _ in EXAMPLES]  # README, adapters, eagle, generate, lookup, medusa


@pytest.mark.parametrize("name, code", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_example_runs_as_written(name, code, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(code, name, "exec"), {"__name__": "__example__"})
    capsys.readouterr()
