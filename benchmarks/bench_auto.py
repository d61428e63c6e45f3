"""``speculate="auto"`` against every fixed tree size of the same drafter and ``model.generate``,
side by side in one process, on the check split of a prompt mix.

Prompts are split by line: even lines of a mix are the tuning split, odd lines the check split
(``--split``); figures are reported from the check split. Each method (``generate``, the drafter at
each fixed size from 1 drafted node to its configured size, and ``auto`` on one spec that keeps what
it learned across the run, as a server would) runs on the same batches of prompts in rotating order, ``--repeats`` times, the fastest run
counting (load on a shared machine only ever adds time; lookup runs without cross-request history
so that a repeated prompt cannot copy itself);
greedy outputs are checked identical to ``generate``; sampled, every drafter's run of a batch uses one
seed (``seed=``: the same text whatever the tree size or ``auto`` decides), so that its methods differ
in time alone, not in what they happened to sample. Reported per method: the median over batches
of the speedup over ``generate`` in tokens per second (sampled, ``generate`` draws a text of its own,
of another length) and tau; for ``auto``, its ratio to the best fixed size (the size with
the best median), and the median over its first three calls (cold start) against that size's on the
same batches; with ``--twin``, a second copy of the largest size, whose ratio to that size is the
run's noise between identical methods. Writes the cell's JSON to ``--results``; ``bench_auto.py --merge DIR`` collects a
grid's cells into ``benchmarks/results/auto.json`` (``auto_grid.sh`` does both).

    python benchmarks/bench_auto.py --target stories260K --mix stories --drafter eagle=benchmarks/adapters/stories260K-eagle-T0.7 \\
        --temperature 0.7 --batch 1 --prompts 12
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import heads  # noqa: E402

TARGETS = {"stories260K": "benchmarks/targets/stories260K", "demo-llama": "benchmarks/targets/demo-llama",
           "demo-draft": "benchmarks/targets/demo-draft"}
MIXES = {"stories": "stories.jsonl", "code": "code.jsonl", "prose": "prose.jsonl"}


def split_prompts(tokenizer, mix: str, split: str, count: int) -> list[str]:
    lines = [line for line in (ROOT / "benchmarks/targets/prompts" / MIXES[mix]).read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] for line in lines]
    chosen = texts[0::2] if split == "tuning" else texts[1::2]
    return chosen[:count]


def new_tokens(output: torch.Tensor, prompt_length: int, eos: set[int]) -> int:
    """Tokens the rows of ``output`` generated after a prompt of ``prompt_length`` columns, each row
    up to and with its first eos (what follows is padding)."""
    total = 0
    for row in output[:, prompt_length:].tolist():
        stop = next((index for index, token in enumerate(row) if token in eos), None)
        total += len(row) if stop is None else stop + 1
    return total


def make_spec(model, drafter: str, size: int | None):
    """``drafter``: ``lookup``, ``KIND=ADAPTER_DIR``, ``draft=MODEL_DIR`` or any of them ``+lookup``."""
    hybrid = drafter.endswith("+lookup")
    name = drafter[:-len("+lookup")] if hybrid else drafter
    if name == "lookup":  # no cross-request history: repeated runs of a prompt must not copy themselves
        spec = heads.attach_heads(model, kind="lookup", history_tokens=0)
    elif name.startswith("draft="):
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(ROOT / name.split("=", 1)[1], dtype=torch.float32).eval()
        spec = heads.attach_heads(model, kind="draft", draft_model=draft)
    else:
        spec = heads.load_heads(model, str(ROOT / name.split("=", 1)[1]))
    if hybrid:
        spec.set_lookup(True, history_tokens=0)
    if size is not None:
        spec.set_tree(size)
    return spec


def fixed_sizes(spec) -> list[int]:
    """Sizes from a single drafted node to the kind's default: the sizes ``auto`` chooses from and the
    powers of two below the largest (a kind whose drafter sizes its own trees offers ``auto`` one)."""
    from heads import kinds

    sizes = {1, *kinds.get(spec.kind).policy_sizes(spec)}
    return sorted(sizes | {size for size in (2, 4, 8) if size < max(sizes)})


def merge(cells: Path, out: Path) -> int:
    """Collect the grid's cell results in ``cells`` into one file, ``out`` (the experiment's result)."""
    files = sorted(cells.glob("*.json"))
    if not files:
        raise SystemExit(f"--merge: no cell results (*.json) in {cells}")
    entries = [json.loads(path.read_text()) for path in files]
    for entry, path in zip(entries, files):
        entry["cell"] = path.stem
        speculation = entry.get("auto_speculation") or {}
        entry["auto_speculation"] = {key: speculation.get(key) for key in ("steps", "options", "reasons", "last_choice")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    temporary = out.with_name(f".{out.name}.tmp")
    temporary.write_text(json.dumps({"experiment": "auto", "commit": commit, "cells": entries}, indent=1) + "\n")
    os.replace(temporary, out)
    print(f"{len(entries)} cells -> {out}")
    return 0


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--merge"]:
        if len(argv) != 2:
            raise SystemExit("usage: bench_auto.py --merge CELLS_DIR (writes benchmarks/results/auto.json)")
        return merge(Path(argv[1]), ROOT / "benchmarks/results/auto.json")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--mix", choices=sorted(MIXES), required=True)
    parser.add_argument("--drafter", required=True, help="lookup | KIND=ADAPTER_DIR | draft=MODEL_DIR, optionally +lookup")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=12, help="prompts of the split (batches of --batch)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--split", choices=("tuning", "check"), default="check")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each method per batch; the fastest counts (load on a shared machine only adds time)")
    parser.add_argument("--twin", action="store_true",
                        help="also run a second, separately built copy of the largest fixed size (the "
                             "twin; not a candidate for the best size): its ratio to that size is this "
                             "run's timing noise between two identical methods")
    parser.add_argument("--name", default=None)
    parser.add_argument("--results", default=str(ROOT / "benchmarks/results/cache/auto-grid"),
                        help="directory the cell's result JSON is written to (--merge collects them)")
    args = parser.parse_args(argv)
    for name in ("batch", "prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.prompts < args.batch:
        parser.error(f"--prompts ({args.prompts}) must be at least --batch ({args.batch}): one batch at least")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0 (0: greedy); got {args.temperature}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ROOT / TARGETS[args.target], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / TARGETS[args.target])
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    texts = split_prompts(tokenizer, args.mix, args.split, args.prompts)
    batches = [tokenizer(texts[i:i + args.batch], return_tensors="pt", padding=True)
               for i in range(0, len(texts) - args.batch + 1, args.batch)]
    sample = args.temperature > 0
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, pad_token_id=tokenizer.pad_token_id)
    if sample:
        options.update(temperature=args.temperature, top_k=0, top_p=1.0)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    probe = make_spec(model, args.drafter, None)
    sizes = fixed_sizes(probe)
    methods = {"generate": None, **{f"size {size}": make_spec(model, args.drafter, size) for size in sizes},
               "auto": make_spec(model, args.drafter, None)}
    if args.twin:
        methods[f"twin {sizes[-1]}"] = make_spec(model, args.drafter, sizes[-1])
    # warm-up on the other split's prompts: a spec with lookup history must not have seen a measured prompt
    other = split_prompts(tokenizer, args.mix, "check" if args.split == "tuning" else "tuning", args.batch)
    warm = tokenizer(other, return_tensors="pt", padding=True)
    for name, spec in methods.items():  # warm the code paths (not auto: its first calls are the cold start)
        if spec is not None and name != "auto":
            spec.generate(**warm, **options)
    model.generate(**warm, **options)
    results = {name: {"speedup": [], "tau": []} for name in methods}
    names = list(methods)
    for index, batch in enumerate(batches):
        order = names[index % len(names):] + names[:index % len(names)]
        seconds, outputs, produced = {}, {}, {}
        for repeat in range(args.repeats):
            for name in order:
                spec = methods[name]
                start = time.perf_counter()
                if spec is None:
                    torch.manual_seed(index)
                    outputs[name] = model.generate(**batch, **options)
                else:  # (sampled: one seed per batch, so every drafter samples the same text)
                    outputs[name] = spec.generate(**batch, **options, speculate="auto" if name == "auto" else None,
                                                  **({"seed": index} if sample else {}))
                    if repeat == 0:
                        results[name]["tau"].append(spec.last_stats.tau)
                seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - start)
                produced[name] = new_tokens(outputs[name], batch["input_ids"].shape[1], eos)
        def rate(name: str) -> float:  # tokens per second
            return produced[name] / seconds[name]

        for name in names:
            reference = "generate" if not sample else names[1] if name != "generate" else name
            if not torch.equal(outputs[name], outputs[reference]):
                raise SystemExit(f"{name}: output differs from {reference} on batch {index}")
            # per generated token: sampled, generate draws its own text (of its own length)
            results[name]["speedup"].append(rate(name) / rate("generate"))
        print(f"batch {index}: " + " ".join(f"{name} {rate(name) / rate('generate'):.2f}" for name in names),
              flush=True)
    medians = {name: statistics.median(entry["speedup"]) for name, entry in results.items()}
    best = max((name for name in names if name.startswith("size")), key=medians.get)
    report = {
        "target": args.target, "mix": args.mix, "drafter": args.drafter, "temperature": args.temperature,
        "batch": args.batch, "split": args.split, "batches": len(batches), "max_new_tokens": args.max_new_tokens,
        "median_speedup": {name: round(value, 3) for name, value in medians.items()},
        "median_tau": {name: round(statistics.median(entry["tau"]), 3) for name, entry in results.items() if entry["tau"]},
        "best_fixed": best, "auto_over_best_fixed": round(medians["auto"] / medians[best], 3),
        "cold_start_over_best_fixed": round(statistics.median(results["auto"]["speedup"][:3])
                                            / statistics.median(results[best]["speedup"][:3]), 3),
        "auto_speculation": methods["auto"].last_stats.speculation,
    }
    if args.twin:  # the same method twice: how far apart two identical methods read in this run
        twin, size = f"twin {sizes[-1]}", f"size {sizes[-1]}"
        report["twin_over_its_size"] = round(medians[twin] / medians[size], 3)
        report["twin_over_best_fixed"] = round(medians[twin] / medians[best], 3)
    name = args.name or f"{args.target}_{args.mix}_{args.drafter.split('=')[0]}_T{args.temperature:g}_b{args.batch}"
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    temporary = out / f".{name}.json.tmp"
    temporary.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                     "torch": torch.__version__, **report}, indent=2) + "\n")
    os.replace(temporary, out / f"{name}.json")
    print(json.dumps({key: report[key] for key in ("median_speedup", "median_tau", "best_fixed", "auto_over_best_fixed",
                                                   "cold_start_over_best_fixed", "twin_over_its_size") if key in report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
