"""`selfdraft train` from training to serving (issue 36): `--for` makes the default EAGLE adapter one
engines load (and refuses contradicting flags before any work), tau is measured on prompts held out
from training and labelled with its split, and Ctrl-C or no command end with one line and an exit
code."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import VOCAB
from tests.training.test_cli import (  # noqa: F401  (fixtures)
    _one_line_error, _tokenizer, _write_prompts, model_dir as shallow_model_dir, no_model_loading,
)
from training.cli import build_parser, main
from training.commands import train as train_command


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> Path:
    """A 4-layer Llama (random weights): deep enough for EAGLE-3's three fused layers."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    directory = tmp_path_factory.mktemp("deep-model")
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory



def _args(model_dir, data, out, *extra, kind="eagle", steps=3, cache=None) -> list[str]:
    return ["train", "--model", str(model_dir), "--kind", kind, "--data", str(data), "--out", str(out),
            "--steps", str(steps), "--batch-size", "4", "--warmup-steps", "1", "--max-new-tokens", "8",
            "--max-length", "16", "--cache-dir", str(cache or Path(out).parent / "cache"), "--eval-prompts", "0",
            "--no-progress", *extra]


def _checked(argv: list[str]):
    """``check_arguments`` of a train command line: ``(args, (TrainConfig, engine, export line))``."""
    args = build_parser().parse_args(argv)
    return args, train_command.check_arguments(args, 1)


def test_default_eagle_exports_to_eagle3_and_speculators(deep_model_dir, tmp_path, capsys):
    """Item 2: a default `selfdraft train --kind eagle` exported natively-parallel (no engine loaded it);
    now the default is engine-loadable, says so before training, records `for`, and exports."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 8, seed=1)
    adapter = tmp_path / "adapter"
    assert main(_args(deep_model_dir, data, adapter)) == 0
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.startswith("--for"))
    assert line.startswith("--for any (default): this eagle adapter will export to eagle3 (vLLM, SGLang), "
                           "speculators (vLLM)"), line
    assert out.index(line) < out.index("saved adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["training"]["for"] == "any"
    assert config["drafter"]["layout"] == "eagle3" and config["drafter"]["parallel"] == 1
    assert config["drafter"]["feature_layers"] == [1, 2, 3]
    for fmt in ("eagle3", "speculators"):
        assert main(["export", "--adapter", str(adapter), "--format", fmt, "--out", str(tmp_path / fmt),
                     "--model", str(deep_model_dir)]) == 0, capsys.readouterr().err
        assert (tmp_path / fmt / "config.json").is_file()


def test_for_hf_keeps_selfdraft_settings_and_says_what_will_not_export(deep_model_dir, tmp_path, no_model_loading):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    args, (_, engine, line) = _checked(_args(deep_model_dir, data, tmp_path / "a", "--for", "hf"))
    assert engine == "hf" and train_command.drafter_options(args)["parallel"] == 4
    assert line.startswith("--for hf: this eagle adapter will export to no engine format; it will not load in vLLM "
                           "or SGLang: this drafter has layout 'native'"), line
    assert line.endswith("(train with --for vllm or --for sglang for an engine)")


@pytest.mark.parametrize("extra, expected", [
    (["--parallel", "4"], ("hf", "will not load in vLLM or SGLang")),  # a selfdraft-only flag: selfdraft only
    (["--eagle-layout", "eagle1"], ("any", "will export to eagle (vLLM, SGLang)")),
    (["--for", "sglang"], ("sglang", "eagle3 (vLLM, SGLang)")),
])
def test_default_and_engines_resolve_before_loading(deep_model_dir, tmp_path, no_model_loading, extra, expected):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    _, (_, engine, line) = _checked(_args(deep_model_dir, data, tmp_path / "a", *extra))
    assert engine == expected[0] and expected[1] in line, line


@pytest.mark.parametrize("extra, unroll", [
    ([], 2),  # --for any (default): the engine layout drafts sequentially, so training unrolls a step
    (["--for", "vllm"], 2),
    (["--eagle-layout", "eagle1"], 2),
    (["--for", "sglang", "--unroll-steps", "1"], 1),  # given: kept
    (["--for", "hf"], 1),  # parallel depths: nothing sequential to unroll
    (["--parallel", "4"], 1),  # resolves to hf
    (["--for", "hf", "--unroll-steps", "3"], 3),
])
def test_unroll_steps_default_follows_the_layout(deep_model_dir, tmp_path, no_model_loading, extra, unroll):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    _, (config, _, _) = _checked(_args(deep_model_dir, data, tmp_path / "a", *extra))
    assert config.unroll_steps == unroll, extra


def test_default_on_a_target_too_shallow_for_eagle3_is_the_eagle1_layout(shallow_model_dir, tmp_path,
                                                                         no_model_loading):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    args, (_, engine, line) = _checked(_args(shallow_model_dir, data, tmp_path / "a"))
    assert engine == "any" and args.eagle_layout == "eagle1" and args.parallel == 1
    assert "will export to eagle" in line, line


def test_an_engine_with_parallel_heads_keeps_them_for_selfdraft(deep_model_dir, tmp_path, no_model_loading):
    """``--for vllm --parallel 4``: the EAGLE-3 layer engines load, trained sequentially (unrolled), plus
    parallel heads selfdraft drafts with; the export leaves the heads behind."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    args, (config, engine, line) = _checked(_args(deep_model_dir, data, tmp_path / "a", "--for", "vllm",
                                                  "--parallel", "4"))
    options = train_command.drafter_options(args)
    assert engine == "vllm" and options["layout"] == "eagle3" and options["parallel"] == 4
    assert options["drafting"] == "auto" and config.unroll_steps == 2
    assert "will export to eagle3 (vLLM, SGLang), speculators (vLLM)" in line, line


@pytest.mark.parametrize("extra, message", [
    (["--for", "vllm", "--parallel", "4", "--parallel-mode", "mask"],
     "--for vllm: --parallel 4, --parallel-mode: engines load sequential EAGLE drafters"),
    (["--for", "sglang", "--eagle-layout", "native", "--drafting", "auto"],
     "--for sglang: --drafting auto, --eagle-layout native"),
    (["--for", "any", "--feature-layers", "1,2"], "--for any: --feature-layers 1,2"),
    (["--for", "vllm", "--parallel-mode", "heads"], "--for vllm: --parallel-mode"),
    (["--for", "sglang", "--kind", "medusa"], "--for sglang: SGLang serves no Medusa heads"),
    (["--for", "gpu"], None),  # argparse's own refusal of an unknown choice
])
def test_for_refuses_contradicting_flags_before_loading(deep_model_dir, tmp_path, capsys, no_model_loading, extra,
                                                        message):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    if message is None:
        with pytest.raises(SystemExit) as exit_info:
            main(_args(deep_model_dir, data, tmp_path / "a", *extra))
        assert exit_info.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err
        return
    assert main(_args(deep_model_dir, data, tmp_path / "a", *extra)) == 2
    assert message in _one_line_error(capsys, "train")
    assert not (tmp_path / "a").exists()


def test_for_an_engine_on_a_shallow_target_is_refused(shallow_model_dir, tmp_path, capsys, no_model_loading):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    assert main(_args(shallow_model_dir, data, tmp_path / "a", "--for", "vllm")) == 2
    assert re.search(r"--for vllm: EAGLE-3 fuses three .* this target has 2 layers .*--eagle-layout eagle1",
                     _one_line_error(capsys, "train"))
    assert main(_args(shallow_model_dir, data, tmp_path / "b", "--for", "any", "--eagle-layout", "eagle3")) == 2


# ----------------------------------------------------------------------------- held-out tau (item 4)

def _split_args(**changes) -> argparse.Namespace:
    values = dict(eval_prompts=8, eval_data=None, eval_fraction=None, seed=0, data="prompts.txt")
    return argparse.Namespace(**{**values, **changes})


def test_evaluation_split_holds_prompts_out_of_training():
    prompts = [f"prompt {index}" for index in range(30)]
    kept, held, split = train_command.evaluation_split(_split_args(), prompts)
    assert split == "held-out" and len(held) == 3 and len(kept) == 27  # ceil(10% of 30)
    assert not set(kept) & set(held) and sorted(kept + held, key=prompts.index) == prompts
    assert (kept, held) == train_command.evaluation_split(_split_args(), prompts)[:2]  # deterministic
    assert held != train_command.evaluation_split(_split_args(seed=1), prompts)[1]  # seeded, not the file's tail
    assert len(train_command.evaluation_split(_split_args(eval_fraction=0.5), prompts)[1]) == 8  # <= --eval-prompts
    assert len(train_command.evaluation_split(_split_args(eval_fraction=0.01), prompts)[1]) == 1  # >= 1
    assert train_command.evaluation_split(_split_args(eval_fraction=0.0), prompts) == (prompts, prompts[:8],
                                                                                      "in-sample")
    assert train_command.evaluation_split(_split_args(eval_data="other.jsonl"), prompts) == (prompts, [], "eval-data")
    assert train_command.evaluation_split(_split_args(eval_prompts=0), prompts) == (prompts, [], None)
    assert train_command.evaluation_split(_split_args(), prompts[:2])[2] == "in-sample"  # too few to hold one out


def test_train_records_held_out_tau_and_its_split(deep_model_dir, tmp_path, capsys):
    """Item 4: without --eval-data, tau came from the first prompts of the training file itself."""
    data = _write_prompts(tmp_path / "prompts.jsonl", 20, seed=3)
    adapter = tmp_path / "adapter"
    argv = _args(deep_model_dir, data, adapter, kind="medusa", steps=2)
    argv[argv.index("--eval-prompts") + 1] = "4"
    assert main(argv + ["--eval-max-new-tokens", "4"]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    greedy, sampled = config["acceptance"]["prompts"]  # the default recipe: measured greedy and at 0.7
    assert sampled["temperature"] == 0.7 and sampled["split"] == "held-out" and sampled["prompts"] == 2
    entry = greedy
    assert entry["split"] == "held-out" and entry["prompts"] == 2  # ceil(10% of 20)
    assert config["training"]["prompts"] == 18 and config["training"]["held_out_prompts"] == 2


def test_check_says_how_the_recorded_tau_was_measured():
    from training.commands.check import split_label

    assert split_label({"tau": 2.0, "split": "held-out"}) == " (held-out prompts)"
    assert split_label({"tau": 2.0, "split": "in-sample"}) == " (in-sample: training prompts)"
    assert split_label({"tau": 2.0}) == ""  # adapters written before the label


def test_eval_fraction_is_checked_before_loading(deep_model_dir, tmp_path, capsys, no_model_loading):
    data = _write_prompts(tmp_path / "prompts.jsonl", 4, seed=1)
    for extra, message in ((["--eval-fraction", "1"], "--eval-fraction must be a number >= 0 and < 1"),
                           (["--eval-fraction", "0.2", "--eval-data", str(data)], "--eval-fraction holds out")):
        assert main(_args(deep_model_dir, data, tmp_path / "a", *extra)) == 2
        assert message in _one_line_error(capsys, "train")


# ----------------------------------------------------------------------------- Ctrl-C, no command (item 16)

def _interrupt(monkeypatch):
    from training.trainer import DistillationTrainer

    def interrupted(self, resume=False, stop_after=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(DistillationTrainer, "train", interrupted)


def _main_interrupted(argv: list[str]) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left selfdraft train as a KeyboardInterrupt traceback")


def test_ctrl_c_says_where_training_resumes_from(deep_model_dir, tmp_path, capsys, monkeypatch):
    data = _write_prompts(tmp_path / "prompts.jsonl", 8, seed=1)
    checkpoints = tmp_path / "checkpoints"
    saving = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2")
    assert main(_args(deep_model_dir, data, tmp_path / "first", *saving, kind="medusa", steps=4)) == 0
    capsys.readouterr()
    _interrupt(monkeypatch)
    argv = _args(deep_model_dir, data, tmp_path / "second", *saving, "--resume", kind="medusa", steps=4)
    assert _main_interrupted(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == (f"selfdraft train: interrupted: the latest checkpoint is "
                                            f"{checkpoints / 'step-0000004'}; run the same command again to "
                                            "continue from it")
    assert _main_interrupted(_args(deep_model_dir, data, tmp_path / "third", kind="medusa")) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "selfdraft train: interrupted: no checkpoint was written; give --checkpoint-dir DIR --checkpoint-every N to "
        "make training resumable")


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: selfdraft") and "error: a command is required (train, bench" in err


@pytest.mark.parametrize("command", ["train", "bench", "check", "select", "corpus"])
def test_every_command_that_reads_prompts_takes_paragraphs(command):
    """Item 5: plain text is one prompt per line; --paragraphs reads blank-line-separated ones."""
    required = {"train": ["--model", "m", "--data", "d", "--out", "o"],
                "corpus": ["--model", "m", "--data", "d", "--out", "o"]}
    argv = [command, *required.get(command, ["--model", "m", "--adapter", "a", "--data", "d"])]
    if command == "select":
        argv = [command, "--model", "m", "--data", "d"]
    assert build_parser().parse_args(argv).paragraphs is False
    assert build_parser().parse_args(argv + ["--paragraphs"]).paragraphs is True
