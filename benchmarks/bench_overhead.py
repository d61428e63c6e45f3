"""Loop overhead and verification cost on this machine.

1. Overhead: ``spec.generate`` with a one-node tree (no speculation) against ``model.generate``,
   greedy, same prompts, same process; the ratio is the decode loop's own cost (goal <= 1.10).
2. Verification cost: one forward over a tree of N nodes on top of a 256-token cache, relative to a
   one-token decode step, for a tiny model and a ~110M-parameter random Llama. This curve bounds
   every speedup: speedup <= tau x cost(1) / (cost(verify N) + cost(draft)).

Writes ``benchmarks/results/overhead.json`` and prints tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import heads  # noqa: E402
from benchmarks.common import median_seconds, table, write_json  # noqa: E402
from tree_attention import cache as cache_ops  # noqa: E402
from tree_attention.mask import prefill_attention_mask, tree_attention_mask, tree_position_ids  # noqa: E402
from tree_attention.tree import default_tree  # noqa: E402

MODELS = {
    "tiny-0.3M": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4),
    "llama-110M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12),
}
TREE_SIZES = (1, 4, 16, 64, 128)


def build(name: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[name], max_position_embeddings=2048)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def overhead(model, prompts: list[torch.Tensor], new_tokens: int, repeats: int) -> dict:
    spec = heads.attach_heads(model, tree=0)
    ratios, plain_times, spec_times = [], [], []
    for prompt in prompts:
        mask = torch.ones_like(prompt)
        plain = median_seconds(lambda: model.generate(prompt, attention_mask=mask, do_sample=False,
                                                      max_new_tokens=new_tokens), repeats)
        speculative = median_seconds(lambda: spec.generate(prompt, max_new_tokens=new_tokens), repeats)
        assert torch.equal(spec.generate(prompt, max_new_tokens=new_tokens),
                           model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens))
        plain_times.append(plain)
        spec_times.append(speculative)
        ratios.append(speculative / plain)
    return {
        "new_tokens": new_tokens, "prompts": len(prompts),
        "plain_ms_per_token": 1000 * statistics.median(plain_times) / new_tokens,
        "spec_ms_per_token": 1000 * statistics.median(spec_times) / new_tokens,
        "ratio_median": statistics.median(ratios), "ratios": ratios,
    }


@torch.no_grad()
def verify_cost(model, prefix_length: int, repeats: int) -> dict:
    target = heads.inspect_backbone(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, prefix_length))
    cache = cache_ops.new_cache()
    target.forward(prompt, torch.arange(prefix_length)[None],
                   prefill_attention_mask(prefix_length, target.layout, target.dtype, "cpu"), cache, "last")
    times = {}
    for size in TREE_SIZES:
        tree = default_tree(size - 1, 5).with_tokens(torch.randint(0, model.config.vocab_size, (size,)))

        def step():
            mask = tree_attention_mask(prefix_length, tree.ancestors, tree.depths, target.layout, target.dtype)
            target.forward(tree.tokens[None], tree_position_ids(prefix_length, tree.depths), mask, cache, "all")
            cache_ops.crop(cache, prefix_length)

        times[size] = median_seconds(step, repeats, warmup=2)
    return {
        "prefix_length": prefix_length, "one_token_ms": 1000 * times[1],
        "relative": {str(size): times[size] / times[1] for size in TREE_SIZES},
        "ms": {str(size): 1000 * t for size, t in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--prompts", type=int, default=5, help="prompts for the overhead ratio")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "overhead": {}, "verify_cost": {}}
    for name in args.models:
        model = build(name)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, model.config.vocab_size, (1, 16 + 8 * i), generator=generator)
                   for i in range(args.prompts)]
        repeats = args.repeats if name.startswith("tiny") else max(1, args.repeats // 2)
        results["overhead"][name] = overhead(model, prompts, args.new_tokens, repeats)
        results["verify_cost"][name] = verify_cost(model, 256, args.repeats)
        print(f"{name}: overhead ratio (one-node tree / model.generate) median "
              f"{results['overhead'][name]['ratio_median']:.3f}", flush=True)
    rows = [{"model": name, **{f"N={k}": v for k, v in cost["relative"].items()},
             "1-token ms": cost["one_token_ms"]} for name, cost in results["verify_cost"].items()]
    print("\nverification cost relative to a one-token step (256-token cache):")
    print(table(rows, ["model", "1-token ms"] + [f"N={n}" for n in TREE_SIZES]))
    rows = [{"model": name, **o} for name, o in results["overhead"].items()]
    print("\nloop overhead:")
    print(table(rows, ["model", "plain_ms_per_token", "spec_ms_per_token", "ratio_median"]))
    print(f"\nwrote {write_json('overhead.json', results)}")


if __name__ == "__main__":
    main()
