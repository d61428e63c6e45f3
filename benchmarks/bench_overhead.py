"""Loop overhead and verification cost on this machine.

1. Overhead: ``spec.generate`` with a one-node tree (no speculation) against ``model.generate``,
   greedy, same prompts, same process; the ratio is the decode loop's own cost (goal <= 1.10).
2. Verification cost: one forward over a tree of N nodes on top of a 256-token cache, relative to a
   one-token decode step, for a tiny model and a ~110M-parameter random Llama. This curve bounds
   every speedup: speedup <= tau x cost(1) / (cost(verify N) + cost(draft)).

3. Split and efficiency (``--split``): on the shipped targets, where a speculative step's time
   goes (``DecodeStats.phases``: draft, tree, mask, forward, accept, cache, commit), the work
   outside the backbone and drafter forwards as a share of a plain ``generate`` step, and the
   efficiency: speedup over the speedup of a loop with no work of its own, per call (``generate``'s
   own prefill + the drafter's time + a bare verify forward of each step's tree width, measured on
   each prompt right before its runs; ``benchmarks.common.bare_call_seconds``), and in the form
   speedup / (tau x t_generate_step / (t_draft + t_verify_bare)) at the mean tree width
   (``efficiency_mean_width``), for the lookup kind and every adapter given with ``--adapter
   NAME=TARGET:DIR`` (alone and with lookup).

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
from benchmarks.common import (PROMPTS, bare_call_seconds, bare_verify_ms, interpolate, median_seconds,  # noqa: E402
                               table, write_json)
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


SPLIT_TARGETS = {"demo-llama": "code.jsonl", "stories260K": "stories.jsonl"}
OUTSIDE = ("tree", "mask", "accept", "cache", "commit")


def split_specs(model, target_name: str, adapters: dict) -> dict:
    specs = {"lookup": heads.attach_heads(model, kind="lookup", tree=10, history_tokens=0)}
    for name, (target, directory) in adapters.items():
        if target == target_name:
            specs[name] = heads.load_heads(model, directory)
            specs[f"{name}+lookup"] = heads.load_heads(model, directory)
            specs[f"{name}+lookup"].set_lookup(budget=6, history_tokens=0)
    return specs


def loop_split(target_name: str, adapters: dict, prompt_count: int, new_tokens: int, repeats: int) -> dict:
    """Per method: speedup, tau, per-step phase times, the share of a plain step spent outside the
    forwards, and the efficiency against the bare-forward bound (:func:`benchmarks.common.bare_call_seconds`:
    per call, ``generate``'s own prefill + the drafter's time + a bare verify forward of each step's
    width, over the call's seconds; the bare costs measured on each prompt right before its runs, as
    the machine's speed drifts); ``efficiency_mean_width`` is the issue's form at the mean width."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(__file__).resolve().parent / "targets" / target_name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = (PROMPTS / SPLIT_TARGETS[target_name]).read_text().splitlines()[:prompt_count]
    prompts = [tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids for line in lines]
    specs = split_specs(model, target_name, adapters)
    pad = model.generation_config.pad_token_id
    runs = {name: [] for name in specs}
    plain_times, curves = [], []
    for index, prompt in enumerate(prompts):
        verify = bare_verify_ms(specs["lookup"], prompt.shape[1] + new_tokens // 2)
        curves.append(verify)
        prefill = median_seconds(lambda: model.generate(prompt, do_sample=False, max_new_tokens=1, pad_token_id=pad),
                                 repeats)
        plain = median_seconds(lambda: model.generate(prompt, do_sample=False, max_new_tokens=new_tokens,
                                                      pad_token_id=pad), repeats)
        plain_times.append(plain)
        names = list(specs)
        for name in names[index % len(names):] + names[:index % len(names)]:  # rotating order
            spec = specs[name]
            seconds = median_seconds(lambda: spec.generate(prompt, max_new_tokens=new_tokens), repeats)
            stats = spec.last_stats
            runs[name].append((plain, seconds, stats, bare_call_seconds(stats, verify, prefill), verify))
    step_ms = 1000 * statistics.median(t / new_tokens for t in plain_times)
    rows = {}
    for name, calls in runs.items():
        speedups, taus, phases, widths, efficiency, mean_width = [], [], [], [], [], []
        for plain, seconds, stats, bare, verify in calls:
            steps = max(1, stats.target_forwards - 1)
            speedups.append(plain / seconds)
            taus.append(stats.mean_accepted)
            phases.append({key: 1000 * value / steps for key, value in stats.phases.items()})
            widths.append(stats.verified_nodes / steps)
            efficiency.append(bare / seconds)
            step = 1000 * plain / new_tokens
            bound = stats.mean_accepted * step / (1000 * stats.phases["draft"] / steps + interpolate(verify, widths[-1]))
            mean_width.append((plain / seconds) / bound)
        per_step = {key: statistics.median(p[key] for p in phases) for key in phases[0]}
        rows[name] = {"speedup": statistics.median(speedups), "tau": statistics.median(taus),
                      "efficiency": statistics.median(efficiency),
                      "efficiency_mean_width": statistics.median(mean_width),
                      "phases_ms_per_step": per_step, "mean_tree_width": statistics.median(widths),
                      "outside_share_of_generate_step": sum(per_step[key] for key in OUTSIDE) / step_ms}
    verify = {size: statistics.median(curve[size] for curve in curves) for size in curves[0]}
    return {"generate_step_ms": step_ms, "verify_bare_ms": verify, "methods": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--prompts", type=int, default=5, help="prompts for the overhead ratio")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--split", action="store_true", help="only the step split and efficiency on the shipped targets")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=TARGET:DIR",
                        help="--split: a trained adapter to include, e.g. medusa=demo-llama:DIR")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.split:
        adapters = {}
        for item in args.adapter:
            name, _, rest = item.partition("=")
            target, _, directory = rest.partition(":")
            if target not in SPLIT_TARGETS or not Path(directory).is_dir():
                raise SystemExit(f"--adapter {item!r}: expected NAME=TARGET:DIR, TARGET in {list(SPLIT_TARGETS)}")
            adapters[name] = (target, directory)
        split = {name: loop_split(name, adapters, args.prompts, args.new_tokens, args.repeats) for name in SPLIT_TARGETS}
        for target, entry in split.items():
            rows = [{"method": name, **{k: v for k, v in row.items() if not isinstance(v, dict)},
                     **{f"{k} ms": v for k, v in row["phases_ms_per_step"].items() if k not in ("prefill", "result")}}
                    for name, row in entry["methods"].items()]
            print(f"\n{target}: generate step {entry['generate_step_ms']:.2f} ms")
            print(table(rows, ["method", "speedup", "tau", "efficiency", "efficiency_mean_width",
                               "outside_share_of_generate_step",
                               "draft ms", "tree ms", "mask ms", "forward ms", "accept ms", "cache ms", "commit ms"]))
        print(f"\nwrote {write_json('overhead_split.json', {'threads': args.threads, 'split': split})}")
        return
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
