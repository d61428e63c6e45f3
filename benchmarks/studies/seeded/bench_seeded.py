"""Tau of seeded sampling (``generate(seed=...)``: Gumbel-max on a counter-based stream, the greedy
walk on perturbed logits) against the lossless speculative sampling rule of unseeded calls, per
drafter and temperature, on the same prompts and in one process.

Three methods per drafter: the speculative rule as served (each kind drafts the candidates it draws
under sampling), the same rule with top-k candidates (``sample="never"``: the candidates seeded calls
draft), and seeded calls. Tau is new tokens over target forwards (rows), summed over every call.
Prompts: the check split (odd lines) of a prompt mix. Writes ``seeded_<target>.json`` beside this script.

    taskset -c 0 python -m benchmarks.studies.seeded.bench_seeded --target stories260K --mix stories \\
        --prompts 10 --seeds 5 \\
        --drafter medusa=benchmarks/adapters/stories260K-medusa \\
        --drafter eagle-T0.7=benchmarks/adapters/stories260K-eagle-T0.7 --drafter lookup=lookup
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import heads
from benchmarks.harness.prompts import ROOT, mix_prompts

METHODS = ("speculative", "speculative-topk", "seeded")


def build(model, source: str, method: str):
    """A fresh spec (lookup's history the same for every method); top-k candidates for ``speculative-topk``."""
    spec = heads.attach_heads(model, kind="lookup") if source == "lookup" else heads.load_heads(model, source)
    if method == "speculative-topk" and hasattr(spec.config, "sample"):
        spec.config = dataclasses.replace(spec.config, sample="never")
        spec.set_tree(None)
    return spec


def measure(spec, method: str, encoded, seeds: int, temperature: float, new: int) -> dict:
    tokens = forwards = 0
    for seed in range(seeds):
        for ids in encoded:
            settings = dict(max_new_tokens=new, do_sample=True, temperature=temperature, top_k=0)
            if method == "seeded":
                spec.generate(ids, seed=1000 * seed + 7, **settings)
            else:
                torch.manual_seed(1000 * seed + 7)
                spec.generate(ids, **settings)
            tokens += spec.last_stats.new_tokens
            forwards += spec.last_stats.row_forwards
    return {"tau": tokens / forwards, "new_tokens": tokens, "row_forwards": forwards}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="stories260K")
    parser.add_argument("--mix", default="stories")
    parser.add_argument("--drafter", action="append", required=True, help="NAME=ADAPTER_DIR, or NAME=lookup")
    parser.add_argument("--temperature", type=float, action="append", help="default: 0.7 and 1.0")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = ROOT / "benchmarks" / "targets" / args.target
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = mix_prompts(args.mix, "check", args.prompts)
    encoded = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in texts]
    drafters = dict(entry.split("=", 1) for entry in args.drafter)
    rows = []
    for name, source in drafters.items():
        for temperature in args.temperature or [0.7, 1.0]:
            row = {"drafter": name, "temperature": temperature}
            for method in METHODS:
                if method == "speculative-topk" and source == "lookup":
                    continue  # lookup's candidates are deterministic under every rule
                row[method] = measure(build(model, str(ROOT / source) if source != "lookup" else source, method),
                                      method, encoded, args.seeds, temperature, args.new)
            row["seeded_vs_speculative"] = row["seeded"]["tau"] / row["speculative"]["tau"] - 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| drafter | T | speculative rule (served) | speculative rule, top-k drafts | seeded | seeded vs served |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        topk = row.get("speculative-topk", row["speculative"])["tau"]
        print(f"| {row['drafter']} | {row['temperature']:g} | {row['speculative']['tau']:.3f} | {topk:.3f} | "
              f"{row['seeded']['tau']:.3f} | {100 * row['seeded_vs_speculative']:+.1f}% |")
    out = Path(__file__).resolve().parent / f"seeded_{args.target}.json"
    out.write_text(json.dumps({"target": args.target, "mix": args.mix, "prompts": args.prompts, "seeds": args.seeds,
                               "new_tokens": args.new, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
