"""Loop overhead of this checkout against another commit, in one run: the one-node-tree ratio
(``spec.generate`` with ``tree=0`` over ``model.generate``, greedy, tiny random Llama) measured in
alternating subprocesses, one per checkout, so both see the same machine load.

    python -m benchmarks.studies.compare_commits.compare_commits --before 65d7374 --rounds 6

Writes ``overhead_commits.json`` beside this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.studies.common import ROOT, write_json

HERE = Path(__file__).resolve().parent

SNIPPET = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, ".")
torch.set_num_threads(1)
import heads
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=4)).eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
spec = heads.attach_heads(model, tree=0)
ratios = []
for length in (16, 24, 32):
    prompt = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    def median(function):
        times = []
        for _ in range(4):
            start = time.perf_counter(); function(); times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    plain = median(lambda: model.generate(prompt, do_sample=False, max_new_tokens=48, pad_token_id=0))
    spec_time = median(lambda: spec.generate(prompt, max_new_tokens=48))
    ratios.append(spec_time / plain)
print(json.dumps(statistics.median(ratios)))
"""


def measure(checkout: Path) -> float:
    result = subprocess.run([sys.executable, "-c", SNIPPET], cwd=checkout, capture_output=True, text=True,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare with (e.g. the previous main)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating measurements per checkout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            ratios = {"before": [], "after": []}
            for _ in range(args.rounds):
                ratios["before"].append(measure(before))
                ratios["after"].append(measure(ROOT))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    summary = {name: statistics.median(values) for name, values in ratios.items()}
    print(json.dumps({"before": args.before, **summary}, indent=2))
    write_json("overhead_commits.json", {"before_commit": args.before, "ratios": ratios, "median": summary}, HERE)


if __name__ == "__main__":
    main()
