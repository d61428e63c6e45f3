"""Self-distillation data (off-policy): each prompt followed by the frozen target's own
continuation, generated in seeded batches and cached on disk as safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from heads.model import eos_token_ids

from .prompts import tokenize_prompts, tokenizer_pad_id
from .sequences import FORMAT_VERSION as CACHE_FORMAT_VERSION
from .sequences import collate, load_sequences, save_sequences

logger = logging.getLogger(__name__)


def _cache_key(settings: dict[str, Any], prompts: Sequence[str]) -> str:
    """sha256 hex digest of the generation settings and the prompt texts."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True).encode("utf-8"))
    for prompt in prompts:
        encoded = prompt.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _cut_after_eos(new_tokens: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """Keep generated tokens up to and including the first eos (generate pads after it)."""
    for position, token in enumerate(new_tokens.tolist()):
        if token in eos_ids:
            return new_tokens[: position + 1]
    return new_tokens


def _generate_batch(
    model: Any,
    batch: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    pad_id: int,
    eos_ids: set[int],
) -> list[torch.Tensor]:
    """One ``model.generate`` call over left-padded prompts; returns prompt + continuation for
    each prompt, without padding."""
    reversed_ids, reversed_mask = collate([ids.flip(0) for ids in batch], pad_id)
    input_ids, attention_mask = reversed_ids.flip(1), reversed_mask.flip(1)  # left padding
    length = input_ids.shape[1]
    device = next(model.parameters()).device
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    output = model.generate(
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        return_dict_in_generate=False,
        **sampling,
    ).cpu()
    return [
        torch.cat([ids, _cut_after_eos(output[row, length:], eos_ids)])
        for row, ids in enumerate(batch)
    ]


def _distillation_prompt_ids(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    max_prompt_tokens: int | None,
    truncate: bool,
    add_special_tokens: bool,
) -> list[torch.Tensor]:
    """Tokenize prompts leaving room for ``max_new_tokens`` in the model's context."""
    context_length = getattr(model.config, "max_position_embeddings", None)
    if context_length is not None:
        budget = context_length - max_new_tokens
        if budget < 1:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                f"context_length={context_length}"
            )
        max_prompt_tokens = budget if max_prompt_tokens is None else min(max_prompt_tokens, budget)
    return tokenize_prompts(
        tokenizer, prompts, max_prompt_tokens, context_length,
        truncate=truncate, add_special_tokens=add_special_tokens,
    )


def _generate_all(
    model: Any,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int,
    pad_id: int,
    progress: bool,
) -> list[torch.Tensor]:
    """Generate batch by batch, each under its own seed inside `torch.random.fork_rng`."""
    eos_ids = set(eos_token_ids(model))
    # accelerator RNGs to save and restore (the CPU one always is); a sharded model may span several
    rng_devices = sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)
    rng_device_type = rng_devices[0].type if rng_devices else None
    starts: Any = range(0, len(prompt_ids), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="generating distillation data", unit="batch")
    was_training = model.training
    model.eval()
    sequences: list[torch.Tensor] = []
    try:
        for start in starts:
            with torch.random.fork_rng(devices=rng_devices, device_type=rng_device_type):
                torch.manual_seed(seed + start)
                sequences += _generate_batch(
                    model,
                    prompt_ids[start : start + batch_size],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    pad_id=pad_id,
                    eos_ids=eos_ids,
                )
    finally:
        model.train(was_training)
    return sequences


CACHE_ENVIRONMENT = "SELFDRAFT_CACHE"
"""Environment variable naming selfdraft's cache root (default ``$XDG_CACHE_HOME/selfdraft``, else
``~/.cache/selfdraft``)."""


def default_cache_dir() -> Path:
    """Where ``selfdraft train`` caches distillation data when ``--cache-dir`` is not given:
    ``<cache root>/distill`` under the user's cache directory (``$SELFDRAFT_CACHE``, else
    ``$XDG_CACHE_HOME/selfdraft``, else ``~/.cache/selfdraft``), never the current directory."""
    root = os.environ.get(CACHE_ENVIRONMENT)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "selfdraft")
    return Path(root).expanduser() / "distill"


def generate_distillation_data(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    target_id: str,
    batch_size: int = 1,
    progress: bool = False,
    max_prompt_tokens: int | None = None,
    truncate: bool = False,
    add_special_tokens: bool = True,
) -> list[torch.Tensor]:
    """Self-distillation data: each prompt's ids followed by the frozen target's continuation.

    Returns one 1D LongTensor ``[prompt_len + new_len]`` per prompt (``new_len <=
    max_new_tokens``; a continuation ends at the first eos, which is kept). Greedy when
    ``temperature == 0``, else pure sampling at ``temperature`` (top_k=0, top_p=1.0, so the
    model's generation_config cannot add truncation). Prompts are tokenized by
    `tokenize_prompts` with at most ``max_prompt_tokens`` tokens and room for
    ``max_new_tokens`` inside ``model.config.max_position_embeddings``; a longer prompt raises
    ValueError unless ``truncate`` (then it keeps its last tokens).

    Seeding: ``model.generate`` has no generator argument, so each batch is generated inside
    ``torch.random.fork_rng()`` after ``torch.manual_seed(seed + index of its first prompt)``;
    the global RNG is left as it was. With ``batch_size == 1`` each prompt has its own seed;
    sampled results depend on ``batch_size``, which is therefore part of the cache key.

    Cache: with ``cache_dir``, the result lives in ``distill-<sha256>.safetensors`` where the
    hash covers ``target_id``, the prompt texts, ``max_new_tokens``, ``temperature``, ``seed``,
    the tokenizer's vocabulary size (``len(tokenizer)``) and the other keyword arguments that
    change the result; a later call with the same values loads it instead of generating.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:  # also rejects nan
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    settings = dict(
        format_version=CACHE_FORMAT_VERSION, target_id=target_id, max_new_tokens=max_new_tokens,
        temperature=float(temperature), seed=seed, vocab_size=len(tokenizer), batch_size=batch_size,
        max_prompt_tokens=max_prompt_tokens, truncate=truncate, add_special_tokens=add_special_tokens,
    )
    cache_path = None
    if cache_dir is not None:
        cache_path = Path(cache_dir) / f"distill-{_cache_key(settings, prompts)}.safetensors"
        if cache_path.is_file():
            logger.info("loading distillation data from cache file %s", cache_path)
            return load_sequences(cache_path, len(prompts))
    prompt_ids = _distillation_prompt_ids(
        model, tokenizer, prompts, max_new_tokens, max_prompt_tokens, truncate, add_special_tokens
    )
    sequences = _generate_all(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        pad_id=tokenizer_pad_id(tokenizer),
        progress=progress,
    )
    if cache_path is not None:
        save_sequences(cache_path, sequences, settings)
        logger.info("saved distillation data for %d prompts to %s", len(sequences), cache_path)
    return sequences


def generate_mixed_distillation_data(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    temperatures: Sequence[float],
    **settings: Any,
) -> tuple[list[torch.Tensor], list[float]]:
    """Self-distillation data drawn at several temperatures: prompt ``i`` is continued at
    ``temperatures[i % len(temperatures)]`` (0: greedy), so each temperature's share of the
    prompts is its share of the list (``(0, 0.7)``: every other prompt sampled at 0.7; ``(0, 0,
    0.7)``: one in three). Each temperature's prompts are generated by
    :func:`generate_distillation_data` with ``settings`` (seeded and cached per temperature).

    Returns ``(sequences, drawn_at)``: one sequence per prompt in the order of ``prompts`` and the
    temperature each was drawn at.
    """
    if len(temperatures) == 0:
        raise ValueError("temperatures is empty")
    drawn_at = [float(temperatures[index % len(temperatures)]) for index in range(len(prompts))]
    sequences: list[torch.Tensor | None] = [None] * len(prompts)
    for temperature in sorted(set(drawn_at)):
        chosen = [index for index, value in enumerate(drawn_at) if value == temperature]
        generated = generate_distillation_data(
            model, tokenizer, [prompts[index] for index in chosen], temperature=temperature, **settings
        )
        for index, sequence in zip(chosen, generated):
            sequences[index] = sequence
    return sequences, drawn_at
