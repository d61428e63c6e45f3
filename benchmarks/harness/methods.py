"""The registry of methods a benchmark compares, each written as one string:

- ``generate``: the target's own ``model.generate`` (the baseline every speedup is over);
- ``prompt_lookup_nN``: transformers' prompt lookup, ``prompt_lookup_num_tokens=N``;
- ``assisted:DRAFT_DIR``: transformers' assisted generation, ``assistant_model=`` the model in DRAFT_DIR;
- ``draft:DRAFT_DIR``: selfdraft's draft kind with its defaults, ``attach_heads(kind="draft", draft_model=`` the
  model in DRAFT_DIR, loaded in the target's dtype``)``;
- ``ADAPTER_DIR``: a selfdraft adapter (``heads.load_heads``);
- ``ADAPTER_DIR+lookup``: that adapter as a hybrid with lookup (``spec.set_lookup(True, history_tokens=0)``);
- ``lookup_N``: selfdraft's lookup kind with a budget of N nodes (``attach_heads(kind="lookup", budget=N,
  history_tokens=0)``);

and for selfdraft methods ``,tree=T`` (``spec.set_tree``: T drafted nodes, or ``DEPTH:TOP_K:TOTAL`` for
an EAGLE or draft-kind tree shape) and a final ``@auto`` (``generate(speculate="auto")``). Lookup runs without
cross-request history, so that no prompt can copy an earlier run of itself. Directories are
relative to the repository root (or absolute).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .prompts import ROOT, BenchmarkError

FORMS = ("generate, prompt_lookup_nN, assisted:DRAFT_DIR, draft:DRAFT_DIR, ADAPTER_DIR, ADAPTER_DIR+lookup, "
         "lookup_N; selfdraft methods optionally with ,tree=N or ,tree=DEPTH:TOP_K:TOTAL and a final @auto")
PEERS = ("generate", "prompt_lookup", "assisted")
"""Bases that are transformers' own ``generate``: no tree, no ``@auto``, batch size 1 for the assisted ones."""


@dataclass(frozen=True)
class Method:
    name: str  # as written
    base: str  # generate | prompt_lookup | assisted | draft | adapter | lookup
    size: int | None = None  # prompt_lookup: tokens; lookup: node budget
    directory: Path | None = None  # assisted, draft: the draft model; adapter: the adapter
    hybrid: bool = False  # adapter + lookup
    tree: int | dict | None = None  # spec.set_tree argument (None: the configured tree)
    auto: bool = False  # speculate="auto"

    @property
    def selfdraft(self) -> bool:
        return self.base not in PEERS


def _tree(text: str, name: str) -> int | dict:
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\d+:\d+:\d+", text):
        depth, top_k, total = (int(part) for part in text.split(":"))
        return {"depth": depth, "top_k": top_k, "total_tokens": total}
    raise BenchmarkError(f"method {name!r}: tree={text!r} is neither a node count nor DEPTH:TOP_K:TOTAL")


def _directory(text: str) -> Path:
    path = Path(text)
    return path if path.is_absolute() else ROOT / path


def _model_directory(text: str, name: str) -> Path:
    """The draft model's directory ``text`` names; without a ``config.json`` a :class:`BenchmarkError`."""
    directory = _directory(text)
    if not text or not (directory / "config.json").is_file():
        raise BenchmarkError(f"method {name!r}: no model (config.json) in {directory}")
    return directory


def parse_method(name: str) -> Method:
    """The :class:`Method` ``name`` writes; an unknown form, a missing directory or an option that
    does not apply is a :class:`BenchmarkError` naming it."""
    rest, auto = (name[:-len("@auto")], True) if name.endswith("@auto") else (name, False)
    rest, *options = rest.split(",")
    tree = None
    for option in options:
        key, _, value = option.partition("=")
        if key != "tree" or not value:
            raise BenchmarkError(f"method {name!r}: unknown option {option!r} (known: tree=T)")
        tree = _tree(value, name)
    if rest == "generate":
        method = Method(name, "generate")
    elif match := re.fullmatch(r"prompt_lookup_n(\d+)", rest):
        method = Method(name, "prompt_lookup", size=int(match.group(1)))
    elif rest.startswith("assisted:"):
        method = Method(name, "assisted", directory=_model_directory(rest[len("assisted:"):], name))
    elif rest.startswith("draft:"):
        method = Method(name, "draft", directory=_model_directory(rest[len("draft:"):], name), tree=tree, auto=auto)
    elif match := re.fullmatch(r"lookup_(\d+)", rest):
        method = Method(name, "lookup", size=int(match.group(1)), tree=tree, auto=auto)
    else:
        hybrid = rest.endswith("+lookup")
        directory = _directory(rest[:-len("+lookup")] if hybrid else rest)
        if not (directory / "adapter_config.json").is_file():
            raise BenchmarkError(f"unknown method {name!r}: not a method name and no adapter (adapter_config.json) "
                                 f"in {directory}; methods: {FORMS}")
        method = Method(name, "adapter", directory=directory, hybrid=hybrid, tree=tree, auto=auto)
    if method.size is not None and method.size < 1:
        raise BenchmarkError(f"method {name!r}: the size must be at least 1")
    if not method.selfdraft and (auto or tree is not None):
        raise BenchmarkError(f"method {name!r}: ,tree= and @auto apply to selfdraft methods only, not to {method.base}")
    return method


def build_method(method: Method, model, temperature: float, pad_token_id: int | None):
    """``method`` on ``model`` as a :data:`training.evaluate.Method` (a fresh drafter: nothing learned
    by ``@auto`` or kept by lookup is shared with another method)."""
    import heads
    from training.evaluate import plain_method, sampling_settings, spec_method

    if method.base == "generate":
        return plain_method(model, temperature, pad_token_id)
    if not method.selfdraft:
        extra = {"prompt_lookup_num_tokens": method.size} if method.base == "prompt_lookup" else {
            "assistant_model": _load_draft(method.directory, model)}
        settings = {**sampling_settings(temperature), **extra}

        def run(ids, mask, new):
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=pad_token_id,
                                  **settings), None
        return run
    try:
        if method.base == "lookup":
            spec = heads.attach_heads(model, kind="lookup", budget=method.size, history_tokens=0)
        elif method.base == "draft":
            spec = heads.attach_heads(model, kind="draft", draft_model=_load_draft(method.directory, model))
        else:
            spec = heads.load_heads(model, method.directory)  # TargetMismatchError: another target's adapter
            if method.hybrid:
                spec.set_lookup(True, history_tokens=0)
        if method.tree is not None:
            spec.set_tree(method.tree)
    except (heads.AdapterError, ValueError) as error:
        raise BenchmarkError(f"method {method.name!r}: {error}") from error
    return spec_method(spec, temperature, "auto" if method.auto else None, pad_token_id)


def _load_draft(directory: Path, model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=model.dtype).eval()
