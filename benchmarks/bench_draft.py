"""The draft kind with its defaults against transformers' assisted generation with the same draft.

One process, side by side, per prompt in a rotating order: ``model.generate`` alone,
``model.generate(assistant_model=draft)`` (transformers' defaults: its heuristic number of
assistant tokens and assistant confidence threshold) and selfdraft ``kind="draft"`` with its
defaults (optionally also a fixed chain of 4, ``--fixed``). Prompts from
``targets/prompts/<mix>.jsonl``: the check split is the odd lines (1st, 3rd, ...: line numbers 1,
3, ... counting from 0), the tuning split the even ones. Greedy (``--temperature 0``) or sampled
(top_k 0). Speedups are medians over prompts of per-token seconds ratios (sampled runs may stop at
eos after different lengths); tau is tokens per target forward (a forward hook counts them for
``generate`` and assisted generation).

    OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_draft --mix code --temperature 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import heads
from benchmarks.harness.prompts import PROMPTS
from benchmarks.harness.report import write_json

TARGETS = Path(__file__).resolve().parent / "targets"


def read_prompts(mix: str, split: str, count: int) -> list[str]:
    lines = (PROMPTS / f"{mix}.jsonl").read_text().splitlines()
    chosen = lines[1::2] if split == "check" else lines[0::2]
    return [json.loads(line)["prompt"] for line in chosen[:count]]


class ForwardCounter:
    """Counts the target's forwards while :attr:`active`."""

    def __init__(self, model) -> None:
        self.calls, self.active = 0, False
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if self.active:
            self.calls += 1


def methods(model, draft, counter: ForwardCounter, settings: dict, fixed: bool) -> dict:
    pad = model.generation_config.pad_token_id
    specs = {"draft": heads.attach_heads(model, kind="draft", draft_model=draft)}
    if fixed:
        specs["draft_fixed4"] = heads.attach_heads(model, kind="draft", draft_model=draft, depth=4, total_tokens=4,
                                                   adaptive=False)

    def counted(call):
        def run(ids, new):
            counter.calls, counter.active = 0, True
            try:
                output = call(ids, new)
            finally:
                counter.active = False
            return output, counter.calls
        return run

    table = {
        "generate": counted(lambda ids, new: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                            max_new_tokens=new, pad_token_id=pad, **settings)),
        "assisted": counted(lambda ids, new: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                            max_new_tokens=new, assistant_model=draft,
                                                            pad_token_id=pad, **settings)),
    }
    for name, spec in specs.items():
        def run(ids, new, spec=spec):
            output = spec.generate(ids, max_new_tokens=new, **settings)
            return output, spec.last_stats.target_forwards
        table[name] = run
    return table


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(TARGETS / "demo-llama"))
    parser.add_argument("--draft", default=str(TARGETS / "demo-draft"))
    parser.add_argument("--mix", default="code")
    parser.add_argument("--split", choices=("check", "tune"), default="check")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--fixed", action="store_true", help="also a fixed chain of 4 (adaptive=False)")
    parser.add_argument("--name", default=None, help="results file (default draft_<mix>_T<t>.json)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    settings = {"do_sample": False} if args.temperature == 0 else \
        {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    counter = ForwardCounter(model)
    table = methods(model, draft, counter, settings, args.fixed)
    names = list(table)
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in read_prompts(args.mix, args.split,
                                                                                         args.prompts)]
    for name in names:  # warm-up: first calls, and the draft kind's first costs
        table[name](prompts[0], 8)
    rows = []
    for index, ids in enumerate(prompts):
        row = {}
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            torch.manual_seed(index)
            start = time.perf_counter()
            output, forwards = table[name](ids, args.new)
            seconds = time.perf_counter() - start
            new = output.shape[1] - ids.shape[1]
            row[name] = {"seconds": seconds, "new_tokens": new, "forwards": forwards, "tau": new / max(forwards, 1),
                         "output": output[0, ids.shape[1]:].tolist()}
        rows.append(row)
        print(f"prompt {index}: " + "  ".join(f"{name} {row[name]['seconds']:.2f}s tau {row[name]['tau']:.2f}"
                                             for name in names), flush=True)

    def per_token(row, name):
        return row[name]["seconds"] / max(row[name]["new_tokens"], 1)

    summary = {}
    for name in names:
        summary[name] = {
            "speedup_over_generate": statistics.median(per_token(r, "generate") / per_token(r, name) for r in rows),
            "tau": statistics.median(r[name]["tau"] for r in rows),
            "ms_per_token": 1000 * statistics.median(per_token(r, name) for r in rows),
        }
        if name != "assisted":
            summary[name]["over_assisted"] = statistics.median(per_token(r, "assisted") / per_token(r, name)
                                                               for r in rows)
    if args.temperature == 0:
        for name in names:
            summary[name]["identical"] = all(r[name]["output"] == r["generate"]["output"] for r in rows)
    payload = {"target": args.target, "draft": args.draft, "mix": args.mix, "split": args.split,
               "prompts": len(prompts), "new_tokens": args.new, "temperature": args.temperature,
               "sampling": "greedy" if args.temperature == 0 else "top_k 0, top_p 1",
               "threads": torch.get_num_threads(), "summary": summary,
               "per_prompt": [{name: {k: v for k, v in r[name].items() if k != "output"} for name in names}
                              for r in rows]}
    name = args.name or f"draft_{args.mix}_T{args.temperature:g}.json"
    path = write_json(name, payload)
    for method, values in summary.items():
        print(method, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
