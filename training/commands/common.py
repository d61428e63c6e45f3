"""Helpers every ``selfdraft`` subcommand shares: loading a model with its tokenizer, writing a
JSON report."""

from __future__ import annotations

import logging

from ..files import write_json as _write_json

logger = logging.getLogger("selfdraft")


def load_model(directory: str, dtype: str = "float32", revision: str | None = None):
    """``(model, tokenizer)`` from a local directory or hub id, the model in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, revision=revision)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), revision=revision)
    model.eval()
    return model, tokenizer


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a command's ``--json``); nothing when ``path`` is None."""
    if path:
        _write_json(path, payload)
