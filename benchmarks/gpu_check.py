"""The device-machine check (one run of at most 8 minutes; see benchmarks/gpu_check.sh).

1. Verify cost on random-weight Llama configs of about 1B and 8B parameters in bf16: one forward of
   N = 1, 2, 4, ..., 64 new tokens on a 512-token cache (CUDA-synchronised medians), relative to N = 1.
2. Loop overhead: ``spec.generate`` with a one-node tree over ``model.generate``, greedy, on the 1B config.
(``gpu_check.sh`` then runs ``python -m benchmarks.run peers --quick`` on stories260K.)

Each part has a time budget and is skipped with a note when the budget is spent; results go to
``$OUT/gpu_check.json`` (or ``benchmarks/results/gpu_check.json``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from tree_attention import cache as cache_ops  # noqa: E402
from tree_attention.mask import additive_mask, prefill_attention_mask  # noqa: E402

CONFIGS = {
    "llama-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8),
    "llama-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS[name], max_position_embeddings=4096)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def verify_curve(model, prefix: int = 512, repeats: int = 10) -> dict:
    target = heads.inspect_backbone(model)
    device = target.device
    prompt = torch.randint(0, target.vocab_size, (1, prefix), device=device)
    cache = cache_ops.new_cache()
    target.forward(prompt, torch.arange(prefix, device=device)[None],
                   prefill_attention_mask(prefix, target.layout, target.dtype, device), cache, "last")
    result = {}
    for size in SIZES:
        tokens = torch.randint(0, target.vocab_size, (1, size), device=device)
        positions = torch.arange(prefix, prefix + size, device=device)[None]
        visible = torch.ones(1, size, prefix + size, dtype=torch.bool, device=device).tril_(prefix)
        mask = additive_mask(visible, target.dtype)
        times = []
        for _ in range(repeats + 2):
            sync()
            start = time.perf_counter()
            target.forward(tokens, positions, mask, cache, "all")
            sync()
            times.append(time.perf_counter() - start)
            cache_ops.crop(cache, prefix)
        result[size] = 1000 * statistics.median(times[2:])
    return {"one_token_ms": result[1], "ms": result, "relative": {n: t / result[1] for n, t in result.items()}}


@torch.no_grad()
def loop_overhead(model, new_tokens: int = 64) -> dict:
    spec = heads.attach_heads(model, tree=0)
    device = next(model.parameters()).device
    ratios = []
    for length in (64, 256):
        prompt = torch.randint(0, model.config.vocab_size, (1, length), device=device)

        def timed(function):
            function()
            sync()
            start = time.perf_counter()
            function()
            sync()
            return time.perf_counter() - start

        plain = timed(lambda: model.generate(prompt, do_sample=False, max_new_tokens=new_tokens))
        ours = timed(lambda: spec.generate(prompt, max_new_tokens=new_tokens))
        ratios.append(ours / plain)
    return {"ratio_median": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + float(os.environ.get("GPU_CHECK_SECONDS", "420"))
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
    import transformers

    report["transformers"] = transformers.__version__
    for name in CONFIGS:
        if time.time() > deadline - 60:
            report[name] = "skipped: time budget spent"
            continue
        model = build(name)
        report[name] = {"verify": verify_curve(model)}
        if name == "llama-1B":
            report[name]["overhead"] = loop_overhead(model)
        print(name, json.dumps(report[name]), flush=True)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
