"""The benchmark harness (benchmarks/run.py): method names, experiments, the prompt split, bad input
refused by name before any model loads, and one real run on the smallest shipped target."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

import heads
from benchmarks import run as harness
from benchmarks.harness import experiments, report
from benchmarks.harness.methods import parse_method
from benchmarks.harness.prompts import ROOT, BenchmarkError, mix_prompts
from tests.conftest import build_model
from training.evaluate import Run, paired_runs, plain_method, spec_method

ADAPTER = "benchmarks/adapters/stories260K-medusa"
DRAFT = "benchmarks/targets/demo-draft"


@pytest.mark.parametrize("name, expected", [
    ("generate", dict(base="generate")),
    ("prompt_lookup_n5", dict(base="prompt_lookup", size=5)),
    ("assisted:benchmarks/targets/demo-draft", dict(base="assisted", directory=ROOT / "benchmarks/targets/demo-draft")),
    (ADAPTER, dict(base="adapter", directory=ROOT / ADAPTER, hybrid=False, auto=False)),
    (f"{ADAPTER}+lookup@auto", dict(base="adapter", hybrid=True, auto=True)),
    (f"{ADAPTER},tree=8", dict(base="adapter", tree=8)),
    ("benchmarks/adapters/stories260K-eagle,tree=5:4:16@auto",
     dict(tree={"depth": 5, "top_k": 4, "total_tokens": 16}, auto=True)),
    ("lookup_12", dict(base="lookup", size=12, auto=False)),
    ("lookup_6@auto", dict(base="lookup", size=6, auto=True)),
    (f"draft:{DRAFT}", dict(base="draft", directory=ROOT / DRAFT, tree=None, auto=False, selfdraft=True)),
    (f"draft:{DRAFT},tree=4@auto", dict(base="draft", tree=4, auto=True)),
    (f"draft:{DRAFT},tree=3:2:6", dict(tree={"depth": 3, "top_k": 2, "total_tokens": 6}, auto=False)),
    (f"draft:{ROOT / DRAFT}", dict(base="draft", directory=ROOT / DRAFT)),
])
def test_method_names_parse(name, expected):
    method = parse_method(name)
    assert method.name == name
    for key, value in expected.items():
        assert getattr(method, key) == value, key


@pytest.mark.parametrize("name, message", [
    ("medusa_fast", "unknown method 'medusa_fast'"),
    ("benchmarks/adapters/no-such-adapter+lookup", "no adapter (adapter_config.json) in"),
    ("assisted:benchmarks/targets/nowhere", "no model (config.json)"),
    ("draft:benchmarks/targets/nowhere", "method 'draft:benchmarks/targets/nowhere': no model (config.json) in"),
    ("draft:benchmarks/adapters/stories260K-medusa", "no model (config.json)"),  # an adapter is no model
    ("draft:", "method 'draft:': no model (config.json)"),
    ("draft:benchmarks/targets/nowhere@auto", "no model (config.json)"),
    (f"draft:{DRAFT},tree=wide", "neither a node count nor DEPTH:TOP_K:TOTAL"),
    (f"draft:{DRAFT},depth=3", "unknown option 'depth=3'"),
    (f"assisted:{DRAFT}@auto", "apply to selfdraft methods only"),
    ("generate@auto", "apply to selfdraft methods only"),
    ("prompt_lookup_n3,tree=4", "apply to selfdraft methods only"),
    ("lookup_0", "the size must be at least 1"),
    (f"{ADAPTER},tree=wide", "neither a node count nor DEPTH:TOP_K:TOTAL"),
    (f"{ADAPTER},depth=3", "unknown option 'depth=3'"),
])
def test_bad_method_names_are_named(name, message):
    with pytest.raises(BenchmarkError) as raised:
        parse_method(name)
    assert message in str(raised.value)


def test_the_split_is_even_lines_for_tuning_and_odd_for_check(tmp_path):
    lines = [json.dumps({"prompt": f"p{i}"}) for i in range(5)]
    (tmp_path / "mix.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is no prompt
    assert mix_prompts("mix", "tuning", directory=tmp_path) == ["p0", "p2", "p4"]
    assert mix_prompts("mix", "check", directory=tmp_path) == ["p1", "p3"]
    assert mix_prompts("mix", "check", 1, directory=tmp_path) == ["p1"]
    with pytest.raises(BenchmarkError, match="has 2 prompts in its check split; 3 asked for"):
        mix_prompts("mix", "check", 3, directory=tmp_path)
    with pytest.raises(BenchmarkError, match="unknown mix 'poetry'"):
        mix_prompts("poetry", "check", directory=tmp_path)
    shipped = mix_prompts("stories", "tuning", 2) + mix_prompts("stories", "check", 2)
    assert len(set(shipped)) == 4  # the shipped mix's splits are disjoint


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr("training.commands.common.load_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["nope"], "unknown experiment 'nope': expected one of"),
    (["peers", "--method", "generate", "medusa_fast"], "unknown method 'medusa_fast'"),
    (["peers", "--method", "benchmarks/adapters/missing"], "no adapter (adapter_config.json) in"),
    (["peers", "--target", "gpt-5"], "--target gpt-5: experiment 'peers' runs"),
    (["peers", "--mix", "poetry"], "--mix poetry: the chosen targets run"),
    (["peers", "--batch", "2"], "run at batch size 1 only"),
    (["peers", "--prompts", "0"], "prompts must be a whole number >= 1"),
    (["peers", "--temperature", "-1"], "temperatures must be numbers >= 0"),
    (["batch", "--batch", "8", "--prompts", "4"], "4 prompts make no batch of 8"),
    (["peers", "--threads", "0"], "--threads must be at least 1"),
    (["peers", "--target", "stories260K", "--prompts", "51"], "mix 'stories' has 50 prompts in its check split; 51"),
])
def test_bad_input_is_refused_by_name_before_any_model_loads(argv, message, capsys, no_model_loading, tmp_path):
    assert harness.main(argv + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_every_shipped_experiment_loads_and_has_a_quick_form():
    for name in experiments.names():
        experiment = experiments.load(name)
        quick = experiments.select(experiment, quick=True)
        assert experiment.quick and quick.prompts <= experiment.prompts
        assert all(entry["methods"][0].name == "generate" or "generate" in {m.name for m in entry["methods"]}
                   for entry in experiment.targets.values())


def test_the_loop_rotates_the_order_and_keeps_the_fastest_repeat():
    calls = []

    def method(name):
        def run(ids, mask, new):
            calls.append(name)
            if calls.count(name) == 1:
                time.sleep(0.05)  # each method's first call is slow
            return torch.cat([ids, torch.zeros(ids.shape[0], new, dtype=ids.dtype)], dim=1), None
        return run

    batches = [(torch.ones(1, 3, dtype=torch.long), None)] * 3
    runs = paired_runs({name: method(name) for name in "abc"}, batches, 4, repeats=2)
    assert calls == list("abcabc" "bcabca" "cabcab")
    assert [len(runs[name]) for name in "abc"] == [3, 3, 3]
    assert all(run.steps == 4 and run.new_tokens == 4 for run in runs["a"])
    assert all(runs[name][0].seconds < 0.05 for name in "abc")  # the fast repeat counts


def test_the_loop_on_a_tiny_model_matches_generate():
    model = build_model("llama", seed=1)
    spec = heads.attach_heads(model, kind="lookup", budget=4, history_tokens=0)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    runs = paired_runs({"generate": plain_method(model, 0.0), "lookup": spec_method(spec, 0.0)}, [(prompt, None)], 4)
    plain, drafted = runs["generate"][0], runs["lookup"][0]
    assert plain.stats is None and drafted.stats is not None and drafted.steps == 4
    assert torch.equal(plain.output, drafted.output)
    summary = report.summarise(runs["lookup"], runs["generate"])
    assert summary["tau"] == pytest.approx(drafted.stats.tau) and summary["speedup"] > 0
    assert "tau" not in report.summarise(runs["generate"], runs["generate"])


def test_a_greedy_mismatch_names_the_method_and_the_batch():
    same, other = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    runs = {"generate": [Run(1.0, same, 1, 1), Run(1.0, same, 1, 1)],
            "lookup_4": [Run(1.0, same, 1, 1), Run(1.0, other, 1, 1)]}
    with pytest.raises(BenchmarkError, match="lookup_4: greedy output differs from generate on batch 1"):
        harness.check_identical(runs)


def test_a_run_writes_its_result_and_the_index(tmp_path, capsys):
    (tmp_path / "auto.json").write_text(json.dumps({"machine": {"cpus": 2, "torch": "x", "threads": 1}}))
    argv = ["peers", "--target", "stories260K", "--method", "lookup_4", "prompt_lookup_n3", "--temperature", "0",
            "--prompts", "1", "--max-new-tokens", "4", "--out", str(tmp_path)]
    assert harness.main(argv) == 0
    result = json.loads((tmp_path / "peers.json").read_text())
    assert result["run"]["command"] == "python -m benchmarks.run " + " ".join(argv)
    (cell,) = result["cells"]
    assert (cell["target"], cell["mix"], cell["batches"]) == ("stories260K", "stories", 1)
    assert set(cell["methods"]) == {"generate", "lookup_4", "prompt_lookup_n3"}
    assert "tau" in cell["methods"]["lookup_4"] and "tau" not in cell["methods"]["prompt_lookup_n3"]
    assert (cell["best_selfdraft"]["name"], cell["best_peer"]["name"]) == ("lookup_4", "prompt_lookup_n3")
    assert cell["best_over_best_peer"] == pytest.approx(cell["methods"]["lookup_4"]["speedup"]
                                                        / cell["methods"]["prompt_lookup_n3"]["speedup"])
    assert (tmp_path / "peers.png").stat().st_size > 0
    index = (tmp_path / "README.md").read_text().splitlines()
    assert any(line.startswith("| `peers.json` | peers | `python -m benchmarks.run peers") for line in index)
    assert any(line.startswith("| `auto.json` | - | benchmarks/bench_auto.py") for line in index)


def test_a_draft_method_runs_and_matches_generate(tmp_path):
    # stories260K drafting for itself: every drafted token is the target's own argmax
    argv = ["peers", "--target", "stories260K", "--method", "draft:benchmarks/targets/stories260K",
            "draft:benchmarks/targets/stories260K,tree=2@auto", "--temperature", "0", "--prompts", "1",
            "--max-new-tokens", "12", "--out", str(tmp_path)]
    assert harness.main(argv) == 0  # greedy outputs identical to generate's, else a BenchmarkError
    (cell,) = json.loads((tmp_path / "peers.json").read_text())["cells"]
    drafted = cell["methods"]["draft:benchmarks/targets/stories260K"]
    assert drafted["tau"] > 1.0 and cell["best_selfdraft"]["name"].startswith("draft:")


def test_a_draft_model_on_another_vocabulary_is_named(tmp_path, capsys):
    argv = ["peers", "--target", "stories260K", "--method", f"draft:{DRAFT}", "--prompts", "1",
            "--max-new-tokens", "2", "--temperature", "0", "--out", str(tmp_path)]
    assert harness.main(argv) == 2
    assert f"method 'draft:{DRAFT}':" in capsys.readouterr().err
    assert not (tmp_path / "peers.json").exists()


def test_another_targets_adapter_is_named(tmp_path, capsys):
    argv = ["peers", "--target", "stories260K", "--method", "benchmarks/adapters/demo-llama-medusa", "--prompts", "1",
            "--max-new-tokens", "2", "--temperature", "0", "--out", str(tmp_path)]
    assert harness.main(argv) == 2
    assert "method 'benchmarks/adapters/demo-llama-medusa':" in capsys.readouterr().err
    assert not (tmp_path / "peers.json").exists()


def test_the_plot_is_skipped_with_a_line_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    cell = {"target": "t", "mix": "m", "temperature": 0.0, "batch": 1, "methods": {"generate": {"speedup": 1.0}}}
    assert report.plot([cell], tmp_path / "x.png") is None
    assert "plot skipped: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_bench_auto_twin_reports_the_noise_between_identical_methods(tmp_path):
    """``bench_auto.py --twin``: a second copy of the largest size runs beside the others, is never
    the best fixed size, and its ratio to that size is reported."""
    from benchmarks import bench_auto

    argv = ["--target", "stories260K", "--mix", "stories", "--drafter", "lookup", "--prompts", "1",
            "--max-new-tokens", "4", "--repeats", "1", "--twin", "--name", "cell", "--results", str(tmp_path)]
    assert bench_auto.main(argv) == 0  # greedy: every method's output (the twin's too) equals generate's
    cell = json.loads((tmp_path / "cell.json").read_text())
    twin = [name for name in cell["median_speedup"] if name.startswith("twin")]
    assert twin == [f"twin {max(int(name.split()[1]) for name in cell['median_speedup'] if name.startswith('size'))}"]
    assert cell["best_fixed"].startswith("size ")
    assert cell["twin_over_its_size"] == pytest.approx(
        cell["median_speedup"][twin[0]] / cell["median_speedup"][f"size {twin[0].split()[1]}"], abs=2e-3)
