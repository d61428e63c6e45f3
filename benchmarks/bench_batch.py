"""Throughput vs batch size on the shipped target: where speculative decoding stops paying.

For each batch size B, batches of B held-out prompts (code and prose alternating, left-padded) are
generated with the backbone's own ``generate`` and with ``spec.generate`` (Medusa heads, EAGLE
drafter, each with its fixed default tree and with ``speculate="auto"``), greedy and at T=0.7,
alternating in one process; tokens/s is the batch's total new tokens over wall-clock seconds,
median over repeats with different prompts. Reports speedup, tau (tokens committed per row and
target forward, bonus included), the tree ``auto`` chose last and the share of its steps that
drafted (it measures and decides inside each call: plain steps, drafted steps, and stopping to
draft when that does not pay; its exploring calls are in the medians) and the share of its calls run
by `model.generate` itself (chosen to draft nothing). It also measures the verify-cost
curve: seconds of one target forward over ``n`` new tokens per row at batch ``B`` on a cached
prefix, relative to ``n = 1``, the term that decides when a tree of ``n`` nodes stops paying.

Adapters come from ``selfdraft train`` on training prompts of both mixes, cached under
``benchmarks/results/adapters``. Writes ``benchmarks/results/batch.json`` and ``batch.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import RESULTS, median_seconds, table, write_json  # noqa: E402
from benchmarks.demo import MIXES, PROMPTS, TARGET, mixed_training_file  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32)
TEMPERATURES = (0.0, 0.7)


def train_adapter(kind: str, args) -> Path:
    """The cached ``batch-<kind>`` adapter, trained on both mixes when missing."""
    from training.cli import main as selfdraft

    adapter = RESULTS / "adapters" / f"batch-{kind}"
    if (adapter / "adapter_config.json").is_file():
        return adapter
    cache = RESULTS / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    data = mixed_training_file(cache / "train_mixed.jsonl", args.train_prompts)
    selfdraft([
        "train", "--model", str(TARGET), "--kind", kind, "--data", str(data), "--out", str(adapter),
        "--steps", str(args.steps), "--batch-size", "8", "--lr", "2e-3", "--max-new-tokens", "64",
        "--max-length", "128", "--max-prompts", str(2 * args.train_prompts), "--cache-dir", str(cache),
        "--eval-prompts", "0", "--no-progress",
    ])
    return adapter


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(prompt.shape[1] for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1]:] = prompt[0]
        mask[row, width - prompt.shape[1]:] = 1
    return ids, mask


def new_tokens(output: torch.Tensor, width: int, pad: int | None) -> int:
    new = output[:, width:]
    return int((new != pad).sum()) if pad is not None else new.numel()


def verify_costs(spec, batch: int, prefix: int, sizes=(1, 2, 4, 8, 16, 32)) -> dict:
    """Seconds of one target forward over ``n`` new tokens per row (chain mask) after a ``prefix``."""
    from tree_attention import cache as cache_ops
    from tree_attention.mask import prefill_attention_mask, tree_attention_mask, tree_position_ids

    target = spec.target
    vocab = target.vocab_size
    ids = torch.randint(3, vocab, (batch, prefix))
    costs = {}
    for size in sizes:
        chain = torch.ones(size, size, dtype=torch.bool).tril_()
        depths = torch.arange(size)
        mask = tree_attention_mask(prefix, chain, depths, target.layout, target.dtype)
        mask = {k: v.expand(batch, -1, -1, -1) for k, v in mask.items()} if isinstance(mask, dict) else \
            mask.expand(batch, -1, -1, -1)
        tokens = torch.randint(3, vocab, (batch, size))
        positions = tree_position_ids(prefix, depths).expand(batch, -1)
        cache = cache_ops.new_cache()
        target.forward(ids, torch.arange(prefix)[None].expand(batch, -1),
                       prefill_attention_mask(prefix, target.layout, target.dtype, "cpu"), cache, "last")

        def verify():
            target.forward(tokens, positions, mask, cache, "all")
            cache_ops.crop(cache, prefix)

        costs[size] = median_seconds(verify, repeats=5)
    return {size: 1000 * seconds for size, seconds in costs.items()}


def plot(rows: list[dict], curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setting in sorted({(r["kind"], r["speculate"], r["temperature"]) for r in rows}):
        series = [r for r in rows if (r["kind"], r["speculate"], r["temperature"]) == setting]
        style = "-" if setting[1] == "fixed" else "--"
        left.plot([r["batch"] for r in series], [r["speedup"] for r in series], style, marker="o",
                  label=f"{setting[0]} {setting[1]} T={setting[2]}")
    left.axhline(1.0, color="gray", linewidth=1)
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size")
    left.set_ylabel("total tokens/s, speculative / plain")
    left.set_title("speedup vs batch size")
    left.legend(fontsize=7)
    for batch, curve in curves.items():
        sizes = sorted(curve)
        right.plot(sizes, [curve[n] / curve[1] for n in sizes], marker="o", label=f"B={batch}")
    right.set_xscale("log", base=2)
    right.set_xlabel("new tokens per row in one forward (tree nodes)")
    right.set_ylabel("forward cost / cost of 1 token")
    right.set_title("verify-cost curve")
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="distillation steps per adapter")
    parser.add_argument("--train-prompts", type=int, default=96, help="training prompts per mix")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--repeats", type=int, default=2, help="batches of different prompts per size")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", default=["medusa", "eagle"])
    parser.add_argument("--adapter", action="append", default=[], metavar="KIND=DIR",
                        help="use this trained adapter for KIND instead of training one (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import heads
    from training.commands.common import load_model
    from training.prompts import load_prompts
    from training.evaluate import encode_prompts

    given = dict(item.split("=", 1) for item in args.adapter)
    adapters = {kind: Path(given[kind]) if kind in given else train_adapter(kind, args) for kind in args.kinds}
    model, tokenizer = load_model(str(TARGET))
    specs = {kind: heads.load_heads(model, adapter) for kind, adapter in adapters.items()}
    pad = specs[args.kinds[0]].pad_token_id
    per_mix = max(args.batches) * args.repeats // 2 + 1
    encoded = {mix: encode_prompts(tokenizer, load_prompts(PROMPTS / f"{mix}.jsonl"), per_mix) for mix in MIXES}
    pool = [prompt[:, -48:] for pair in zip(*encoded.values()) for prompt in pair]  # prompts cut to 48 tokens
    rows, curves, started = [], {}, time.perf_counter()
    for batch in args.batches:
        curves[batch] = verify_costs(next(iter(specs.values())), batch, 48)
        for temperature in TEMPERATURES:
            sampled = temperature > 0
            options = dict(do_sample=sampled, max_new_tokens=args.max_new_tokens)
            if sampled:
                options.update(temperature=temperature, top_k=0)
            results: dict[tuple, list] = {}
            for repeat in range(args.repeats):
                prompts = pool[repeat * batch:(repeat + 1) * batch]
                ids, mask = left_padded(prompts, pad)
                for kind, spec in specs.items():
                    for speculate in ("fixed", "auto"):
                        if repeat == 0:  # warm-up (for auto: a 4-token call, its first in this bucket)
                            spec.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=sampled,
                                          speculate=None if speculate == "fixed" else "auto")
                        torch.manual_seed(repeat)  # the plain sampled call's draws, reproducible per repeat
                        start = time.perf_counter()
                        plain = model.generate(ids, attention_mask=mask, pad_token_id=pad, **options)
                        plain_seconds = time.perf_counter() - start
                        start = time.perf_counter()
                        output = spec.generate(ids, attention_mask=mask, speculate=None if speculate == "fixed"
                                               else "auto", generator=torch.Generator().manual_seed(repeat),
                                               **options)
                        spec_seconds = time.perf_counter() - start
                        stats = spec.last_stats
                        results.setdefault((kind, speculate), []).append(dict(
                            plain=new_tokens(plain, ids.shape[1], pad) / plain_seconds,
                            spec=new_tokens(output, ids.shape[1], pad) / spec_seconds,
                            tau=stats.tau, tree=stats.speculation["tree"] if stats.speculation else stats.tree_size - 1,
                            drafted=sum(step.kind == "drafted" for step in stats.steps) / max(1, len(stats.steps)),
                            delegated=bool(stats.speculation and stats.speculation.get("delegate")),
                            identical=bool(torch.equal(plain, output)) if not sampled else None,
                            draft=stats.draft_seconds, verify=stats.verify_seconds,
                            steps=max(1, stats.target_forwards - 1),
                        ))
            for (kind, speculate), runs in results.items():
                # a sampled call may stop at eos at once (no new token, a rate of 0): left out of the ratios
                runs = [r for r in runs if r["plain"] > 0 and r["spec"] > 0] or runs
                rows.append({
                    "batch": batch, "temperature": temperature, "kind": kind, "speculate": speculate,
                    "tok/s plain": statistics.median(r["plain"] for r in runs),
                    "tok/s spec": statistics.median(r["spec"] for r in runs),
                    "speedup": statistics.median(r["spec"] / max(r["plain"], 1e-12) for r in runs),
                    "tau": statistics.median(r["tau"] for r in runs),
                    "tree": max(r["tree"] for r in runs),
                    "drafted": statistics.mean(r["drafted"] for r in runs),
                    "delegated": statistics.mean(r["delegated"] for r in runs),
                    "draft ms/step": 1000 * statistics.median(r["draft"] / r["steps"] for r in runs),
                    "verify ms/step": 1000 * statistics.median(r["verify"] / r["steps"] for r in runs),
                    "identical": all(r["identical"] for r in runs) if not sampled else "-",
                })
                print(table([rows[-1]], list(rows[-1])), flush=True)
    columns = ["batch", "temperature", "kind", "speculate", "tok/s plain", "tok/s spec", "speedup", "tau", "tree",
               "drafted", "delegated", "draft ms/step", "verify ms/step", "identical"]
    print("\n" + table(rows, columns))
    print("\nverify cost (ms) of n new tokens per row, by batch size:")
    for batch, curve in curves.items():
        print(f"  B={batch:>2}: " + "  ".join(f"n={n}: {ms:.1f}" for n, ms in curve.items()))
    policies = {kind: {"sizes": list(spec.policy.sizes), "step_ms": {str(k): v for k, v in spec.policy.step_costs.items()}}
                for kind, spec in specs.items()}
    path = write_json("batch.json", {
        "target": str(TARGET), "max_new_tokens": args.max_new_tokens, "prompt_tokens": 48,
        "repeats": args.repeats, "tau": "tokens committed per row and target forward, bonus token included",
        "rows": rows, "verify_cost_ms": curves, "auto_policy": policies,
        "seconds": time.perf_counter() - started,
    })
    plot(rows, curves, RESULTS / "batch.png")
    print(f"wrote {path} and {RESULTS / 'batch.png'}")


if __name__ == "__main__":
    main()
