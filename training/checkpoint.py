"""Resumable training checkpoints in safetensors and JSON only: nothing is ever unpickled.

A checkpoint is a directory ``CHECKPOINT_DIR/step-NNNNNNN`` (``CHECKPOINT_DIR/latest`` names the
newest) holding:

* ``drafter.safetensors`` — the drafter's ``state_dict`` (parameters and buffers);
* ``optimizer.safetensors`` — every tensor of the optimizer's state, flattened as
  ``state.{parameter index}.{key}`` (e.g. ``state.0.exp_avg``); ``trainer_state.json`` keeps the
  JSON index: the non-tensor state values and the parameter groups (learning rates, betas, ...);
* ``rng-{process}.safetensors`` — each process's random state: torch's CPU generator
  (``torch``), each CUDA device's (``cuda.{i}``), numpy's MT19937 keys (``numpy``) and Python's
  ``random`` state (``python``), with the scalar parts in the file's string metadata;
* ``trainer_state.json`` — the step, the scheduler's ``state_dict``, the optimizer index, the
  recipe the run was started with (the :class:`~training.trainer.TrainConfig`, the drafter's kind
  and config, a sha256 of the training sequences, the process count) and the per-step history;
* ``on_policy_pool.safetensors`` — the on-policy sequences of the current refresh, when any;
* ``backbone.safetensors`` — the backbone tensors the loss hook trains too (Medusa-2's LoRA), when any.

A checkpoint is written into ``.step-NNNNNNN.tmp`` and renamed into place; ``latest`` is replaced
atomically after that, so an interrupted save leaves the previous checkpoint as the latest.
Resuming refuses a directory that holds anything but ``*.safetensors`` and ``*.json`` files (a
pickle from accelerate's ``save_state``, ``*.pkl``, ``*.bin``, ``*.pt`` ...), naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Sequence

import numpy
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .files import write_file_atomically

STATE_FILE = "trainer_state.json"
DRAFTER_FILE = "drafter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
POOL_FILE = "on_policy_pool.safetensors"
BACKBONE_FILE = "backbone.safetensors"
LATEST_FILE = "latest"
FORMAT = "selfdraft-checkpoint"
VERSION = 1
_STEP_NAME = re.compile(r"^step-\d{7}$")
_ALLOWED_SUFFIXES = (".safetensors", ".json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: missing, unsafe (pickles), corrupt, or written by
    another recipe. The message names the directory and what is wrong."""


def rng_file(process_index: int) -> str:
    return f"rng-{process_index}.safetensors"


def step_directory(checkpoint_dir: Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step-{step:07d}"


def sequences_sha256(sequences: Sequence[torch.Tensor]) -> str:
    """A digest of token sequences (their lengths and ids), to tell whether a resumed run trains
    on the same data."""
    digest = hashlib.sha256()
    for sequence in sequences:
        ids = sequence.detach().to("cpu", torch.int64).contiguous()
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- optimizer

def optimizer_tensors(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer ``state_dict`` as (tensors ``{"state.{index}.{key}": tensor}``, JSON index)."""
    tensors: dict[str, torch.Tensor] = {}
    state_index: dict[str, dict] = {}
    for index, values in state_dict["state"].items():
        entry = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().to("cpu").contiguous().clone()
                entry[key] = {"tensor": f"state.{index}.{key}"}
            else:
                entry[key] = {"value": json_value(value, f"optimizer state {index}.{key}")}
        state_index[str(index)] = entry
    groups = [{key: json_value(value, f"optimizer param group {key}") for key, value in group.items()}
              for group in state_dict["param_groups"]]
    return tensors, {"state": state_index, "param_groups": groups}


def optimizer_state(tensors: dict[str, torch.Tensor], index: dict, current: dict, where: Path) -> dict:
    """The optimizer ``state_dict`` of a checkpoint; ``current`` (the fresh optimizer's own
    ``state_dict``) gives the tuple-valued group settings back their type (JSON has lists only)."""
    try:
        state = {}
        for key, entry in index["state"].items():
            state[int(key)] = {name: tensors[item["tensor"]] if "tensor" in item else item["value"]
                               for name, item in entry.items()}
        groups = []
        for saved, fresh in zip(index["param_groups"], current["param_groups"], strict=True):
            groups.append({key: tuple(value) if isinstance(fresh.get(key), tuple) and isinstance(value, list)
                           else value for key, value in saved.items()})
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{where}: the optimizer state does not match its index ({error!r})") from error
    return {"state": state, "param_groups": groups}


def json_value(value: object, what: str) -> object:
    """``value`` as JSON data (tuples become lists); CheckpointError for anything else."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{what}: {value!r} cannot be stored as JSON") from error
    return value


# ----------------------------------------------------------------------------- random states

def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's random states as (tensors, string metadata) for a safetensors file."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for device, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{device}"] = state
    name, keys, position, has_gauss, cached = numpy.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(numpy.int64))
    version, internal, gauss_next = random.getstate()
    tensors["python"] = torch.tensor(internal, dtype=torch.int64)
    metadata = {"numpy": json.dumps([name, int(position), int(has_gauss), float(cached)]),
                "python": json.dumps([version, gauss_next])}
    return tensors, metadata


def set_rng_state(path: Path) -> None:
    """Restore the random states :func:`rng_state` wrote to ``path``."""
    tensors = read_tensors(path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    try:
        torch.set_rng_state(tensors["torch"])
        cuda = sorted((int(name.split(".")[1]), state) for name, state in tensors.items() if name.startswith("cuda."))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([state for _, state in cuda][:torch.cuda.device_count()])
        name, position, has_gauss, cached = json.loads(metadata["numpy"])
        numpy.random.set_state((name, tensors["numpy"].numpy().astype(numpy.uint32), position, has_gauss, cached))
        version, gauss_next = json.loads(metadata["python"])
        random.setstate((version, tuple(int(value) for value in tensors["python"].tolist()), gauss_next))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: not a random-state file of this format ({error!r})") from error


# ----------------------------------------------------------------------------- files

def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the checkpoint is incomplete")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path} is corrupted or truncated: {error}") from error


def check_safe_files(directory: Path) -> None:
    """Refuse a checkpoint directory holding anything but safetensors and JSON files: pickles
    (``*.pkl``, ``*.bin``, ``*.pt``, accelerate's ``custom_checkpoint_0.pkl``) are never loaded."""
    unsafe = sorted(path.name for path in directory.iterdir() if not path.name.endswith(_ALLOWED_SUFFIXES)
                    or not path.is_file() or path.is_symlink())
    if unsafe:
        raise CheckpointError(
            f"{directory} holds {', '.join(unsafe[:5])}: a selfdraft checkpoint holds only *.safetensors and *.json "
            "files, and pickles (*.pkl, *.bin, *.pt: accelerate's save_state format, which can run code when "
            "loaded) are refused. Resume from a checkpoint written by this selfdraft, or start the run again "
            "without --resume")


def latest_checkpoint(checkpoint_dir: str | os.PathLike | None) -> Path:
    """The checkpoint directory ``CHECKPOINT_DIR/latest`` names (checked: safe files only)."""
    if checkpoint_dir is None:
        raise CheckpointError("resume needs a checkpoint directory (--checkpoint-dir)")
    checkpoint_dir = Path(checkpoint_dir)
    pointer = checkpoint_dir / LATEST_FILE
    if not pointer.is_file():
        raise CheckpointError(f"resume: no checkpoint under {checkpoint_dir} ({LATEST_FILE} not found)")
    name = pointer.read_text().strip()
    if not _STEP_NAME.match(name):
        raise CheckpointError(f"{pointer}: names {name!r}, not a checkpoint directory (step-NNNNNNN)")
    directory = checkpoint_dir / name
    if not directory.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which does not exist")
    check_safe_files(directory)
    return directory


def read_state(directory: Path) -> dict:
    """The checked ``trainer_state.json`` of a checkpoint directory."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the checkpoint is incomplete")
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a selfdraft checkpoint state (format {FORMAT!r})")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {state.get('version')!r}; this selfdraft reads {VERSION}")
    return state


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """What differs between the recipe a checkpoint was written with and this run's (both as
    :func:`recipe` returns them); ``checkpoint_every`` may change."""
    differences = []
    for key in sorted(set(saved["config"]) | set(current["config"])):
        if key == "checkpoint_every":
            continue
        if saved["config"].get(key) != current["config"].get(key):
            differences.append(f"{key} {saved['config'].get(key)!r} (now {current['config'].get(key)!r})")
    for key in ("kind", "drafter", "processes", "sequences"):
        if key in saved and key in current and saved[key] != current[key]:
            label = "training sequences" if key == "sequences" else key
            differences.append(f"{label} {saved[key]!r} (now {current[key]!r})" if key != "sequences"
                               else f"{label} (another data file, prompt set or generation setting)")
    return differences


def recipe(config: dict, kind: str, drafter: dict, processes: int, sequences: str | None = None) -> dict:
    """The parts of a run a resume must not change (see :func:`recipe_differences`)."""
    found = {"config": config, "kind": kind, "drafter": drafter, "processes": processes}
    if sequences is not None:
        found["sequences"] = sequences
    return json.loads(json.dumps(found))  # tuples as lists, as read back from JSON


def check_recipe(saved_state: dict, current: dict, directory: Path) -> None:
    """CheckpointError listing every difference between the checkpoint's recipe and this run's."""
    differences = recipe_differences(saved_state["recipe"], current)
    if differences:
        raise CheckpointError(
            f"{directory} was written by another recipe: {'; '.join(differences)}. Resume with the settings the "
            "run started with, or start a new run (another --checkpoint-dir, without --resume)")


def save(directory: Path, process_index: int, is_main: bool, barrier, main_files: dict[str, callable]) -> None:
    """Write a checkpoint directory from every process: each writes its random state, the main
    process the ``main_files`` (``{name: write(path)}``); then the main process renames the
    staging directory into place and points ``latest`` at it. ``barrier()`` waits for all."""
    staging = directory.with_name(f".{directory.name}.tmp")
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    tensors, metadata = rng_state()
    save_file(tensors, str(staging / rng_file(process_index)), metadata=metadata)
    if is_main:
        for name, write in main_files.items():
            write(staging / name)
    barrier()
    if is_main:
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)
        write_file_atomically(directory.parent / LATEST_FILE, lambda path: path.write_text(directory.name + "\n"))
    barrier()
