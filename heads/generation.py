"""Generation settings for ``SpeculativeModel.generate``: validate them, resolve unset values the way
``model.generate`` does, and build the acceptance rule.

Sampling uses transformers' own warpers (temperature, top-k, top-p) in ``generate``'s order, so
the speculative output follows exactly the distribution ``model.generate(do_sample=True, ...)``
samples from. Unset ``top_k``/``top_p`` come from the model's ``generation_config``, then from
transformers' defaults (``top_k=50``, ``top_p=1.0``), as in ``generate``. Logits processors that
depend on the context (repetition penalty, n-gram bans, forced or suppressed tokens, minimum
lengths) are applied per tree node with that node's own sequence (:mod:`heads.processors`): the
repetition penalty, n-gram bans, minimum lengths and suppressed tokens; the others (forced tokens,
bad words, sequence bias, ...) are refused rather than ignored: ignoring them would change the output.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from tree_attention.gumbel import GumbelRule
from tree_attention.verify import AcceptanceRule, GreedyRule, SamplingRule, TypicalRule

ACCEPTANCE = ("auto", "greedy", "sample", "typical")
_DEFAULT_TOP_K = 50  # transformers' default when neither the call nor the model sets it
# generation_config fields whose processors speculative decoding does not reproduce, with neutral values
_UNSUPPORTED = {
    "bad_words_ids": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,), "min_p": (None,),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "top_h": (None,),
    "encoder_repetition_penalty": (None, 1.0), "renormalize_logits": (None, False),
}


# Every GenerationConfig field, and what ``SpeculativeModel.generate`` does with it. A field missing
# here (a new transformers version) fails tests/heads/test_generation_contract.py.
HONOURED = frozenset({
    "do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "max_length", "eos_token_id", "pad_token_id",
    "max_time",
    # context-dependent processors, applied to every tree node with its own sequence (heads/processors.py)
    "repetition_penalty", "no_repeat_ngram_size", "min_length", "min_new_tokens", "suppress_tokens",
    "begin_suppress_tokens",
})
NO_EFFECT = frozenset({
    # metadata and execution settings that do not change which tokens come out
    "_from_model_config", "transformers_version", "use_cache", "cache_implementation", "cache_config",
    "max_cache_len", "compile_config", "disable_compile", "prefill_chunk_size", "continuous_batching_config",
    "low_memory", "bos_token_id",  # bos only starts generation from nothing; input_ids are required here
    "decoder_start_token_id",  # encoder-decoder models only (refused at attach time)
    "length_penalty", "early_stopping",  # beam search only, and num_beams must be 1
    # other speculative methods' speed settings: outputs are the target's either way
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
})
NEUTRAL = {
    # field: values that leave the output unchanged (refused by name otherwise)
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0), "penalty_alpha": (None,),
    "num_return_sequences": (None, 1), "constraints": (None,), "force_words_ids": (None,), "dola_layers": (None,),
    "output_attentions": (None, False), "output_hidden_states": (None, False), "output_scores": (None, False),
    "output_logits": (None, False), "return_dict_in_generate": (None, False), "token_healing": (None, False),
    "remove_invalid_values": (None, False), "encoder_no_repeat_ngram_size": (None, 0), "stop_strings": (None,),
    "assistant_early_exit": (None,), "is_assistant": (None, False), "assistant_ensemble_weight": (None,),
    "speculation_type": (None,), "use_mtp": (None, False),
    **_UNSUPPORTED,
}


def check_generation_config(generation_config) -> None:
    """Refuse, by name, every field whose effect speculative decoding does not reproduce."""
    for name, neutral in NEUTRAL.items():
        value = getattr(generation_config, name, None)
        if isinstance(value, (list, dict)) and not value:
            value = None
        if value not in neutral:
            raise NotImplementedError(
                f"generation_config.{name}={value!r}: speculative decoding does not reproduce this setting; "
                f"set it to {neutral[-1]!r} to generate speculatively (or use model.generate)"
            )


@dataclass
class GenerationSettings:
    """One ``generate`` call's resolved settings."""

    config: GenerationConfig
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    pad_token_id: int | None


def _eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return frozenset([int(eos)] if isinstance(eos, int) else [int(token) for token in eos])


def resolve_generation(base: GenerationConfig, generation_config: GenerationConfig | None, overrides: dict,
                       prompt_length: int) -> GenerationSettings:
    """The settings ``model.generate`` would run with: ``generation_config`` (else the model's),
    updated with the call's keyword overrides (``None`` values mean unset). Unknown keywords are a
    TypeError; fields speculative decoding cannot reproduce a NotImplementedError naming them."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig; got "
                        f"{type(generation_config).__name__}")
    config = copy.deepcopy(generation_config if generation_config is not None else base)
    given = {name: value for name, value in overrides.items() if value is not None}
    known = set(config.to_dict()) | HONOURED | NO_EFFECT | set(NEUTRAL)
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s) {unknown}: neither generate options nor "
                        "GenerationConfig fields")
    for name, value in given.items():
        setattr(config, name, value)
    check_generation_config(config)
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = (config.max_length if config.max_length is not None else 20) - prompt_length
        if max_new <= 0:
            raise ValueError(f"the prompt ({prompt_length} tokens) is as long as max_length ({config.max_length}): "
                             "set max_new_tokens")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int; got {max_new!r}")
    eos = _eos_set(config.eos_token_id)
    pad = config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.item()
    if pad is None and eos:
        eos_list = config.eos_token_id.tolist() if isinstance(config.eos_token_id, torch.Tensor) else config.eos_token_id
        pad = eos_list if isinstance(eos_list, int) else eos_list[0]
    return GenerationSettings(config, int(max_new), eos, None if pad is None else int(pad))


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
        # each warper called directly: LogitsProcessorList.__call__ inspects every processor's
        # signature on every call (tens of microseconds a step); warpers take (input_ids, scores)
        for processor in processors:
            logits = processor(no_ids, logits)
        return logits

    return warp


def check_seed(seed, generator: torch.Generator | None) -> int | list[int] | None:
    """A sampled call's ``seed``: None, an int, or a non-empty list of ints (one per row); never
    given with ``generator`` (which seeds the unseeded rule's draws instead)."""
    if seed is None:
        return None
    if generator is not None:
        raise ValueError("give seed= (output a function of prompt, settings and seed, whatever drafts) or "
                         "generator= (draws of the speculative sampling rule), not both")
    def integer(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if integer(seed):
        return int(seed)
    if isinstance(seed, (list, tuple)) and seed and all(integer(value) for value in seed):
        return [int(value) for value in seed]
    raise TypeError(f"seed must be an int or a non-empty list of ints (one per row); got {seed!r}")


def acceptance_rule(generation_config, do_sample: bool, temperature: float, top_k: int | None,
                    top_p: float | None, generator: torch.Generator | None, acceptance: str = "auto",
                    posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, seed=None) -> AcceptanceRule:
    """The rule ``generate`` runs with. ``acceptance="typical"`` is lossy and must be asked for.
    Unset ``temperature`` (None) resolves to 1.0, as in ``generate``. With ``seed``, sampling is
    Gumbel-max on a counter-based stream (:class:`~tree_attention.gumbel.GumbelRule`: the output
    depends on the prompt, the settings and the seed alone); otherwise lossless speculative sampling
    (:class:`SamplingRule`, its draws from ``generator`` or torch's global RNG)."""
    temperature = 1.0 if temperature is None else temperature
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
    seed = check_seed(seed, generator)
    if acceptance == "typical" and seed is not None:
        raise ValueError("seed= selects seeded Gumbel-max sampling, which acceptance='typical' does not use; "
                         "seed typical acceptance with generator=")
    if acceptance == "typical":
        rule = TypicalRule(warp, generator, posterior_threshold, posterior_alpha)
    elif seed is not None:
        rule = GumbelRule(warp, seed)
    else:
        rule = SamplingRule(warp, generator)
    rule.key = f"{rule.key} T={settings[0]:g} top_k={settings[1]} top_p={settings[2]:g}"
    if acceptance == "typical":
        rule.key += f" threshold={posterior_threshold:g} alpha={posterior_alpha:g}"
    return rule
