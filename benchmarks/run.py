"""The benchmark harness: run one experiment (``benchmarks/experiments/<name>.json``) on the shipped
targets and write ``benchmarks/results/<name>.json`` and ``.png`` (the latest run only) and the
index ``benchmarks/results/README.md``.

Every cell (target x mix x temperature x batch size) runs ``generate`` and each method on the same
batches of prompts of the mix's split, in one process, the order rotated per batch
(:func:`training.evaluate.paired_runs`, the loop ``selfdraft bench`` uses). Reported per method:
the median over batches of the speedup over ``generate`` (seconds per new token) with a bootstrap
interval, tau and acceptance by depth (selfdraft methods), draft and verify ms per step. Greedy
outputs must be identical to ``generate``'s: a difference stops the run, naming method and batch.

    python -m benchmarks.run peers --quick
    python -m benchmarks.run kinds --target stories260K --prompts 20
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from benchmarks.harness import experiments, report
from benchmarks.harness.methods import FORMS, build_method
from benchmarks.harness.prompts import SPLITS, BenchmarkError, mix_prompts, target_directory


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                     epilog=f"experiments: {', '.join(experiments.names())}; methods: {FORMS}")
    parser.add_argument("experiment", help="the name of a file in benchmarks/experiments/ (without .json)")
    parser.add_argument("--quick", action="store_true", help="the experiment's quick settings (fewer prompts, tokens)")
    parser.add_argument("--target", nargs="+", default=None, help="only these of the experiment's targets")
    parser.add_argument("--mix", nargs="+", default=None, help="only these mixes")
    parser.add_argument("--method", nargs="+", default=None, help="these methods instead of the experiment's")
    parser.add_argument("--temperature", nargs="+", type=float, default=None, help="serving temperatures (0: greedy)")
    parser.add_argument("--batch", nargs="+", type=int, default=None, help="batch sizes")
    parser.add_argument("--split", choices=SPLITS, default=None, help="prompt split (even lines: tuning, odd: check)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per mix and cell")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per batch; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=report.RESULTS, help="results folder (default benchmarks/results)")
    return parser.parse_args(argv)


def configure(args: argparse.Namespace) -> experiments.Experiment:
    """The experiment as the arguments select it; every name and path checked, nothing loaded."""
    if args.threads < 1:
        raise BenchmarkError(f"--threads must be at least 1; got {args.threads}")
    experiment = experiments.load(args.experiment)
    return experiments.select(experiment, quick=args.quick, targets=args.target, mixes=args.mix, methods=args.method,
                              temperatures=args.temperature, batches=args.batch, split=args.split,
                              prompts=args.prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats)


def run_cell(model, tokenizer, methods: list, mix: str, temperature: float, batch: int,
             experiment: experiments.Experiment) -> dict:
    """All methods on the batches of one mix at one temperature and batch size; the summary per method."""
    from training.evaluate import encode_batches, paired_runs

    count = experiment.prompts - experiment.prompts % batch  # whole batches only
    texts = mix_prompts(mix, experiment.split, count)
    other = "check" if experiment.split == "tuning" else "tuning"  # warm-up prompts are never measured ones
    warmup = encode_batches(tokenizer, mix_prompts(mix, other, batch), batch)[0]
    batches = encode_batches(tokenizer, texts, batch)
    pad = tokenizer.pad_token_id
    callables = {method.name: build_method(method, model, temperature, pad) for method in methods}
    runs = paired_runs(callables, batches, experiment.max_new_tokens, repeats=experiment.repeats, warmup=warmup,
                       pad_token_id=pad)
    if temperature == 0:
        check_identical(runs)
    baseline = runs["generate"]
    summaries = {name: report.summarise(method_runs, baseline) for name, method_runs in runs.items()}
    return {"mix": mix, "temperature": temperature, "batch": batch, "batches": len(batches), "methods": summaries,
            **report.leaders(summaries, {method.name for method in methods if method.selfdraft})}


def check_identical(runs: dict) -> None:
    """Greedy outputs of every method equal ``generate``'s, batch by batch (else a BenchmarkError)."""
    import torch

    for name, method_runs in runs.items():
        for index, (run, plain) in enumerate(zip(method_runs, runs["generate"])):
            if not torch.equal(run.output, plain.output):
                raise BenchmarkError(f"{name}: greedy output differs from generate on batch {index}")


def run(experiment: experiments.Experiment, out: Path, command: str, threads: int = 1, quick: bool = False) -> dict:
    import torch

    from training.commands.common import load_model

    torch.set_num_threads(threads)
    started = time.perf_counter()
    cells = []
    for target, entry in experiment.targets.items():
        model, tokenizer = load_model(str(target_directory(target)))
        for mix in entry["mixes"]:
            for temperature in experiment.temperatures:
                for batch in experiment.batches:
                    cell = {"target": target, **run_cell(model, tokenizer, entry["methods"], mix, temperature,
                                                         batch, experiment)}
                    cells.append(cell)
                    print(f"\n{target} / {mix}, T={temperature:g}, batch {batch}, {cell['batches']} batches, "
                          f"{experiment.max_new_tokens} new tokens:\n{report.table(cell)}", flush=True)
    payload = {"run": report.run_record(experiment.name, command, time.perf_counter() - started),
               "settings": {**experiment.settings(), "quick": quick, "threads": threads},
               "definitions": report.DEFINITIONS, "cells": cells}
    path = report.write_json(f"{experiment.name}.json", payload, out)
    figure = report.plot(cells, out / f"{experiment.name}.png")
    index = report.write_index(out)
    print(f"\nwrote {path}" + (f", {figure}" if figure else "") + f" and {index}")
    return payload


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        experiment = configure(args)
        command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
        run(experiment, args.out, command, args.threads, args.quick)
    except BenchmarkError as error:
        print(f"benchmarks.run: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
