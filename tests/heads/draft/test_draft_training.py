"""Distilling a draft model (DistillSpec): the draft's loss falls and its acceptance against the
target rises; on-policy data is drawn from the draft itself; full fine-tunes and peft LoRAs are
saved, reloaded by ``heads.load_heads`` and by plain ``PeftModel.from_pretrained``, and refused on
another target or with swapped files."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import heads
from heads.adapter import AdapterError
from tests.conftest import progression_batch, train_toy_target
from tests.stats import FALSE_ALARM, chi_square_pvalue
from training.config import TrainConfig
from training.on_policy import sample_model_data
from training.trainer import make_trainer


@pytest.fixture(scope="module")
def target():
    return train_toy_target(steps=120)


def small_draft(target, seed: int = 5, layers: int = 1):
    """A fresh model of the target's family and vocabulary with ``layers`` layers and other weights."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    draft.set_attn_implementation("sdpa")
    return draft.eval()


def prompts_and_sequences(target, count: int = 16, seed: int = 3, new: int = 16):
    generator = torch.Generator().manual_seed(seed)
    prompts = list(progression_batch(count, 5, generator))
    with torch.no_grad():
        sequences = [target.generate(p[None], max_new_tokens=new, do_sample=False)[0] for p in prompts]
    return prompts, sequences


def tau(spec, prompts) -> float:
    committed = forwards = 0
    for prompt in prompts:
        spec.generate(prompt[None], max_new_tokens=24)
        committed, forwards = committed + spec.last_stats.new_tokens, forwards + spec.last_stats.target_forwards
    return committed / forwards


def test_distillation_loss_falls_and_acceptance_rises(target):
    prompts, sequences = prompts_and_sequences(target, count=24)
    # a fixed chain of 4: tau then measures the draft's acceptance alone (the default adapts to timings)
    spec = heads.attach_heads(target, kind="draft", draft_model=small_draft(target), depth=4, total_tokens=4,
                              adaptive=False)
    before = tau(spec, prompts[:6])
    config = TrainConfig(steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=4)
    result = make_trainer(spec, sequences, config, progress=False).train()
    assert result.losses[-1] < 0.8 * result.losses[0]
    assert result.agreement[-1][0] > result.agreement[0][0]
    assert len(result.accuracy) == 1 and len(result.accuracy[0]) == 10  # the draft's next-token ranks
    after = tau(spec, prompts[:6])
    assert after > before + 0.3, (before, after)
    assert not any(p.requires_grad for p in target.parameters())  # the target stays frozen


def test_on_policy_pool_is_drawn_from_the_draft(target):
    prompts, sequences = prompts_and_sequences(target, count=8)
    draft = small_draft(target, seed=7)
    spec = heads.attach_heads(target, kind="draft", draft_model=draft)
    config = TrainConfig(steps=1, batch_size=4, on_policy_ratio=1.0, on_policy_temperature=0.0, on_policy_prompts=4,
                         on_policy_max_new_tokens=10)
    trainer = make_trainer(spec, sequences, config, progress=False, prompts=prompts)
    trainer.hook.prepare()
    expected_tau = trainer.refresh_pool(0)
    assert len(trainer.pool) == 4 and 1.0 <= expected_tau <= spec.config.depth + 1
    with torch.no_grad():
        for prompt, pooled in zip(prompts, trainer.pool):
            own = draft.generate(prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0)[0]
            theirs = target.generate(prompt[None], max_new_tokens=10, do_sample=False, pad_token_id=0)[0]
            assert torch.equal(pooled, own) and not torch.equal(pooled, theirs)
    # sampled at T: the first token follows the draft's q at T, not the target's p
    prompt, temperature = prompts[0], 1.5
    data = sample_model_data(draft, [prompt] * 600, max_new_tokens=1, temperature=temperature, seed=11)
    draws = [int(sequence[-1]) for sequence in data.sequences]
    with torch.no_grad():
        q = torch.softmax(draft(prompt[None]).logits[0, -1] / temperature, -1)
        p = torch.softmax(target(prompt[None]).logits[0, -1] / temperature, -1)
    assert chi_square_pvalue(draws, dict(enumerate(q.tolist()))) > FALSE_ALARM
    assert chi_square_pvalue(draws, dict(enumerate(p.tolist()))) < FALSE_ALARM


def _train(spec, target, steps: int = 6, **config):
    _, sequences = prompts_and_sequences(target, count=12)
    config = TrainConfig(steps=steps, batch_size=4, learning_rate=5e-3, warmup_steps=1, **config)
    return make_trainer(spec, sequences, config, progress=False).train()


def _same_drafts(first, second, prompt) -> None:
    """Equal outputs and accepted lengths step by step (the drafts are the same), on fixed chains
    (the default's lengths follow timings)."""
    for spec in (first, second):
        spec.config.adaptive = False
        spec.set_tree(None)
    out = first.generate(prompt, max_new_tokens=24)
    accepted = first.last_stats.accepted_lengths
    assert torch.equal(second.generate(prompt, max_new_tokens=24), out)
    assert second.last_stats.accepted_lengths == accepted


def test_lora_round_trip_through_peft(target, tmp_path):
    from peft import PeftModel

    small_draft(target).save_pretrained(tmp_path / "base")
    spec = heads.attach_heads(target, kind="draft", draft_model=str(tmp_path / "base"))
    _train(spec, target, draft_lora=True, lora_r=4, lora_alpha=8, lora_targets=("q_proj", "v_proj"))
    trainable = [name for name, p in spec.heads.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    spec.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out/adapter_config.json").read_text())
    assert config["kind"] == "draft" and config["drafter"]["model"]["weights"] == "lora"
    assert config["drafter"]["model"]["base"] == str((tmp_path / "base").resolve())
    assert sorted(p.name for p in (tmp_path / "out/draft_lora").iterdir()) == ["adapter_config.json",
                                                                               "adapter_model.safetensors"]
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(9))
    with torch.no_grad():
        trained = spec.heads.model(prompt).logits
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                          str(tmp_path / "out"), subfolder="draft_lora").eval()
        torch.testing.assert_close(plain(prompt).logits, trained)
    loaded = heads.load_heads(target, tmp_path / "out")  # the recorded base, the LoRA merged in
    _same_drafts(spec, loaded, prompt)
    # a base draft other than the one the LoRA was trained on is refused
    small_draft(target, seed=6).save_pretrained(tmp_path / "base")
    with pytest.raises(AdapterError, match="not the one the LoRA was trained on"):
        heads.load_heads(target, tmp_path / "out")
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(AdapterError, match="base model"):
        heads.load_heads(target, tmp_path / "out")


def test_full_fine_tune_round_trip_and_pins(target, tmp_path):
    spec = heads.attach_heads(target, kind="draft", draft_model=small_draft(target), depth=3, top_k=2,
                              total_tokens=5)
    _train(spec, target)
    spec.save_pretrained(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json", "draft_model"]
    folder = AutoModelForCausalLM.from_pretrained(tmp_path / "out/draft_model").eval()  # a plain model folder
    prompt = progression_batch(1, 6, torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(folder(prompt).logits, spec.heads.model(prompt).logits)
    loaded = heads.load_heads(target, tmp_path / "out")
    assert loaded.config.to_dict() == spec.config.to_dict()  # the tree shape comes back
    _same_drafts(spec, loaded, prompt)
    other = train_toy_target(steps=5, seed=1)
    with pytest.raises(heads.TargetMismatchError, match="another target"):
        heads.load_heads(other, tmp_path / "out")
    with pytest.warns(UserWarning, match="another target"):
        heads.load_heads(other, tmp_path / "out", strict=False)
    # another model put in the folder is refused by its fingerprint
    small_draft(target, seed=8).save_pretrained(tmp_path / "out/draft_model")
    with pytest.raises(AdapterError, match="not the draft model this adapter was saved with"):
        heads.load_heads(target, tmp_path / "out")


def test_an_untrained_draft_saves_and_a_draft_trains_from_its_directory(target, tmp_path):
    small_draft(target).save_pretrained(tmp_path / "base")
    spec = heads.attach_heads(target, kind="draft", draft_model=str(tmp_path / "base"))
    assert spec.heads.source == str((tmp_path / "base").resolve())
    spec.save_pretrained(tmp_path / "out")
    block = json.loads((tmp_path / "out/adapter_config.json").read_text())["drafter"]["model"]
    assert block["weights"] == "full" and block["sha256"] == block["base_sha256"]
    _same_drafts(spec, heads.load_heads(target, tmp_path / "out"), progression_batch(1, 6,
                                                                                     torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="no such directory"):
        heads.attach_heads(target, kind="draft", draft_model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="hard_label_weight"):
        _train(spec, target, hard_label_weight=0.5)
