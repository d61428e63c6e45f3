"""``generate``'s context-dependent logits processors, applied to every verified node at once.

``model.generate`` processes the logits of each step with the sequence so far: a repetition
penalty on the tokens already present (prompt padding skipped), bans on tokens that would repeat an
n-gram, eos banned below a minimum length, suppressed tokens. Speculative decoding processes the
logits of every tree node with that node's own sequence (:mod:`tree_attention.context`), so the
greedy choice and the sampled distribution at each node are exactly ``generate``'s, and the
acceptance rules stay lossless. Each function below computes what the transformers class named in
its docstring computes, for ``M`` sequences of different lengths in one pass (tested against the
classes themselves); they run in ``generate``'s order, before the sampling warpers.
"""

from __future__ import annotations

import math

import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SuppressTokensAtBeginLogitsProcessor, SuppressTokensLogitsProcessor,
)

from tree_attention.context import Contexts

FIELDS = ("repetition_penalty", "no_repeat_ngram_size", "min_length", "min_new_tokens", "suppress_tokens",
          "begin_suppress_tokens")
"""The ``GenerationConfig`` fields this module honours."""


def repetition_penalty(contexts: Contexts, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """``RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=padding)``: the score of
    every token present in a sequence (prompt padding skipped) divided by ``penalty`` when
    positive, multiplied when negative. ``scores`` ``[M, V]``."""
    vocab = scores.shape[-1]
    columns = torch.arange(contexts.ids.shape[1], device=scores.device)
    tokens = contexts.ids.masked_fill(columns[None, :] < contexts.starts[:, None], vocab).clamp(max=vocab)
    present = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    present.scatter_(1, tokens, True)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(present[:, :vocab], penalised, scores)


def no_repeat_ngram(contexts: Contexts, scores: torch.Tensor, size: int) -> torch.Tensor:
    """``NoRepeatNGramLogitsProcessor(size)``: a token that would complete an n-gram already in
    the sequence (the prompt's padding included, as there) gets ``-inf``."""
    ids, vocab = contexts.ids, scores.shape[-1]
    width = ids.shape[1]
    if width < size:
        return scores
    suffix = ids[:, width + 1 - size:]  # (M, size - 1): what the next token would extend
    windows = ids.unfold(1, size, 1)  # (M, width - size + 1, size)
    inside = torch.arange(windows.shape[1], device=ids.device)[None, :] >= (width - contexts.lengths)[:, None]
    matches = (windows[..., :-1] == suffix[:, None, :]).all(dim=-1) & inside
    banned = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
    return scores.masked_fill(banned[:, :vocab], -float("inf"))


def ban_where(scores: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``-inf`` at ``tokens`` (ids ``[K]``) in the rows where ``rows`` ``[M]`` is True (as
    ``MinLengthLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``,
    ``SuppressTokensLogitsProcessor`` and ``SuppressTokensAtBeginLogitsProcessor`` set them)."""
    vocabulary = torch.arange(scores.shape[-1], device=scores.device)
    columns = torch.isin(vocabulary, tokens.to(scores.device))
    return torch.where(rows[:, None] & columns[None, :], -math.inf, scores)


def _token_list(name: str, value) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(token, int) and not isinstance(token, bool)
                                                      and token >= 0 for token in value):
        raise ValueError(f"{name} must be a list of token ids (ints >= 0); got {value!r}")
    return list(value)


def _count(name: str, value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value!r}")
    return value


class GenerateProcessors:
    """What ``generate`` does to each step's logits before the sampling warpers, for one call.

    Built by :func:`context_processors` from the call's ``GenerationConfig``, the eos ids and the
    padded prompt width; called with :class:`~tree_attention.context.Contexts` and logits
    ``[M, V]``, returns float32 scores ``[M, V]`` (``generate`` processes float32 copies).
    """

    def __init__(self, config, eos_token_ids, prompt_width: int) -> None:
        penalty = getattr(config, "repetition_penalty", None)
        if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, float) or not penalty > 0):
            raise ValueError(f"repetition_penalty must be a float > 0 (1.0: none); got {penalty!r}")
        self.penalty = None if penalty in (None, 1.0) else penalty
        self.ngram_size = _count("no_repeat_ngram_size", getattr(config, "no_repeat_ngram_size", None))
        min_new = getattr(config, "min_new_tokens", None)
        min_length = _count("min_length", getattr(config, "min_length", None))
        if min_new is not None:  # generate: min_new_tokens takes precedence over min_length
            min_length = _count("min_new_tokens", min_new) + prompt_width
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        # every sequence holds the prompt's T columns: a minimum of T or less never bans anything
        self.min_length = min_length if len(eos) and min_length > prompt_width else 0
        self.eos = eos
        suppress = getattr(config, "suppress_tokens", None)
        self.suppress = None if suppress is None else torch.tensor(_token_list("suppress_tokens", suppress),
                                                                    dtype=torch.long)
        begin = getattr(config, "begin_suppress_tokens", None)
        self.begin_suppress = None if begin is None else torch.tensor(_token_list("begin_suppress_tokens", begin),
                                                                       dtype=torch.long)
        self.begin_index = prompt_width  # forced_bos_token_id is refused, so generate begins at the prompt's end

    @property
    def active(self) -> bool:
        return bool(self.penalty is not None or self.ngram_size or self.min_length or self.suppress is not None
                    or self.begin_suppress is not None)

    @property
    def key(self) -> str:
        """The settings that change acceptance, for statistics keys."""
        parts = [f"repetition_penalty={self.penalty:g}" if self.penalty is not None else "",
                 f"no_repeat_ngram_size={self.ngram_size}" if self.ngram_size else "",
                 f"min_length={self.min_length}" if self.min_length else "",
                 "suppress_tokens" if self.suppress is not None else "",
                 "begin_suppress_tokens" if self.begin_suppress is not None else ""]
        return " ".join(part for part in parts if part)

    def __call__(self, contexts: Contexts, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        if self.penalty is not None:
            scores = repetition_penalty(contexts, scores, self.penalty)
        if self.ngram_size:
            scores = no_repeat_ngram(contexts, scores, self.ngram_size)
        if self.min_length:
            scores = ban_where(scores, contexts.lengths < self.min_length, self.eos)
        if self.suppress is not None:
            scores = ban_where(scores, torch.ones_like(contexts.lengths, dtype=torch.bool), self.suppress)
        if self.begin_suppress is not None:
            scores = ban_where(scores, contexts.lengths == self.begin_index, self.begin_suppress)
        return scores


def context_processors(config, eos_token_ids, prompt_width: int) -> GenerateProcessors | None:
    """The call's context-dependent processors, or None when no field asks for one (the loop then
    runs untouched)."""
    processors = GenerateProcessors(config, eos_token_ids, prompt_width)
    return processors if processors.active else None


def _ids(value) -> frozenset[int]:
    return frozenset(torch.as_tensor(value).flatten().tolist())


def custom_processors(processors, config, eos_token_ids, prompt_width: int) -> None:
    """Honour ``generate(logits_processor=...)``: each processor that one of :data:`FIELDS` builds is
    written into ``config`` as that field (a custom processor replaces the field's processor of its
    own class, as in ``generate``; minimum lengths of both classes combine into ``min_length``); any
    other processor, or one whose parameters no field expresses, is a NotImplementedError naming it.
    ``None`` and an empty list change nothing."""
    if processors is None:
        return
    if isinstance(processors, (str, bytes)) or not hasattr(processors, "__iter__"):
        raise TypeError(f"logits_processor must be a LogitsProcessorList (or a list of processors); got "
                        f"{type(processors).__name__}")
    eos = frozenset(eos_token_ids)
    # generate's own minimum-length processors: MinLength at min_length (prompt + min_new_tokens when
    # that is set), MinNewTokensLength at prompt + min_new_tokens; a custom one replaces its own kind only
    minimum = {"length": (config.min_new_tokens + prompt_width if config.min_new_tokens is not None
                          else config.min_length or 0),
               "new": prompt_width + config.min_new_tokens if config.min_new_tokens is not None else 0}
    custom_minimum = False
    for processor in processors:
        name = type(processor).__name__
        reason = None
        if type(processor) is NoRepeatNGramLogitsProcessor:
            config.no_repeat_ngram_size = int(processor.ngram_size)
        elif type(processor) is SuppressTokensLogitsProcessor:
            config.suppress_tokens = sorted(_ids(processor.suppress_tokens))
        elif type(processor) is MinLengthLogitsProcessor:
            if _ids(processor.eos_token_id) != eos:
                reason = "its eos ids differ from the call's eos_token_id; set min_length= instead"
            minimum["length"], custom_minimum = int(processor.min_length), True
        elif type(processor) is MinNewTokensLengthLogitsProcessor:
            if _ids(processor.eos_token_id) != eos or processor.prompt_length_to_skip != prompt_width:
                reason = "its eos ids or prompt length differ from the call's; set min_new_tokens= instead"
            minimum["new"], custom_minimum = prompt_width + int(processor.min_new_tokens), True
        elif type(processor) is SuppressTokensAtBeginLogitsProcessor:
            if processor.begin_index != prompt_width:
                reason = f"its begin_index is not the prompt width {prompt_width}; set begin_suppress_tokens= instead"
            config.begin_suppress_tokens = sorted(_ids(processor.begin_suppress_tokens))
        elif type(processor) is RepetitionPenaltyLogitsProcessor:
            reason = "set repetition_penalty= instead (applied per drafted node, each row's padding skipped)"
        else:
            reason = ("speculative decoding applies only the processors of repetition_penalty, no_repeat_ngram_size, "
                      "min_length, min_new_tokens, suppress_tokens and begin_suppress_tokens to drafted nodes; use "
                      "model.generate")
        if reason is not None:
            raise NotImplementedError(f"logits_processor: {name} is not supported: {reason}")
    if custom_minimum:  # both kinds ban the same eos ids: together, below the larger length
        config.min_new_tokens, config.min_length = None, max(minimum.values())
