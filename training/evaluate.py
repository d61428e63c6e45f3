"""Side-by-side measurement of speculative and plain generation on the same prompts.

Used by ``selfdraft bench``/``check``, the trainer's final evaluation, the demo and the benchmark
scripts. Plain and speculative runs alternate prompt by prompt in one process, so machine noise
hits both alike; per-prompt ratios and medians are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch


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
    identical: bool = True
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    spec_seconds: float = 0.0
    plain_seconds: float = 0.0
    tree_size: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _acceptance(steps_and_rates: list[tuple[int, list[float]]]) -> list[float]:
    depth = max((len(rates) for _, rates in steps_and_rates), default=0)
    total_steps = sum(steps for steps, _ in steps_and_rates)
    if not total_steps:
        return [0.0] * depth
    return [
        sum(steps * (rates[i] if i < len(rates) else 0.0) for steps, rates in steps_and_rates) / total_steps
        for i in range(depth)
    ]


@torch.no_grad()
def measure(spec, prompts: Sequence[torch.Tensor], max_new_tokens: int, plain: bool = True,
            warmup: bool = True, temperature: float = 0.0, seed: int = 0) -> SpeedReport:
    """Generation of ``max_new_tokens`` per prompt, speculative and (optionally) plain.

    ``temperature`` 0 is greedy (and ``identical`` checks the outputs token by token); above 0
    both sides sample at that temperature with no top-k/top-p (``identical`` is then not checked:
    lossless sampling is tested statistically, not per sample).
    """
    model = spec.backbone
    report = SpeedReport(prompts=len(prompts))
    sampled = temperature > 0
    settings = dict(do_sample=sampled, temperature=temperature if sampled else 1.0, top_k=0 if sampled else None)
    plain_settings = dict(do_sample=True, temperature=temperature, top_k=0) if sampled else dict(do_sample=False)
    generator = torch.Generator(device=spec.target.device).manual_seed(seed)
    if warmup and prompts:
        spec.generate(prompts[0], max_new_tokens=4, **settings)
        if plain:
            model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), max_new_tokens=4, **plain_settings)
    spec_rates, plain_rates, acceptance = [], [], []
    forwards = 0
    for prompt in prompts:
        start = time.perf_counter()
        output = spec.generate(prompt, max_new_tokens=max_new_tokens, generator=generator if sampled else None,
                               **settings)
        spec_time = time.perf_counter() - start
        stats = spec.last_stats
        new = output.shape[1] - prompt.shape[1]
        report.new_tokens += new
        forwards += stats.target_forwards
        acceptance.append((len(stats.accepted_lengths), stats.acceptance_by_position))
        report.draft_seconds += stats.draft_seconds
        report.verify_seconds += stats.verify_seconds
        report.spec_seconds += spec_time
        report.tree_size = max(report.tree_size, stats.tree_size)
        spec_rates.append(new / spec_time)
        if plain:
            start = time.perf_counter()
            reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                       **plain_settings)
            plain_time = time.perf_counter() - start
            report.plain_seconds += plain_time
            plain_rates.append((reference.shape[1] - prompt.shape[1]) / plain_time)
            if not sampled:
                report.identical &= bool(torch.equal(reference, output))
            report.speedups.append(plain_time / spec_time * new / max(1, reference.shape[1] - prompt.shape[1]))
    report.tau = report.new_tokens / forwards if forwards else 0.0
    report.acceptance_by_position = _acceptance(acceptance)
    report.tokens_per_s_spec = statistics.median(spec_rates) if spec_rates else 0.0
    if plain:
        report.tokens_per_s_plain = statistics.median(plain_rates)
        report.speedup = statistics.median(report.speedups)
    return report


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
