"""Prompt sets and self-distillation data for training drafters.

- `load_prompts` reads jsonl (``{"prompt"}``, ``{"text"}``, ShareGPT ``{"conversations"}`` or
  OpenAI ``{"messages"}`` records), a JSON array of such records, or plain text.
- `tokenize_prompts` / `text_sequences` turn texts into 1D token tensors.
- `generate_distillation_data` appends the frozen target's own continuation to each prompt and
  caches the result on disk as safetensors (off-policy data).
- `generate_on_policy_data` appends what speculative generation with the *current* drafter
  produces at the serving temperature (on-policy data, DistillSpec).
- `collate` right-pads sequences into a batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from heads.model import eos_token_ids

logger = logging.getLogger(__name__)

CHAT_ROLES: dict[str, str] = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "chatgpt", "bing", "bard", "model"), "assistant"),
    "system": "system",
}
"""ShareGPT ``from`` / OpenAI ``role`` values accepted, mapped to user / assistant / system."""

PLAIN_ROLE_NAMES: dict[str, str] = {"system": "System", "user": "User", "assistant": "Assistant"}
"""Speaker labels of the plain chat rendering used when no chat template is available."""

CACHE_FORMAT_VERSION = 1


class DataFormatError(ValueError):
    """A prompt file is malformed; the message names the file, the location and the problem."""


def render_chat_plain(messages: Sequence[dict[str, str]]) -> str:
    """Render ``[{"role", "content"}, ...]`` as plain text ending in a generation prompt.

    Each turn becomes ``"<Label>: <content>"`` on its own line (labels System / User /
    Assistant), and ``"Assistant:"`` follows, e.g. ``"User: hi\\nAssistant:"``.
    """
    lines = [f"{PLAIN_ROLE_NAMES[m['role']]}: {m['content']}" for m in messages]
    return "\n".join(lines + [f"{PLAIN_ROLE_NAMES['assistant']}:"])


def _chat_turns(record: dict[str, Any], key: str, where: str) -> list[dict[str, str]]:
    """Normalise a ShareGPT / OpenAI conversation to ``[{"role", "content"}]``, cut after the
    first user turn. ``where`` ("file line N") prefixes error messages."""
    role_key, content_key = ("from", "value") if key == "conversations" else ("role", "content")
    turns = record[key]
    if not isinstance(turns, list):
        raise DataFormatError(f"{where}: {key!r} must be a list of turns, got {type(turns).__name__}")
    messages: list[dict[str, str]] = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise DataFormatError(
                f"{where}: turn {number} of {key!r} must be an object with keys "
                f"{role_key!r} and {content_key!r}"
            )
        role, content = turn[role_key], turn[content_key]
        if not isinstance(role, str) or role.lower() not in CHAT_ROLES:
            raise DataFormatError(
                f"{where}: turn {number} has unknown {role_key!r} {role!r}; "
                f"expected one of {sorted(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise DataFormatError(
                f"{where}: turn {number} {content_key!r} must be a string, "
                f"got {type(content).__name__}"
            )
        messages.append({"role": CHAT_ROLES[role.lower()], "content": content})
        if messages[-1]["role"] == "user":
            if not content.strip():
                raise DataFormatError(f"{where}: the first user turn (turn {number}) is empty")
            return messages
    raise DataFormatError(f"{where}: conversation has no human/user turn")


def _render_chat(messages: list[dict[str, str]], tokenizer: Any | None, where: str) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return render_chat_plain(messages)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # jinja2 raises its own error types from templates
        raise DataFormatError(f"{where}: the tokenizer's chat template failed: {error}") from error


def _record_prompt(record: Any, where: str, tokenizer: Any | None) -> str:
    """The prompt text of one parsed JSON record (see `load_prompts`)."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("prompt", "text"):
        if key in record:
            value = record[key]
            if not isinstance(value, str):
                raise DataFormatError(
                    f"{where}: {key!r} must be a string, got {type(value).__name__}"
                )
            if not value.strip():
                raise DataFormatError(f"{where}: {key!r} is empty")
            return value
    for key in ("conversations", "messages"):
        if key in record:
            return _render_chat(_chat_turns(record, key, where), tokenizer, where)
    raise DataFormatError(
        f"{where}: missing key; expected one of 'prompt', 'text', 'conversations', 'messages', "
        f"got keys {sorted(record)}"
    )


def _json_lines_prompts(text: str, path: Path, tokenizer: Any | None) -> list[str]:
    prompts = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFormatError(f"{where}: invalid JSON: {error.msg}") from error
        prompts.append(_record_prompt(record, where, tokenizer))
    return prompts


def _json_array_prompts(text: str, path: Path, tokenizer: Any | None) -> list[str]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataFormatError(f"{path} line {error.lineno}: invalid JSON: {error.msg}") from error
    if not isinstance(records, list):
        raise DataFormatError(f"{path}: a JSON array of records was expected")
    return [
        _record_prompt(record, f"{path} record {number}", tokenizer)
        for number, record in enumerate(records, start=1)
    ]


def _paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs, stripped; lines inside one keep their newlines."""
    return [block.strip() for block in re.split(r"\n[ \t\r\f\v]*\n", text) if block.strip()]


def load_prompts(path: str | os.PathLike[str], tokenizer: Any | None = None) -> list[str]:
    """Read a prompt set.

    Formats, chosen by file name:

    - ``.jsonl``: one JSON object per line (blank lines skipped): ``{"prompt": str}``,
      ``{"text": str}``, ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system",
      "value": str}, ...]}`` or OpenAI ``{"messages": [{"role", "content"}, ...]}``.
    - ``.json``: a JSON array of such records if the file starts with ``[``, else JSON lines.
    - anything else: plain text, one prompt per blank-line-separated paragraph.

    A chat record's prompt is its turns up to and including the first human/user turn, rendered
    by ``tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` when
    ``tokenizer`` has a chat template, else by `render_chat_plain` (``"User: ...\\nAssistant:"``).

    Raises FileNotFoundError for a missing file, and `DataFormatError` naming the file, the
    1-based line (or record) number and the problem for malformed content or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "prompt file not found", str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataFormatError(f"{path}: not valid UTF-8 text ({error})") from error
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or (suffix == ".json" and not text.lstrip().startswith("[")):
        prompts = _json_lines_prompts(text, path, tokenizer)
    elif suffix == ".json":
        prompts = _json_array_prompts(text, path, tokenizer)
    else:
        prompts = _paragraphs(text)
    if not prompts:
        raise DataFormatError(f"{path}: file contains no prompts")
    logger.info("loaded %d prompts from %s", len(prompts), path)
    return prompts


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def tokenize_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    max_prompt_tokens: int | None = None,
    context_length: int | None = None,
    *,
    truncate: bool = False,
    add_special_tokens: bool = True,
) -> list[torch.Tensor]:
    """Tokenize prompts into 1D LongTensors ``[prompt_len]``.

    The limit is the smaller of ``max_prompt_tokens`` and ``context_length`` (either may be
    None). A longer prompt raises ValueError naming its index, its length and the limit, unless
    ``truncate`` is true: then its last ``limit`` tokens are kept (left truncation). A prompt
    that tokenizes to no tokens raises ValueError. Use ``add_special_tokens=False`` for prompts
    already rendered by a chat template that writes its own BOS.
    """
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("context_length", context_length)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    bounds = [value for value in (max_prompt_tokens, context_length) if value is not None]
    limit = min(bounds) if bounds else None
    sequences = []
    for index, prompt in enumerate(prompts):
        ids = _encode(tokenizer, prompt, add_special_tokens)
        if ids.numel() == 0:
            raise ValueError(f"prompt {index} tokenizes to no tokens")
        if limit is not None and ids.numel() > limit:
            if not truncate:
                raise ValueError(
                    f"prompt {index} has {ids.numel()} tokens, more than the limit of {limit} "
                    f"(max_prompt_tokens={max_prompt_tokens}, context_length={context_length}); "
                    "shorten it or pass truncate=True to keep its last tokens"
                )
            ids = ids[-limit:]
        sequences.append(ids)
    return sequences


def text_sequences(
    tokenizer: Any, texts: Sequence[str], max_length: int, *, add_special_tokens: bool = True
) -> list[torch.Tensor]:
    """Tokenize original texts for training without generation: 1D LongTensors, each cut to its
    first ``max_length`` tokens. Texts that tokenize to no tokens raise ValueError."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    sequences = []
    for index, text in enumerate(texts):
        ids = _encode(tokenizer, text, add_special_tokens)
        if ids.numel() == 0:
            raise ValueError(f"text {index} tokenizes to no tokens")
        sequences.append(ids[:max_length])
    return sequences


def collate(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1D sequences into ``(input_ids [B, T], attention_mask [B, T])`` (long),
    ``T`` the longest length; padding is ``pad_id`` with mask 0."""
    if len(sequences) == 0:
        raise ValueError("collate needs at least one sequence")
    for index, sequence in enumerate(sequences):
        if sequence.dim() != 1 or sequence.numel() == 0:
            raise ValueError(
                f"sequence {index} must be a non-empty 1D tensor, got shape {tuple(sequence.shape)}"
            )
    length = max(sequence.numel() for sequence in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : sequence.numel()] = sequence
        attention_mask[row, : sequence.numel()] = 1
    return input_ids, attention_mask


def _cache_key(settings: dict[str, Any], prompts: Sequence[str]) -> str:
    """sha256 hex digest of the generation settings and the prompt texts."""
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True).encode("utf-8"))
    for prompt in prompts:
        encoded = prompt.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def _save_sequences(path: Path, sequences: Sequence[torch.Tensor], settings: dict[str, Any]) -> None:
    """Write sequences as safetensors ``ids`` (concatenated) + ``offsets`` ``[N + 1]``,
    atomically (temporary file in the same folder, then os.replace)."""
    from safetensors.torch import save_file

    lengths = torch.tensor([0] + [sequence.numel() for sequence in sequences], dtype=torch.long)
    tensors = {
        "ids": torch.cat([sequence.long() for sequence in sequences]).contiguous(),
        "offsets": torch.cumsum(lengths, dim=0),
    }
    metadata = {"format_version": str(CACHE_FORMAT_VERSION), "settings": json.dumps(settings)}
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _load_sequences(path: Path, expected_count: int) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    ids, offsets = tensors.get("ids"), tensors.get("offsets")
    if ids is None or offsets is None or offsets.numel() != expected_count + 1:
        raise ValueError(
            f"distillation cache file {path} does not hold {expected_count} sequences as "
            "'ids' + 'offsets'; delete it to regenerate"
        )
    bounds = offsets.tolist()
    return [ids[start:end].clone() for start, end in zip(bounds[:-1], bounds[1:])]


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
            return _load_sequences(cache_path, len(prompts))
    prompt_ids = _distillation_prompt_ids(
        model, tokenizer, prompts, max_new_tokens, max_prompt_tokens, truncate, add_special_tokens
    )
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    sequences = _generate_all(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        batch_size=batch_size,
        pad_id=pad_id,
        progress=progress,
    )
    if cache_path is not None:
        _save_sequences(cache_path, sequences, settings)
        logger.info("saved distillation data for %d prompts to %s", len(sequences), cache_path)
    return sequences


@dataclass
class OnPolicyData:
    """Sequences from `generate_on_policy_data` and the drafter's tau while producing them."""

    sequences: list[torch.Tensor] = field(default_factory=list)
    """1D LongTensors ``[prompt_len + new_len]``, on the CPU."""
    new_tokens: int = 0
    target_forwards: int = 0

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (bonus token and prefill included)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0


@torch.no_grad()
def generate_on_policy_data(
    spec: Any,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    first_index: int = 0,
) -> OnPolicyData:
    """On-policy data: each prompt followed by what ``spec.generate`` produces with its current
    drafter, greedy when ``temperature == 0``, else sampled at ``temperature`` (top_k=0,
    top_p=1.0). The trainer re-scores these sequences with the target, so the drafter learns the
    target's distribution on the contexts it visits when serving at that temperature.

    ``prompt_ids`` are 1D LongTensors ``[prompt_len]``. Prompt ``i`` draws from its own
    ``torch.Generator`` seeded with ``seed`` and ``first_index + i``, so a prompt's sequence does
    not depend on which other prompts are generated with it (e.g. by another process) and the
    global RNG is untouched. A continuation ends at the first eos (kept) or ``max_new_tokens``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    sampled = temperature > 0
    settings = dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0) if sampled else {}
    data = OnPolicyData()
    for offset, ids in enumerate(prompt_ids):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prompt_ids[{offset}] must be a non-empty 1D tensor of token ids")
        generator = None
        if sampled:
            generator = torch.Generator(device=spec.target.device)
            generator.manual_seed(seed * 1_000_003 + first_index + offset)
        output = spec.generate(ids[None].long(), max_new_tokens=max_new_tokens, generator=generator, **settings)
        data.sequences.append(output[0].cpu())
        data.new_tokens += spec.last_stats.new_tokens
        data.target_forwards += spec.last_stats.target_forwards
    return data
