"""A lookup corpus from the target's own outputs: what it writes after a set of prompts.

Lookup drafting proposes what followed the current text's suffix elsewhere, so the best corpus is
text the target itself would write: its greedy continuations of prompts like the traffic it will
serve (SuffixDecoding's global tree of earlier responses, built ahead of time). The continuations
are generated with the lookup kind over the corpus grown so far, which is lossless: the text is
exactly what ``model.generate(do_sample=False)`` writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from .files import write_file_atomically


def target_corpus(model, prompts: Sequence[torch.Tensor], max_new_tokens: int, tree: int = 16,
                  progress=None) -> tuple[list[list[int]], dict]:
    """Token ids (prompt + greedy continuation) per prompt (``[1, L]`` each), and timing facts."""
    import heads

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
    spec = heads.attach_heads(model, kind="lookup", tree=tree)  # its history holds every earlier output
    sequences, started, new = [], time.perf_counter(), 0
    for number, prompt in enumerate(prompts):
        output = spec.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
        sequences.append(output[0].tolist())
        new += output.shape[1] - prompt.shape[1]
        if progress is not None:
            progress(number + 1, len(prompts))
    seconds = time.perf_counter() - started
    return sequences, {"prompts": len(sequences), "new_tokens": new, "seconds": seconds}


def write_corpus(path: str | Path, texts: Sequence[str]) -> Path:
    """``texts`` as jsonl ``{"text": ...}`` records (what ``--lookup-corpus`` reads), written atomically."""
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    return write_file_atomically(path, lambda temporary: temporary.write_text(lines, encoding="utf-8"))
