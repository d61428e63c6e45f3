"""The acceptance objectives (``--loss tvd | nla | lk_hybrid``) with position weighting
(``--position-decay``) reach every trainable kind: the hooks weigh each drafting depth and blend
``lk_hybrid`` per depth, each kind trains a few steps from the command line with each objective on
the toy target, the adapter records the objective, and mistakes are refused before any model loads."""

from __future__ import annotations

import json
import math

import pytest
import torch

from heads.medusa.loss import head_losses
from tests.training.test_cli import _write_prompts
from tests.training.test_draft_cli import save_target_and_draft
from training import losses
from training.cli import main
from training.config import TrainConfig

ACCEPTANCE_OBJECTIVES = ("tvd", "nla", "lk_hybrid")


@pytest.mark.parametrize("objective", ACCEPTANCE_OBJECTIVES)
def test_medusa_heads_weigh_each_depth_and_blend_per_depth(objective):
    """Head k's loss (against the target k + 1 positions on) weighted decay ** k; for lk_hybrid each
    head's blend comes from that head's own mean overlap, not the batch of all heads."""
    generator = torch.Generator().manual_seed(4)
    heads_logits = torch.randn(3, 2, 6, 7, generator=generator)  # (K, B, T, V)
    teacher = torch.randn(2, 6, 7, generator=generator)  # (B, T, V)
    attention_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    input_ids = torch.zeros(2, 6, dtype=torch.long)
    config = TrainConfig(divergence=objective, head_decay=0.5)
    total, _ = head_losses(heads_logits, teacher, input_ids, attention_mask, config, losses=losses)
    expected = 0.0
    for k in range(3):
        shift = k + 1
        student, target = heads_logits[k][:, :6 - shift], teacher[:, shift:]
        valid = attention_mask[:, shift:].bool()
        if objective == "tvd":
            per_position = 1 - losses.acceptance_overlap(student, target)
        elif objective == "nla":
            per_position = -losses.acceptance_overlap(student, target).log()
        else:
            overlap = losses.acceptance_overlap(student, target)
            blend = math.exp(-3.0 * float(overlap[valid].mean()))
            per_position = blend * losses.forward_kl(student, target) + (1 - blend) * (1 - overlap)
        expected += 0.5 ** k * float(per_position[valid].mean())
    assert float(total) == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def dirs(toy_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("objectives")
    save_target_and_draft(toy_target, root)
    _write_prompts(root / "prompts.jsonl", 12, seed=11)
    return root


def _train(root, out, kind: str, *extra: str) -> list[str]:
    args = ["train", "--model", str(root / "model"), "--kind", kind, "--data", str(root / "prompts.jsonl"),
            "--out", str(out), "--steps", "3", "--batch-size", "4", "--lr", "5e-3", "--warmup-steps", "1",
            "--max-new-tokens", "12", "--max-length", "20", "--cache-dir", str(root / "cache"), "--eval-prompts", "2",
            "--eval-max-new-tokens", "8", "--no-progress", *extra]
    if kind == "draft":
        args += ["--draft", str(root / "draft")]
    elif kind == "eagle":
        args += ["--for", "hf"]  # parallel heads too: their depths are weighted and blended the same way
    else:
        args += ["--num-heads", "2"]
    return args


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft"])
@pytest.mark.parametrize("objective", ACCEPTANCE_OBJECTIVES)
def test_each_kind_trains_with_each_acceptance_objective(dirs, tmp_path, kind, objective):
    out, summary = tmp_path / "adapter", tmp_path / "summary.json"
    decay = [] if kind == "draft" else ["--position-decay", "0.6"]
    assert main(_train(dirs, out, kind, "--loss", objective, "--json", str(summary), *decay)) == 0
    trained = json.loads(summary.read_text())
    assert len(trained["losses"]) == 3 and all(math.isfinite(loss) and loss >= 0 for loss in trained["losses"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["training"]["divergence"] == objective
    assert config["training"]["config"]["head_decay"] == (0.8 if kind == "draft" else 0.6)
    entry = config["acceptance"]["prompts"][0]  # the default recipe: greedy, then T=0.7
    assert entry["split"] == "held-out" and entry["prefix_survival"] == entry["acceptance_by_position"]
    assert len(entry["conditional_acceptance"]) == len(entry["prefix_survival"])


def test_an_unknown_loss_is_refused_by_name_with_the_choices(dirs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_train(dirs, tmp_path / "out", "medusa", "--loss", "kl"))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--loss" in error and "invalid choice: 'kl'" in error
    assert all(name in error for name in ("fkl", "tvd", "nla", "lk_hybrid"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind, decay, message", [
    ("medusa", "1.5", "--position-decay must be a number > 0 and <= 1; got 1.5"),
    ("eagle", "0", "--position-decay must be a number > 0 and <= 1; got 0.0"),
    ("draft", "0.5", "--position-decay weighs drafting depths"),
])
def test_a_bad_position_decay_is_refused_before_the_model_loads(dirs, tmp_path, capsys, monkeypatch, kind, decay,
                                                               message):
    import training.commands.train as train_command

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train_command, "load_model", no_model)
    assert main(_train(dirs, tmp_path / "out", kind, "--position-decay", decay)) == 2
    assert message in capsys.readouterr().err
