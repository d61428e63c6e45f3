"""Prompt sets: the files prompts come in, chat rendering, and tokenization.

- `load_prompts` reads jsonl (``{"prompt"}``, ``{"text"}``, ShareGPT ``{"conversations"}`` or
  OpenAI ``{"messages"}`` records), a JSON array of such records, or plain text (one prompt per
  line, or per blank-line-separated paragraph with ``paragraphs=True``).
- `tokenize_prompts` / `text_sequences` turn texts into 1D token tensors (`encode_text`: one
  text, never with two BOS tokens when a chat template wrote one).
- `tokenizer_pad_id`: the id batches of a tokenizer's sequences are padded with.
- `hold_out`: a seeded validation split of a prompt set (prompts a trainer never sees).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHAT_ROLES: dict[str, str] = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "chatgpt", "bing", "bard", "model"), "assistant"),
    "system": "system",
}
"""ShareGPT ``from`` / OpenAI ``role`` values accepted, mapped to user / assistant / system."""

PLAIN_ROLE_NAMES: dict[str, str] = {"system": "System", "user": "User", "assistant": "Assistant"}
"""Speaker labels of the plain chat rendering used when no chat template is available."""
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


def _lines(text: str) -> list[str]:
    """Non-blank lines, stripped of their line ending and surrounding white space."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def _paragraphs(text: str) -> list[str]:
    """Blank-line-separated paragraphs, stripped; lines inside one keep their newlines."""
    return [block.strip() for block in re.split(r"\n[ \t\r\f\v]*\n", text) if block.strip()]


def load_prompts(path: str | os.PathLike[str], tokenizer: Any | None = None, paragraphs: bool = False) -> list[str]:
    """Read a prompt set.

    Formats, chosen by file name:

    - ``.jsonl``: one JSON object per line (blank lines skipped): ``{"prompt": str}``,
      ``{"text": str}``, ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system",
      "value": str}, ...]}`` or OpenAI ``{"messages": [{"role", "content"}, ...]}``.
    - ``.json``: a JSON array of such records if the file starts with ``[``, else JSON lines.
    - anything else: plain text, one prompt per non-blank line; with ``paragraphs`` one prompt per
      blank-line-separated paragraph (prompts that span lines, such as code). How the file was read
      (the format and the prompt count) is logged at INFO.

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
        prompts = _paragraphs(text) if paragraphs else _lines(text)
    if not prompts:
        raise DataFormatError(f"{path}: file contains no prompts")
    if suffix in (".jsonl", ".json"):
        logger.info("read %d prompts from %s (JSON records)", len(prompts), path)
    else:
        unit = "blank-line-separated paragraph" if paragraphs else "line (blank lines skipped)"
        logger.info("read %d prompts from %s (plain text: one prompt per %s)", len(prompts), path, unit)
    return prompts


def hold_out(prompts: Sequence[str], count: int, seed: int) -> tuple[list[str], list[str]]:
    """``(kept, held_out)``: ``count`` prompts drawn with ``random.Random(seed)`` (the same split for
    the same file, count and seed, whatever the file's order groups together), both lists in file
    order. ``0 <= count <= len(prompts)``."""
    if not 0 <= count <= len(prompts):
        raise ValueError(f"count must lie in 0..{len(prompts)}; got {count}")
    chosen = set(random.Random(seed).sample(range(len(prompts)), count))
    kept = [prompt for index, prompt in enumerate(prompts) if index not in chosen]
    return kept, [prompt for index, prompt in enumerate(prompts) if index in chosen]


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> torch.Tensor:
    """``text``'s token ids ``[L]``. When the text already starts with the BOS token (a chat
    template that writes ``bos_token``) and the tokenizer adds one as well, the added one is
    dropped: the sequence starts with one BOS, as the model saw in training."""
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    bos, bos_text = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
    if (add_special_tokens and bos is not None and bos_text and text.startswith(bos_text)
            and ids[:2] == [bos, bos]):
        ids = ids[1:]
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
        ids = encode_text(tokenizer, prompt, add_special_tokens)
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
        ids = encode_text(tokenizer, text, add_special_tokens)
        if ids.numel() == 0:
            raise ValueError(f"text {index} tokenizes to no tokens")
        sequences.append(ids[:max_length])
    return sequences


def tokenizer_pad_id(tokenizer: Any) -> int:
    """The id to pad a tokenizer's sequences with: its pad token, else its eos token, else 0."""
    for pad_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad_id is not None:
            return pad_id
    return 0
