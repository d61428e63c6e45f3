"""bench_kinds: its arguments are checked by name before any model loads; its paired interval."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_kinds import bootstrap_median, parse_args  # noqa: E402


@pytest.fixture
def adapters(tmp_path):
    made = []
    for name in ("one", "two"):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "adapter_config.json").write_text("{}")
        made.append(str(directory))
    return made


@pytest.mark.parametrize("extra, message", [
    (["--mix", "poetry"], "--mix must be one of"),
    (["--prompts", "0"], "--prompts must be at least 1"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
    (["--prompt-lookup", "0"], "--prompt-lookup sizes must be at least 1"),
    (["--lookup", "-1"], "--lookup sizes must be at least 1"),
    (["--out", "../elsewhere.json"], "--out must be a .json file name"),
    (["--out", "kinds.txt"], "--out must be a .json file name"),
    (["--history"], "--history adds lookup with its cross-request history for each --lookup N"),
])
def test_bad_arguments_are_named(adapters, capsys, extra, message):
    argv = ["--target", "demo-llama", "--mix", "prose", "--adapter", f"a={adapters[0]}",
            "--adapter", f"b={adapters[1]}"]
    with pytest.raises(SystemExit) as raised:
        parse_args(argv + extra)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_adapters_are_checked(adapters, tmp_path, capsys):
    base = ["--target", "stories260K", "--mix", "stories"]
    for argv, message in [
        (base + ["--adapter", f"a={adapters[0]}"], "at least two"),
        (base + ["--adapter", f"a={adapters[0]}", "--adapter", f"a={adapters[1]}"], "given twice"),
        (base + ["--adapter", f"a={adapters[0]}", "--adapter", f"b={tmp_path / 'missing'}"], "no adapter_config.json"),
        (base + ["--adapter", f"a={adapters[0]}", "--adapter", adapters[1]], "NAME=DIR"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    args = parse_args(base + ["--adapter", f"a={adapters[0]}", "--adapter", f"b={adapters[1]}"])
    assert args.adapters == {"a": adapters[0], "b": adapters[1]} and args.prompts == 24
    # one adapter is enough with its hybrid or a peer beside it
    assert parse_args(base + ["--adapter", f"a={adapters[0]}", "--hybrid"]).hybrid
    assert parse_args(base + ["--adapter", f"a={adapters[0]}", "--prompt-lookup", "10"]).prompt_lookup == [10]
    assert parse_args(base + ["--lookup", "10"]).lookup == [10]  # lookup alone: fixed and @auto
    with pytest.raises(SystemExit):
        parse_args(base + ["--hybrid", "--lookup", "10"])
    assert "--hybrid makes each --adapter" in capsys.readouterr().err


def test_bootstrap_interval_holds_the_median_and_narrows_with_more_prompts():
    few = [0.9, 1.1, 1.0, 1.2, 0.95, 1.05]
    low, high = bootstrap_median(few)
    assert low <= statistics.median(few) <= high and low >= min(few) and high <= max(few)
    many = few * 10
    low_many, high_many = bootstrap_median(many)
    assert high_many - low_many < high - low
    assert bootstrap_median([1.0] * 5) == (1.0, 1.0)


def test_history_runs_keep_only_prompts_that_share_no_window(tmp_path, monkeypatch):
    """With --history no two prompts of a run share a WINDOW-word window (a history holding a
    near-duplicate request would copy its continuation); the first of each overlapping pair is kept."""
    import json

    import benchmarks.common
    from benchmarks.bench_kinds import WINDOW, distinct_prompts

    words = [f"w{i}" for i in range(60)]
    texts = [" ".join(words[0:20]), " ".join(words[5:25]), " ".join(words[30:50]),  # 2nd overlaps the 1st
             " ".join(words[30:30 + WINDOW - 1] + ["x"]), "short prompt", "short prompt"]
    (tmp_path / "mix.jsonl").write_text("\n".join(json.dumps({"prompt": text}) for text in texts) + "\n")
    monkeypatch.setattr(benchmarks.common, "PROMPTS", tmp_path)

    class Tokenizer:
        def __call__(self, text, return_tensors):
            import torch
            return type("Encoded", (), {"input_ids": torch.tensor([[len(text)]])})()

    kept = distinct_prompts(Tokenizer(), "mix.jsonl", 10)
    # kept: the 1st, the 3rd; the 4th shares only WINDOW - 1 words with the 3rd; one "short prompt"
    assert [int(p) for p in kept] == [len(texts[0]), len(texts[2]), len(texts[3]), len(texts[4])]
    assert len(distinct_prompts(Tokenizer(), "mix.jsonl", 2)) == 2
