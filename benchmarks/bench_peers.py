"""selfdraft against what users already have for free, side by side on the shipped targets.

Methods, per target and traffic mix, on the same held-out prompts in one process, in rotating order:
plain ``model.generate``; transformers' prompt lookup (``prompt_lookup_num_tokens`` = 3, 5, 10; the
best is reported as ``prompt_lookup``); selfdraft's ``lookup`` kind (no training) at a few tree
budgets; and every trained selfdraft adapter given with ``--adapter NAME=TARGET:DIR``, alone and as
a hybrid with lookup when the kind supports it. Greedy (outputs checked identical to ``generate``)
and sampled at ``--temperature`` (top_k 0), where each adapter also runs with its top-k tokens as
candidates (``NAME[top-k]``, ``sample="never"``) beside the default sampled candidates.

Per method: speedup (median over prompts of the ratio of seconds per new token, t_generate / t_method:
sampled runs stop at eos after different lengths, greedy ones produce the same tokens), tau, and for selfdraft the
**efficiency**: per call, what a loop with no work of its own would take over what the call took
(``benchmarks.common.bare_call_seconds``: ``generate``'s own prefill of the prompt, the drafter's time
as measured, and a bare verify forward of each step's tree width on a cache of the prompt's length,
measured in the same run before and after each mix's runs, averaged: on this shared machine a
one-off measurement moved by up to 30% between runs); median over prompts. So an efficiency near 1
means the loop adds nothing beyond the forwards. ``efficiency_mean_width`` is the form speedup /
(tau x t_generate_step / (t_draft + t_verify_bare)) at the mean tree width, which charges the prompt's
forward to the loop and prices trees of varying width at the mean width; ``efficiency_decode`` that
form over the decoding steps alone (each side's prefill taken out). Writes ``results/peers.json``
(``{target: {mix: {"peers": {name: {speedup, tau}}, "selfdraft": {name: {speedup, tau, efficiency}}}}}``,
sampled mixes keyed ``"<mix>@T<temperature>"``) and ``results/peers.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import heads  # noqa: E402
from benchmarks.common import PROMPTS, RESULTS, bare_call_seconds, bare_verify_ms, interpolate, write_json  # noqa: E402

TARGETS = {
    "demo-llama": {"path": ROOT / "benchmarks/targets/demo-llama", "mixes": {"code": "code.jsonl",
                                                                             "prose": "prose.jsonl"}},
    "stories260K": {"path": ROOT / "benchmarks/targets/stories260K", "mixes": {"stories": "stories.jsonl"}},
}
TRAINING_PROMPTS = {"code": "train_code.jsonl", "prose": "train_prose.jsonl", "stories": "stories_train.jsonl"}
"""Per mix, the training prompts (disjoint from the held-out ones) a lookup corpus is generated from."""
PLD_SIZES = (3, 5, 10)
LOOKUP_BUDGETS = (6, 10, 16)
HYBRID_LOOKUP_BUDGET = 10
CORPUS_BUDGET = 16
CORPUS_MAX_NEW = 96
"""Tokens the target writes after each training prompt of a lookup corpus."""


def load_target(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def prompts_of(tokenizer, file: str, count: int) -> list[torch.Tensor]:
    lines = (PROMPTS / file).read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines if line.strip()][:count]
    return [tokenizer(text, return_tensors="pt").input_ids for text in texts]


def lookup_corpus(model, tokenizer, target_name: str, mix: str, count: int, max_new: int) -> tuple[list, dict]:
    """The target's own greedy continuations of ``count`` training prompts of ``mix`` (token ids,
    prompt included; ``training.corpus.target_corpus``), cached under ``results/corpus/``."""
    from training.corpus import target_corpus

    path = RESULTS / "corpus" / f"{target_name}-{mix}-{count}x{max_new}.json"  # token ids: compact JSON
    if path.is_file():
        cached = json.loads(path.read_text())
        return cached["ids"], cached["facts"]
    prompts = prompts_of(tokenizer, TRAINING_PROMPTS[mix], count)
    ids, facts = target_corpus(model, prompts, max_new)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"facts": facts, "ids": ids}, separators=(",", ":")) + "\n")
    temporary.replace(path)
    return ids, facts


def load_draft(path: str, model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype).eval()


def methods_for(model, target_name: str, adapters: dict, sample: bool, drafts: dict | None = None,
                corpus: list | None = None) -> dict:
    """``{name: (group, callable(prompt, max_new) -> (output, stats or None))}``."""
    options = dict(do_sample=True, temperature=args_temperature[0], top_k=0) if sample else dict(do_sample=False)
    pad = model.generation_config.pad_token_id
    methods = {"generate": ("peers", lambda p, n: (model.generate(p, max_new_tokens=n, pad_token_id=pad,
                                                                  **options), None))}
    for size in PLD_SIZES:
        methods[f"prompt_lookup_n{size}"] = ("peers", lambda p, n, size=size: (model.generate(
            p, max_new_tokens=n, prompt_lookup_num_tokens=size, pad_token_id=pad, **options), None))
    specs = {f"lookup_{budget}": heads.attach_heads(model, kind="lookup", tree=budget, history_tokens=0)
             for budget in LOOKUP_BUDGETS}
    if corpus:  # the corpus alone in the history: no request's text is remembered across calls
        specs[f"lookup_{CORPUS_BUDGET}+corpus"] = heads.attach_heads(model, kind="lookup", tree=CORPUS_BUDGET,
                                                                     corpus=corpus, remember=False)
    for name, (target, directory) in (drafts or {}).items():
        if target != target_name:
            continue
        small = load_draft(directory, model)
        methods[f"assisted_{name}"] = ("peers", lambda p, n, small=small: (model.generate(
            p, max_new_tokens=n, assistant_model=small, pad_token_id=pad, **options), None))
        specs[f"draft_{name}"] = heads.attach_heads(model, kind="draft", draft_model=small, confidence=0.4)
    for (name, target), directory in adapters.items():
        if target == target_name:
            specs[name] = heads.load_heads(model, directory)
            specs[f"{name}+lookup"] = heads.load_heads(model, directory)
            specs[f"{name}+lookup"].set_lookup(budget=HYBRID_LOOKUP_BUDGET, history_tokens=0)
            if sample:  # candidates side by side: sampled from the drafter (the default) and its top-k tokens
                specs[f"{name}[top-k]"] = heads.load_heads(model, directory)
                specs[f"{name}[top-k]"].config.sample = "never"
                specs[f"{name}[top-k]"].set_tree(None)
            if corpus and name == "medusa":
                specs[f"{name}+lookup+corpus"] = heads.load_heads(model, directory)
                specs[f"{name}+lookup+corpus"].set_lookup(budget=CORPUS_BUDGET, corpus=corpus, remember=False)
    sampling = dict(do_sample=True, temperature=args_temperature[0], top_k=0) if sample else {}
    for name, spec in specs.items():
        methods[name] = ("selfdraft", lambda p, n, spec=spec: (spec.generate(p, max_new_tokens=n, **sampling),
                                                              spec.last_stats))
    for name in [name for name in specs if name == "lookup_10" or name.endswith("+lookup")]:
        methods[f"{name}@auto"] = ("selfdraft", lambda p, n, spec=specs[name]: (
            spec.generate(p, max_new_tokens=n, speculate="auto", **sampling), spec.last_stats))
    return methods


args_temperature = [0.7]
AUTO_FIELDS = ("steps", "verified_widths", "reasons", "last_choice")


def run_mix(model, target_name: str, prompts, max_new: int, adapters: dict, sample: bool,
            drafts: dict | None = None, corpus: list | None = None) -> dict:
    methods = methods_for(model, target_name, adapters, sample, drafts, corpus)
    names = list(methods)
    times = {name: [] for name in names}
    taus = {name: [] for name in names}
    drafts = {name: [] for name in names}
    sizes = {name: [] for name in names}
    steps = {name: [] for name in names}
    calls = {name: [] for name in names}  # speculate="auto": what each timed call chose and did
    decode = {name: [] for name in names}  # seconds per new token after the first (the prefill's), see summarise
    decode_taus = {name: [] for name in names}
    calls_bare = {name: [] for name in names}  # (seconds, stats, generate's prefill): the per-call bound, see summarise
    identical = {name: True for name in names}
    pad = model.generation_config.pad_token_id
    for index, prompt in enumerate(prompts):
        torch.manual_seed(index)
        reference = None
        order = names[index % len(names):] + names[:index % len(names)]  # rotate
        for name in order:
            methods[name][1](prompt, 4)  # warm-up of this method on this prompt length
        prefill = []  # generate's prefill on this prompt: a call for one new token (median of three)
        for _ in range(3):
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=pad)
            prefill.append(time.perf_counter() - start)
        for name in order:
            torch.manual_seed(1000 + index)
            start = time.perf_counter()
            output, stats = methods[name][1](prompt, max_new)
            elapsed, new = time.perf_counter() - start, max(1, output.shape[1] - prompt.shape[1])
            # seconds per new token: sampled runs stop at eos after different lengths (greedy ones agree)
            times[name].append(elapsed / new)
            if name == "generate" or stats is not None:
                phases = {} if stats is None else stats.phases  # (none: generate itself, or auto delegating to it)
                spent = phases["prefill"] if "prefill" in phases else statistics.median(prefill)
                decode[name].append((elapsed - spent) / max(1, new - 1))
                if stats is not None:
                    decode_taus[name].append((stats.new_tokens - 1) / max(1, stats.target_forwards - 1))
            if name == "generate":
                reference = output
            elif not sample and reference is not None:
                identical[name] &= torch.equal(output, reference)
            if stats is not None:
                calls_bare[name].append((elapsed, stats, statistics.median(prefill)))
                taus[name].append(stats.mean_accepted)
                forwards = max(1, stats.target_forwards - 1)
                drafts[name].append(stats.draft_seconds / forwards)
                sizes[name].append(stats.verified_nodes / forwards)  # mean tree width per verify step
                steps[name].append(forwards)
                if stats.speculation is not None:
                    calls[name].append({key: stats.speculation.get(key) for key in AUTO_FIELDS})
        if not sample:  # the reference may have been timed after others: recheck the others against it
            pass
    return {"times": times, "taus": taus, "drafts": drafts, "sizes": sizes, "steps": steps, "identical": identical,
            "calls": calls, "decode": decode, "decode_taus": decode_taus, "calls_bare": calls_bare}


def summarise(raw: dict, prompts, max_new: int, verify_costs: dict) -> dict:
    times = raw["times"]
    plain = times["generate"]
    result = {"peers": {}, "selfdraft": {}}
    step_ms = 1000 * statistics.median(plain)  # times are seconds per new token
    for name, values in times.items():
        speedup = statistics.median(p / t for p, t in zip(plain, values))
        if name in ("generate",) or name.startswith(("prompt_lookup", "assisted")):
            result["peers"][name] = {"speedup": speedup, "tau": None}
            continue
        tau = statistics.median(raw["taus"][name])
        draft_ms = 1000 * statistics.median(raw["drafts"][name])
        verify_ms = interpolate(verify_costs, statistics.median(raw["sizes"][name]))
        bound = tau * step_ms / (draft_ms + verify_ms)
        # per call: what a loop with no work of its own would take over what the call took
        bare = [(bare_call_seconds(stats, verify_costs, prefill), seconds)
                for seconds, stats, prefill in raw.get("calls_bare", {}).get(name, [])]
        bare = [part / seconds for part, seconds in bare if part is not None]
        result["selfdraft"][name] = {"speedup": speedup, "tau": tau,
                                     "efficiency": statistics.median(bare) if bare else None,
                                     "efficiency_mean_width": speedup / bound, "bound": bound,
                                     "draft_ms": draft_ms, "verify_bare_ms": verify_ms,
                                     "identical": raw["identical"][name]}
        if raw.get("decode", {}).get(name) and raw["decode"].get("generate"):
            # the same figure over the decoding steps alone: the prefill forward (the prompt's, taken out
            # of both sides) is no work of the loop's, but weighs more per token where tau is high
            plain_decode = raw["decode"]["generate"]
            decode_speedup = statistics.median(g / d for g, d in zip(plain_decode, raw["decode"][name]))
            decode_bound = (statistics.median(raw["decode_taus"][name]) * 1000 * statistics.median(plain_decode)
                            / (draft_ms + verify_ms))
            result["selfdraft"][name].update(decode_speedup=decode_speedup,
                                             efficiency_decode=decode_speedup / decode_bound)
        if raw.get("calls", {}).get(name):
            result["selfdraft"][name]["auto_calls"] = raw["calls"][name]
    pld = {name: entry for name, entry in result["peers"].items() if name.startswith("prompt_lookup")}
    best = max(pld, key=lambda name: pld[name]["speedup"])
    result["peers"]["prompt_lookup"] = {**pld[best], "best_of": best}
    peer = max((n for n in result["peers"] if n not in ("generate", "prompt_lookup")),
               key=lambda n: result["peers"][n]["speedup"])
    ours = max(result["selfdraft"], key=lambda n: result["selfdraft"][n]["speedup"])
    result["best_peer"] = {"name": peer, "speedup": result["peers"][peer]["speedup"]}
    result["best_selfdraft"] = {"name": ours, "speedup": result["selfdraft"][ours]["speedup"]}
    result["best_over_best_peer"] = result["selfdraft"][ours]["speedup"] / result["peers"][peer]["speedup"]
    result["generate_step_ms"] = step_ms
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(target, mix) for target, mixes in results.items() for mix in mixes]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for axis, (target, mix) in zip(axes[0], panels):
        entry = results[target][mix]
        names = ["prompt_lookup"] + list(entry["selfdraft"])
        values = [entry["peers"]["prompt_lookup"]["speedup"]] + [v["speedup"] for v in entry["selfdraft"].values()]
        axis.bar(range(len(names)), values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{target} / {mix}", fontsize=9)
        axis.set_ylabel("speedup over generate")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens per mix (under 10 minutes)")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7, help="sampled runs (0: greedy only)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=TARGET:DIR",
                        help="a trained selfdraft adapter to include, e.g. medusa=stories260K:/tmp/a")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=TARGET:DIR",
                        help="a small draft model: transformers' assisted generation and selfdraft's draft kind")
    parser.add_argument("--corpus-prompts", type=int, default=150,
                        help="lookup with a corpus of the target's own continuations of this many training prompts "
                             "per mix (built once, cached in results/corpus/; 0: none)")
    parser.add_argument("--out", default="peers.json")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens = 4, 64
    torch.set_num_threads(args.threads)
    args_temperature[0] = args.temperature
    adapters = {}
    for item in args.adapter:
        name, _, rest = item.partition("=")
        target, _, directory = rest.partition(":")
        if not name or target not in TARGETS or not Path(directory).is_dir():
            raise SystemExit(f"--adapter {item!r}: expected NAME=TARGET:DIR with TARGET in {list(TARGETS)} "
                             "and an existing adapter directory")
        adapters[(name, target)] = directory
    drafts = {}
    for item in args.draft:
        name, _, rest = item.partition("=")
        target, _, directory = rest.partition(":")
        if not name or target not in TARGETS or not Path(directory).is_dir():
            raise SystemExit(f"--draft {item!r}: expected NAME=TARGET:DIR with TARGET in {list(TARGETS)}")
        drafts[name] = (target, directory)
    results: dict = {}
    for target_name in args.targets:
        model, tokenizer = load_target(TARGETS[target_name]["path"])
        results[target_name] = {}
        for mix, file in TARGETS[target_name]["mixes"].items():
            prompts = prompts_of(tokenizer, file, args.prompts)
            length = int(statistics.median(p.shape[1] for p in prompts)) + args.max_new_tokens // 2
            corpus, corpus_facts = (lookup_corpus(model, tokenizer, target_name, mix, args.corpus_prompts,
                                                  CORPUS_MAX_NEW) if args.corpus_prompts else (None, None))
            spec = heads.attach_heads(model, kind="lookup")
            modes = [False] + ([True] if args.temperature > 0 else [])
            for sample in modes:
                before = bare_verify_ms(spec, length)
                raw = run_mix(model, target_name, prompts, args.max_new_tokens, adapters, sample, drafts, corpus)
                after = bare_verify_ms(spec, length)  # the machine's speed drifts: the mean of both sides of the runs
                costs = {size: (before[size] + after[size]) / 2 for size in before}
                key = f"{mix}@T{args.temperature}" if sample else mix
                results[target_name][key] = summarise(raw, prompts, args.max_new_tokens, costs)
                results[target_name][key]["verify_bare_ms"] = costs
                results[target_name][key]["verify_bare_ms_before_after"] = [before, after]
                results[target_name][key]["corpus"] = corpus_facts
                entry = results[target_name][key]
                line = ", ".join(f"{n} {v['speedup']:.2f}x" for n, v in entry["peers"].items())
                line += " | " + ", ".join(f"{n} {v['speedup']:.2f}x tau {v['tau']:.2f} eff {v['efficiency'] or 0:.2f}"
                                          + ("" if v["identical"] or sample else " NOT IDENTICAL")
                                          for n, v in entry["selfdraft"].items())
                print(f"{target_name} / {key}: {line}", flush=True)
    settings = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "threads": args.threads, "adapters": {f"{name}@{target}": directory for (name, target), directory in adapters.items()},
                "drafts": {k: list(v) for k, v in drafts.items()},
                "corpus_prompts": args.corpus_prompts}
    path = write_json(args.out, {"settings": settings, **results})
    plot(results, RESULTS / Path(args.out).with_suffix(".png").name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
