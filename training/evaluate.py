"""Side-by-side measurement of speculative and plain generation on the same prompts.

:func:`paired_runs` is the one measurement loop: every method generates on every batch in one
process, the order rotated by one per batch, so that machine noise hits every method alike. It is
used by ``selfdraft bench``/``check``/``select``, the trainer's final evaluation, the demo and the
benchmark harness (``benchmarks/run.py``); :func:`measure` is its two-method form (an adapter
against ``model.generate``) with per-prompt ratios and medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from tree_attention.decode import DecodeStats

Batch = tuple[torch.Tensor, "torch.Tensor | None"]
"""``input_ids [B, T]`` and its ``attention_mask [B, T]`` (None: no padding), left-padded."""
Method = Callable[[torch.Tensor, "torch.Tensor | None", int], tuple[torch.Tensor, object]]
"""``(input_ids, attention_mask, max_new_tokens) -> (output [B, T + new], DecodeStats or None)``."""


@dataclass
class Run:
    """One timed call of one method on one batch."""

    seconds: float
    output: torch.Tensor  # [B, T + new]
    new_tokens: int  # new tokens over the batch's rows, padding after an eos not counted
    steps: int  # new positions per row (output width - prompt width)
    stats: object | None = None  # the call's DecodeStats (speculative methods), None for plain generate


@torch.no_grad()
def paired_runs(methods: Mapping[str, Method], batches: Sequence[Batch], max_new_tokens: int, *,
                repeats: int = 1, warmup: Batch | None = None, warmup_tokens: int = 4, seed: int = 0,
                pad_token_id: int | None = None) -> dict[str, list[Run]]:
    """Run every method on every batch: ``{name: [Run per batch]}``.

    Batch ``i`` runs the methods in their given order rotated by ``i``; torch's global RNG is seeded
    with ``seed * 1000 + i`` before each call, so sampling methods draw from the same stream on a
    batch. With ``repeats`` > 1 the batch's rotation runs that many times and each method's fastest
    call counts (load on a shared machine only ever adds time); output and stats are the first
    call's. ``warmup``: a batch every method runs once on first (``warmup_tokens`` new tokens), so
    that one-time costs stay out of the timings.
    """
    names = list(methods)
    if warmup is not None:
        for name in names:
            methods[name](warmup[0], warmup[1], warmup_tokens)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for index, (ids, mask) in enumerate(batches):
        order = names[index % len(names):] + names[:index % len(names)]
        for repeat in range(repeats):
            for name in order:
                torch.manual_seed(seed * 1000 + index)
                start = time.perf_counter()
                output, stats = methods[name](ids, mask, max_new_tokens)
                seconds = time.perf_counter() - start
                if repeat:
                    runs[name][-1].seconds = min(runs[name][-1].seconds, seconds)
                    continue
                new = output[:, ids.shape[1]:]
                count = int((new != pad_token_id).sum()) if pad_token_id is not None else new.numel()
                runs[name].append(Run(seconds, output, count, new.shape[1], stats))
    return runs


@dataclass
class SpeedReport:
    """``tau`` counts tokens committed per target forward, bonus token included (prefill too)."""

    prompts: int = 0
    new_tokens: int = 0
    tokens_per_s_plain: float = 0.0
    tokens_per_s_spec: float = 0.0
    speedup: float = 0.0
    speedups: list[float] = field(default_factory=list)
    tau: float = 0.0
    acceptance_by_position: list[float] = field(default_factory=list)
    prefix_survival: list[float] = field(default_factory=list)
    """``P(accepted >= k)`` per depth ``k = 1..``, over all verify steps (= ``acceptance_by_position``)."""
    conditional_acceptance: list[float | None] = field(default_factory=list)
    """``P(accept at k | accepted k - 1)`` per depth (None where no step accepted ``k - 1``)."""
    identical: bool = True
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    spec_seconds: float = 0.0
    plain_seconds: float = 0.0
    tree_size: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def acceptance_by_position(stats: Sequence) -> list[float]:
    """Share of all verify steps of ``stats`` (DecodeStats) that accepted at least ``i + 1`` drafted
    tokens, per depth ``i``: each call's rates weighted by its steps."""
    steps_and_rates = [(len(s.accepted_lengths), s.acceptance_by_position) for s in stats]
    depth = max((len(rates) for _, rates in steps_and_rates), default=0)
    total_steps = sum(steps for steps, _ in steps_and_rates)
    if not total_steps:
        return [0.0] * depth
    return [
        sum(steps * (rates[i] if i < len(rates) else 0.0) for steps, rates in steps_and_rates) / total_steps
        for i in range(depth)
    ]


def sampling_settings(temperature: float) -> dict:
    """``generate`` keywords of greedy decoding (0) or sampling at ``temperature`` with no top-k/top-p."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False)


def plain_method(model, temperature: float, pad_token_id: int | None = None) -> Method:
    """``model.generate`` as a :data:`Method`."""
    settings = sampling_settings(temperature)
    pad = {} if pad_token_id is None else {"pad_token_id": pad_token_id}  # None: the model's own setting

    def run(ids, mask, new):
        if mask is None:
            mask = torch.ones_like(ids)
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, **pad, **settings), None
    return run


def spec_method(spec, temperature: float, speculate: str | None = None, pad_token_id: int | None = None) -> Method:
    """``spec.generate`` as a :data:`Method` (``speculate``: None for the fixed tree, or "auto")."""
    settings = sampling_settings(temperature)
    if pad_token_id is not None:
        settings["pad_token_id"] = pad_token_id

    def run(ids, mask, new):
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=new, speculate=speculate, **settings)
        return output, spec.last_stats
    return run


def measure(spec, prompts: Sequence[torch.Tensor], max_new_tokens: int, plain: bool = True,
            warmup: bool = True, temperature: float = 0.0, seed: int = 0) -> SpeedReport:
    """Generation of ``max_new_tokens`` per prompt (``[1, T]`` each), speculative and (optionally)
    plain, paired per prompt by :func:`paired_runs`.

    ``temperature`` 0 is greedy (and ``identical`` checks the outputs token by token); above 0
    both sides sample at that temperature with no top-k/top-p (``identical`` is then not checked:
    lossless sampling is tested statistically, not per sample).
    """
    report = SpeedReport(prompts=len(prompts))
    methods = {"spec": spec_method(spec, temperature)}
    if plain:
        methods["plain"] = plain_method(spec.backbone, temperature)
    batches = [(prompt, None) for prompt in prompts]
    runs = paired_runs(methods, batches, max_new_tokens, warmup=batches[0] if warmup and batches else None,
                       seed=seed)
    spec_runs = runs["spec"]
    stats = [run.stats for run in spec_runs]
    report.new_tokens = sum(run.steps for run in spec_runs)
    forwards = sum(s.target_forwards for s in stats)
    report.draft_seconds = sum(s.draft_seconds for s in stats)
    report.verify_seconds = sum(s.verify_seconds for s in stats)
    report.spec_seconds = sum(run.seconds for run in spec_runs)
    report.tree_size = max((s.tree_size for s in stats), default=0)
    report.tau = report.new_tokens / forwards if forwards else 0.0
    report.acceptance_by_position = acceptance_by_position(stats)
    report.prefix_survival = list(report.acceptance_by_position)
    report.conditional_acceptance = DecodeStats.conditional_rates(report.prefix_survival)
    report.tokens_per_s_spec = statistics.median(run.steps / run.seconds for run in spec_runs) if spec_runs else 0.0
    if plain and spec_runs:
        plain_runs = runs["plain"]
        report.plain_seconds = sum(run.seconds for run in plain_runs)
        report.tokens_per_s_plain = statistics.median(run.steps / run.seconds for run in plain_runs)
        report.speedups = [p.seconds / s.seconds * s.steps / max(1, p.steps) for p, s in zip(plain_runs, spec_runs)]
        report.speedup = statistics.median(report.speedups)
        if temperature <= 0:
            report.identical = all(torch.equal(p.output, s.output) for p, s in zip(plain_runs, spec_runs))
    return report


def encode_batches(tokenizer, texts: Sequence[str], size: int) -> list[Batch]:
    """Left-padded ``(input_ids [B, T], attention_mask [B, T])`` batches of ``size`` prompt texts (the
    last one shorter when ``size`` does not divide their number)."""
    from .prompts import tokenizer_pad_id

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token_id = tokenizer_pad_id(tokenizer)
    encoded = []
    for start in range(0, len(texts), size):
        batch = tokenizer(list(texts[start:start + size]), return_tensors="pt", padding=True)
        encoded.append((batch.input_ids, batch.attention_mask))
    return encoded


def encode_prompts(tokenizer, prompts: Sequence[str], limit: int | None = None) -> list[torch.Tensor]:
    """Token ids ``[1, L]`` per prompt text (at most ``limit`` prompts, None: all; empty encodings
    dropped). A chat template's own BOS is not doubled (:func:`training.prompts.encode_text`)."""
    from .prompts import encode_text

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or >= 1; got {limit!r}")
    encoded = []
    for text in prompts[:limit]:
        ids = encode_text(tokenizer, text)
        if ids.numel():
            encoded.append(ids[None])
    return encoded
