"""Generation settings for ``SpeculativeModel.generate``: validate them, resolve unset values the way
``model.generate`` does, and build the acceptance rule.

Sampling uses transformers' own warpers (temperature, top-k, top-p) in ``generate``'s order, so
the speculative output follows exactly the distribution ``model.generate(do_sample=True, ...)``
samples from. Unset ``top_k``/``top_p`` come from the model's ``generation_config``, then from
transformers' defaults (``top_k=50``, ``top_p=1.0``), as in ``generate``. Logits processors that
depend on the context (repetition penalty, n-gram bans, forced or suppressed tokens, minimum
lengths) are refused rather than ignored: ignoring them would change the output.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from tree_attention.verify import AcceptanceRule, GreedyRule, SamplingRule, TypicalRule

ACCEPTANCE = ("auto", "greedy", "sample", "typical")
_DEFAULT_TOP_K = 50  # transformers' default when neither the call nor the model sets it
# generation_config fields whose processors speculative decoding does not reproduce, with neutral values
_UNSUPPORTED = {
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "sequence_bias": (None,), "exponential_decay_length_penalty": (None,), "min_p": (None,),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "top_h": (None,),
    "encoder_repetition_penalty": (None, 1.0), "renormalize_logits": (None, False),
}


def check_generation_config(generation_config) -> None:
    """Refuse context-dependent processors set in the model's ``generation_config``."""
    for name, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, name, None)
        if value not in neutral:
            raise NotImplementedError(
                f"generation_config.{name}={value!r}: speculative decoding does not apply this logits processor; "
                f"set it to {neutral[-1]!r} (on model.generation_config) to generate speculatively"
            )


def resolve_sampling(generation_config, temperature: float, top_k: int | None, top_p: float | None):
    """Validated ``(temperature, top_k, top_p)`` with unset values resolved as ``generate`` does."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0 when do_sample=True; got {temperature!r}")
    if top_k is None:
        top_k = generation_config.top_k if getattr(generation_config, "top_k", None) is not None else _DEFAULT_TOP_K
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: no top-k filtering); got {top_k!r}")
    if top_p is None:
        top_p = generation_config.top_p if getattr(generation_config, "top_p", None) is not None else 1.0
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")
    return float(temperature), int(top_k), float(top_p)


def warper(temperature: float, top_k: int, top_p: float):
    """Logits ``[N, V]`` → warped logits, with transformers' warpers in ``generate``'s order."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        processors.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    no_ids = torch.empty(0, dtype=torch.long)

    def warp(logits: torch.Tensor) -> torch.Tensor:
        return processors(no_ids, logits)

    return warp


def acceptance_rule(generation_config, do_sample: bool, temperature: float, top_k: int | None,
                    top_p: float | None, generator: torch.Generator | None, acceptance: str = "auto",
                    posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> AcceptanceRule:
    """The rule ``generate`` runs with. ``acceptance="typical"`` is lossy and must be asked for."""
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE}; got {acceptance!r}")
    check_generation_config(generation_config)
    if not do_sample:
        if acceptance not in ("auto", "greedy"):
            raise ValueError(f"acceptance={acceptance!r} needs do_sample=True")
        return GreedyRule()
    if acceptance == "greedy":
        raise ValueError("acceptance='greedy' contradicts do_sample=True")
    settings = resolve_sampling(generation_config, temperature, top_k, top_p)
    warp = warper(*settings)
    if acceptance == "typical":
        rule = TypicalRule(warp, generator, posterior_threshold, posterior_alpha)
    else:
        rule = SamplingRule(warp, generator)
    rule.key = f"{rule.key} T={settings[0]:g} top_k={settings[1]} top_p={settings[2]:g}"
    if acceptance == "typical":
        rule.key += f" threshold={posterior_threshold:g} alpha={posterior_alpha:g}"
    return rule
