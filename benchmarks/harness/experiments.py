"""Experiments as data: ``benchmarks/experiments/<name>.json``, each a small JSON object:

- ``question``: what the experiment answers (one sentence);
- ``targets``: ``{target: {"mixes": [mix, ...], "methods": [method, ...]}}`` (methods as
  :mod:`.methods` writes them; ``generate``, the baseline, is added first when not listed);
- ``temperatures`` (0: greedy), ``batches`` (rows per ``generate`` call), ``prompts`` (per mix and
  cell, from the ``split``), ``max_new_tokens``, ``repeats`` (timed runs per batch, the fastest
  counting), ``split`` (``tuning`` or ``check``);
- ``quick``: the settings ``--quick`` replaces (fewer prompts and tokens).

Every cell (target x mix x temperature x batch size) runs all of the target's methods on the same
batches of prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .methods import Method, parse_method
from .prompts import SPLITS, TARGETS, BenchmarkError, mix_prompts

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
SETTINGS = ("temperatures", "batches", "prompts", "max_new_tokens", "repeats", "split")
KEYS = {"question", "targets", "quick", *SETTINGS}


@dataclass
class Experiment:
    name: str
    question: str
    targets: dict[str, dict]  # target -> {"mixes": [...], "methods": [Method, ...]}
    temperatures: list[float]
    batches: list[int]
    prompts: int
    max_new_tokens: int
    repeats: int = 1
    split: str = "check"
    quick: dict = field(default_factory=dict)

    def settings(self) -> dict:
        """What was run, as JSON: the methods by the names they were given."""
        targets = {target: {"mixes": list(entry["mixes"]), "methods": [m.name for m in entry["methods"]]}
                   for target, entry in self.targets.items()}
        return {"question": self.question, "targets": targets,
                **{key: getattr(self, key) for key in SETTINGS}}


def names(directory: Path = EXPERIMENTS) -> list[str]:
    return sorted(path.stem for path in directory.glob("*.json"))


def load(name: str, directory: Path = EXPERIMENTS) -> Experiment:
    """The experiment ``name`` with its methods parsed (so a missing adapter is named here, before
    any model loads); an unknown name, key or value is a :class:`BenchmarkError`."""
    path = directory / f"{name}.json"
    if not path.is_file():
        raise BenchmarkError(f"unknown experiment {name!r}: expected one of {', '.join(names(directory))} "
                             f"(files in {directory})")
    data = json.loads(path.read_text())
    unknown = set(data) - KEYS
    if unknown:
        raise BenchmarkError(f"{path.name}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
    missing = {"question", "targets", "temperatures", "batches", "prompts", "max_new_tokens"} - set(data)
    if missing:
        raise BenchmarkError(f"{path.name}: missing keys {sorted(missing)}")
    if set(data.get("quick", {})) - set(SETTINGS):
        raise BenchmarkError(f"{path.name}: quick may set only {', '.join(SETTINGS)}")
    targets = {}
    for target, entry in data["targets"].items():
        if target not in TARGETS:
            raise BenchmarkError(f"{path.name}: unknown target {target!r} (targets: {', '.join(TARGETS)})")
        for mix in entry["mixes"]:
            if mix not in TARGETS[target]["mixes"]:
                raise BenchmarkError(f"{path.name}: {target} has no mix {mix!r} "
                                     f"(its mixes: {', '.join(TARGETS[target]['mixes'])})")
        targets[target] = {"mixes": list(entry["mixes"]), "methods": _methods(entry["methods"])}
    experiment = Experiment(name, data["question"], targets, **{key: data[key] for key in SETTINGS if key in data},
                            quick=data.get("quick", {}))
    check(experiment)
    return experiment


def _methods(written: list[str]) -> list[Method]:
    methods = [parse_method(name) for name in written]
    if len({m.name for m in methods}) != len(methods):
        raise BenchmarkError(f"methods named twice in {written}")
    if "generate" not in {m.name for m in methods}:
        methods.insert(0, parse_method("generate"))
    return methods


def select(experiment: Experiment, quick: bool = False, targets: list[str] | None = None,
           mixes: list[str] | None = None, methods: list[str] | None = None, **settings) -> Experiment:
    """``experiment`` with its ``quick`` block applied (``quick``), restricted to ``targets`` and
    ``mixes``, with ``methods`` replacing each target's own, then ``settings`` (None: kept)."""
    if quick:
        experiment = replace(experiment, **experiment.quick)
    chosen = dict(experiment.targets)
    for target in targets or ():
        if target not in chosen:
            raise BenchmarkError(f"--target {target}: experiment {experiment.name!r} runs {', '.join(chosen)}")
    if targets:
        chosen = {target: chosen[target] for target in targets}
    if mixes:
        present = {mix for entry in chosen.values() for mix in entry["mixes"]}
        for mix in mixes:
            if mix not in present:
                raise BenchmarkError(f"--mix {mix}: the chosen targets run {', '.join(sorted(present))}")
        chosen = {target: {**entry, "mixes": [m for m in entry["mixes"] if m in mixes]}
                  for target, entry in chosen.items()}
        chosen = {target: entry for target, entry in chosen.items() if entry["mixes"]}
    if methods:
        chosen = {target: {**entry, "methods": _methods(methods)} for target, entry in chosen.items()}
    experiment = replace(experiment, targets=chosen,
                         **{key: value for key, value in settings.items() if value is not None})
    check(experiment)
    return experiment


def check(experiment: Experiment) -> None:
    """Refuse settings no run can satisfy, by name."""
    where = f"experiment {experiment.name!r}"
    for key in ("prompts", "max_new_tokens", "repeats"):
        value = getattr(experiment, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BenchmarkError(f"{where}: {key} must be a whole number >= 1; got {value!r}")
    batches = experiment.batches
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise BenchmarkError(f"{where}: batches must be whole numbers >= 1; got {experiment.batches!r}")
    if not experiment.temperatures or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0
                                          for t in experiment.temperatures):
        raise BenchmarkError(f"{where}: temperatures must be numbers >= 0 (0: greedy); got {experiment.temperatures!r}")
    if experiment.split not in SPLITS:
        raise BenchmarkError(f"{where}: split must be one of {', '.join(SPLITS)}; got {experiment.split!r}")
    if experiment.prompts < max(experiment.batches):
        raise BenchmarkError(f"{where}: {experiment.prompts} prompts make no batch of {max(experiment.batches)}")
    if not experiment.targets:
        raise BenchmarkError(f"{where}: no target left to run")
    for target, entry in experiment.targets.items():
        for mix in entry["mixes"]:
            mix_prompts(mix, experiment.split, experiment.prompts)  # enough prompts in the split, else named
        peers = [m.name for m in entry["methods"] if m.base in ("prompt_lookup", "assisted")]
        if peers and max(experiment.batches) > 1:
            raise BenchmarkError(f"{where}: {', '.join(peers)} run at batch size 1 only (transformers' assisted "
                                 f"generation); batches {experiment.batches}")
