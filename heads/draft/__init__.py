"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a separate small
causal LM that shares the target's tokenizer drafts chains or dynamic trees (EAGLE-2-style
top-k expansion with a node budget, scored by the draft's log-probabilities). Registered as
``KIND`` (see :mod:`heads.kinds`).

    spec = heads.attach_heads(model, kind="draft", draft_model=small)   # chains of up to 8, length per step
    spec = heads.attach_heads(model, kind="draft", draft_model=small, depth=4, adaptive=False)  # a fixed chain of 4
    spec = heads.attach_heads(model, kind="draft", draft_model=small, depth=5, top_k=2, total_tokens=8)
    spec = heads.attach_heads(model, kind="draft", draft_model=small, depth=8, adaptive=False, confidence=0.4)
    spec = heads.attach_heads(model, kind="draft", draft_model=small, tokenizer=tok, draft_tokenizer=small_tok)
    spec = heads.attach_heads(model, kind="draft", draft_model="path/to/small")     # loaded in the target's dtype

By default a chain's length (and whether a step drafts at all) comes from the draft's confidence
calibrated online against what the target accepts and the measured cost of a draft forward
(:mod:`heads.draft.calibration`; docs/draft.md).

Distillation (DistillSpec; ``selfdraft train --kind draft --draft DIR``) trains the draft model itself,
every weight or a peft LoRA (:mod:`heads.draft.loss`); ``spec.save_pretrained(dir)`` writes the
selfdraft ``adapter_config.json`` (the target pin) beside the draft in ``draft_model/``
(``save_pretrained``) or its LoRA in ``draft_lora/`` (peft's layout), and ``heads.load_heads``
reads it back (:mod:`heads.draft.adapter`).
"""

from __future__ import annotations

from ..lazy import entry_names
from . import cli  # the kind's `selfdraft train` flags, importable without torch

FORMAT_NAMES = ()
"""The other projects' checkpoint layouts ``selfdraft export --format`` writes for this kind (the names
of ``KIND.formats``, checked by a test), listed without torch."""


def _entry():
    from . import entry

    return entry


__getattr__ = entry_names(__name__, _entry)  # ``KIND`` and the kind's public names (:mod:`.entry`), loaded on first use
