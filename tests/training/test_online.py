"""Online self-distillation while serving (training/online.py): outputs stay exactly the backbone's while
the drafter learns between calls, the backbone never changes, the guard rolls a harmful update back
(weights and optimizer state), learning raises acceptance, and memory stays bounded."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch

import heads
from tests.conftest import build_model, greedy_reference, left_pad, progression_batch, random_prompt, train_toy_target
from heads.draft_vocab import vocabulary_swaps
from training.online import OnlineConfig, expected_acceptance, learn
from training.replay import ReplayBuffer
from training.trainer import TrainConfig, make_trainer


def _backbone_state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _heads_state(spec) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in spec.heads.state_dict().items()}


def _same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


@pytest.fixture(scope="module")
def trained(toy_target):
    """Medusa heads briefly distilled on the toy target's progressions (a guard proxy well above 0)."""
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8)
    generator = torch.Generator().manual_seed(3)
    sequences = [progression_batch(1, 24, generator)[0] for _ in range(48)]
    make_trainer(spec, sequences, TrainConfig(steps=30, batch_size=8, learning_rate=1e-2, warmup_steps=3),
                 progress=False).train()
    return spec


def _serve(spec, model, calls: int, seed: int = 0, rows: int = 2, new: int = 12) -> None:
    """``calls`` greedy batches of ``rows`` left-padded prompts, each checked against ``model.generate``."""
    for call in range(calls):
        prompts = [random_prompt(3 + (call + row) % 4, seed * 1000 + call * 10 + row)[0] for row in range(rows)]
        ids, mask = left_pad(prompts)
        output = spec.generate(ids, attention_mask=mask, max_new_tokens=new)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        assert torch.equal(output, expected), f"call {call}: output differs from generate while learning"


@pytest.mark.parametrize("architecture, kind, options", [
    ("llama", "medusa", {"num_heads": 2, "tree": 8}),
    ("gpt2", "medusa", {"num_heads": 2, "tree": 8, "lookup": True}),  # a hybrid: its Medusa part learns
    ("llama", "eagle", {"total_tokens": 8, "depth": 3, "top_k": 2}),
    ("qwen2", "eagle", {"parallel": 3, "parallel_mode": "block", "depth": 3, "top_k": 2}),  # the block drafter
])
def test_greedy_output_is_the_backbones_while_learning(architecture, kind, options):
    model = build_model(architecture)
    before = _backbone_state(model)
    spec = heads.attach_heads(model, kind=kind, **options)
    drafter_before = _heads_state(spec)
    learner = learn(spec, budget=2.0, batch_size=2, held_out=2, hold_every=3, steps_per_update=2)
    _serve(spec, model, calls=6)
    summary = learner.summary()
    assert summary["updates_kept"] + summary["updates_rolled_back"] > 0, summary
    assert summary["sequences_seen"] == 12
    assert _same(before, _backbone_state(model)), "the backbone changed"
    assert summary["updates_kept"] == 0 or not _same(drafter_before, _heads_state(spec))


def test_seeded_samples_do_not_depend_on_what_was_learned(toy_target):
    """A seeded call's output is a function of prompt, settings and seed whatever drafts: learning
    between calls (every update kept) leaves every sample what an untouched drafter gives."""
    learning, fixed = (heads.attach_heads(toy_target, num_heads=2, tree=8) for _ in range(2))
    learner = learn(learning, budget=2.0, batch_size=2, held_out=2, hold_every=2, steps_per_update=1,
                    tolerance=1e9)
    generator = torch.Generator().manual_seed(4)
    for seed in range(8):
        prompt = progression_batch(2, 5, generator)
        settings = dict(max_new_tokens=12, do_sample=True, temperature=0.8, seed=seed)
        assert torch.equal(learning.generate(prompt, **settings), fixed.generate(prompt, **settings))
    assert learner.kept > 0


def test_the_guard_rolls_a_harmful_update_back(trained, toy_target):
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8)
    spec.heads.load_state_dict(trained.heads.state_dict())
    learner = learn(spec, learning_rate=5.0, batch_size=4, held_out=4, hold_every=2, steps_per_update=2)
    learner.pause()
    _serve(spec, toy_target, calls=6, rows=2, new=16)
    state = _heads_state(spec)
    assert learner.step(updates=1) == 1
    assert learner.rolled_back == 1 and learner.kept == 0, learner.summary()
    before, after = learner.last_proxy
    assert after < before
    assert _same(state, _heads_state(spec)), "a rolled-back update left the drafter changed"
    assert not learner.optimizer.state, "a rolled-back first update left optimizer state behind"
    assert learner.rate == 2.5 and learner.summary()["learning_rate"] == 2.5  # halved after a rollback
    learner.rate = 1.7
    learner.step(updates=1)
    assert learner.rolled_back == 2 and learner.rate == pytest.approx(5.0 / 3)  # not below a third of the start


@pytest.mark.parametrize("value", [0.0, -1e-4, 1e-2, True, "1e-4"])
def test_min_learning_rate_is_none_or_a_rate_up_to_learning_rate(value):
    with pytest.raises(ValueError, match=r"min_learning_rate must be None \(a third of learning_rate\) or a number in"):
        OnlineConfig(learning_rate=1e-3, min_learning_rate=value)


def test_the_rate_and_the_swaps_follow_the_guard(toy_target, monkeypatch):
    """A rolled-back update halves the rate (down to min_learning_rate) and, when it swapped tokens, the next
    update's swaps; a kept one raises the rate by a quarter (up to learning_rate) and restores the swaps."""
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8, draft_vocab_size=24)
    learner = learn(spec, batch_size=2, held_out=2, hold_every=2, learning_rate=1e-3, min_learning_rate=3e-4,
                    vocabulary_swaps=8)
    learner.pause()
    _serve(spec, toy_target, calls=4, new=16)
    proxies = iter([])
    monkeypatch.setattr(learner, "_measure", lambda: (next(proxies), []))
    rates, limits = [], []
    for before, after in [(1.0, 0.5), (1.0, 0.5), (1.0, 0.5), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 5.0)]:
        proxies = iter([before, after])
        learner._baseline = None
        learner.step(updates=1)
        rates.append(learner.rate)
        limits.append(learner.swap_limit)
    assert rates == pytest.approx([5e-4, 3e-4, 3e-4, 3.75e-4, 4.6875e-4, 5.859375e-4, 7.32421875e-4])
    assert limits[:3] == [4, 2, 1] and limits[3:] == [8] * 4, limits  # halved while swaps were rolled back
    assert learner.rolled_back == 3 and learner.kept == 4


def test_a_kept_update_keeps_weights_and_optimizer_state(trained, toy_target):
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8)
    spec.heads.load_state_dict(trained.heads.state_dict())
    learner = learn(spec, batch_size=4, held_out=4, hold_every=2, steps_per_update=1, tolerance=1e9)
    learner.pause()
    _serve(spec, toy_target, calls=4, rows=2, new=16)
    state = _heads_state(spec)
    assert learner.step(updates=1) == 1 and learner.kept == 1
    assert not _same(state, _heads_state(spec))
    assert all(int(learner.optimizer.state[p]["step"]) == 1 for p in learner.parameters)


def test_learning_raises_acceptance_on_the_served_domain(toy_target):
    """Fresh heads (copies of the output head) learn the toy target's progressions from served traffic."""
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8)
    generator = torch.Generator().manual_seed(0)
    prompts = [progression_batch(1, 5, generator) for _ in range(24)]

    def tau(batch) -> float:
        tokens = forwards = 0
        for prompt in batch:
            spec.generate(prompt, max_new_tokens=16)
            tokens, forwards = tokens + spec.last_stats.new_tokens, forwards + spec.last_stats.row_forwards
        return tokens / forwards

    start = tau(prompts[16:])
    learner = learn(spec, learning_rate=1e-2, batch_size=4, held_out=4, hold_every=4)
    learner.pause()
    for prompt in prompts[:16]:
        spec.generate(prompt, max_new_tokens=16)
    learner.step(updates=8)
    learn(spec, False)
    assert spec.learning is None
    assert learner.kept > 0
    assert tau(prompts[16:]) > start + 0.2, (start, learner.summary())


def test_budget_bounds_learning_time_and_pause_stops_it(toy_target):
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8)
    learner = learn(spec, budget=0.05, batch_size=2, held_out=2, hold_every=2, steps_per_update=1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(30):
        spec.generate(progression_batch(1, 5, generator), max_new_tokens=12)
    summary = learner.summary()
    assert summary["updates_kept"] + summary["updates_rolled_back"] > 0
    # credit is earned before it is spent: what was spent exceeds what was earned by at most the last update
    assert summary["learning_seconds"] <= 0.05 * summary["served_seconds"] - summary["credit_seconds"] + 1e-9
    assert summary["credit_seconds"] > -0.5
    learner.pause()
    made = learner.kept + learner.rolled_back
    for _ in range(5):
        spec.generate(progression_batch(1, 5, generator), max_new_tokens=12)
    assert learner.kept + learner.rolled_back == made and learner.buffer.seen == 35
    learner.resume()
    assert learner.step(updates=1) == 1


def test_refusals():
    model = build_model("llama")
    with pytest.raises(ValueError, match="nothing to train online"):
        learn(heads.attach_heads(model, kind="lookup"))
    spec = heads.attach_heads(model)
    with pytest.raises(ValueError, match="budget"):
        learn(spec, budget=-1)
    with pytest.raises(ValueError, match="held_out"):
        learn(spec, held_out=0)
    with pytest.raises(ValueError, match="backbone_cache_mb"):
        learn(spec, backbone_cache_mb=-1)
    assert learn(spec, backbone_cache_mb=0).memo is None  # no memo: every draw runs the backbone
    with pytest.raises(ValueError, match="apply to nothing"):
        learn(spec, False, budget=0.1)
    with pytest.raises(TypeError):
        learn(spec, steps=3)
    with pytest.raises(ValueError, match="seconds= or updates="):
        learn(spec).step()


def test_expected_acceptance_of_a_chain_and_a_tree():
    assert expected_acceptance([[0.5], [0.5]], size=2) == pytest.approx(0.75)  # 0.5 + 0.5 * 0.5
    assert expected_acceptance([[0.6, 0.3]], size=2) == pytest.approx(0.9)
    assert expected_acceptance([]) == 0.0


def test_vocabulary_swaps_bring_frequent_tokens_in_for_rare_ones():
    counts = torch.tensor([0, 5, 1, 9, 0, 7, 2, 1])
    positions, token_ids = vocabulary_swaps(torch.tensor([0, 1, 2, 4]), counts, limit=3)
    # outside the map by frequency: 3 (9), 5 (7), 6 (2); inside by rarity: 0 (0), 4 (0), 2 (1)
    assert positions.tolist() == [0, 3, 2] and token_ids.tolist() == [3, 5, 6]
    assert vocabulary_swaps(torch.tensor([3, 5]), counts, limit=4)[0].numel() == 0  # the map holds the top


@pytest.mark.parametrize("kind, options", [("medusa", {"num_heads": 2, "tree": 8, "draft_vocab_size": 24}),
                                           ("eagle", {"total_tokens": 8, "depth": 3, "draft_vocab_size": 24})])
def test_a_draft_vocabulary_follows_traffic_and_rolls_back_with_the_weights(toy_target, kind, options):
    spec = heads.attach_heads(toy_target, kind=kind, **options)  # token_map 0..23: mostly unused ids
    learner = learn(spec, batch_size=2, held_out=2, hold_every=2, tolerance=1e9, vocabulary_swaps=8)
    learner.pause()
    _serve(spec, toy_target, calls=4, new=16)
    snapshot = learner._snapshot()
    assert learner._swap_vocabulary() == 8
    token_map = spec.heads.token_map
    assert token_map.unique().numel() == 24 and not torch.equal(token_map, torch.arange(24))
    if kind == "medusa":  # a swapped-in token's row restarts from the output head's
        position = int((token_map >= 24).nonzero()[0])
        assert torch.equal(spec.heads.projections[0].weight[position],
                           toy_target.get_output_embeddings().weight[token_map[position]])
    learner._restore(snapshot)
    assert _same(snapshot[0], _heads_state(spec)) and torch.equal(spec.heads.token_map, torch.arange(24))
    assert learner.step(updates=1) == 1 and learner.swapped == 8  # kept (tolerance): swapped and trained
    _serve(spec, toy_target, calls=2, seed=1, new=16)  # still the backbone's output


def test_buffer_is_bounded_in_tokens_and_holds_sequences_back():
    buffer = ReplayBuffer(max_tokens=20, max_length=6, held_out=2, hold_every=3)
    for index in range(30):
        buffer.add(torch.arange(index % 9 + 1))
        assert buffer.tokens <= 20 and buffer.tokens == sum(s.numel() for _, s in buffer.train)
        assert len(buffer.held) <= 2
    assert all(sequence.numel() <= 6 for _, sequence in buffer.train)
    assert not {key for key, _ in buffer.held} & {key for key, _ in buffer.train}  # held back: never trained on
    assert buffer.seen == 30 - 4  # one-token sequences are skipped


def _resident_bytes() -> int:
    """The process's resident memory now (Linux ``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc")
def test_memory_stays_bounded_over_2000_requests():
    model = build_model("llama", eos=5)
    spec = heads.attach_heads(model, num_heads=2, tree=4)
    learner = learn(spec, budget=0.05, buffer_tokens=256, max_length=16, batch_size=2, held_out=2,
                    steps_per_update=1)
    generator = torch.Generator().manual_seed(0)
    peak_tokens, resident = 0, []
    for call in range(250):  # 2,000 requests, 8 per call
        spec.generate(torch.randint(3, 96, (8, 4), generator=generator), max_new_tokens=3)
        peak_tokens = max(peak_tokens, learner.buffer.tokens)
        if call in (49, 249):
            gc.collect()
            resident.append(_resident_bytes())
    assert learner.buffer.seen == 2000 and peak_tokens <= 256
    assert len(learner.buffer.held) <= 2 and len(learner._served) <= 50
    assert learner.kept + learner.rolled_back > 0
    live = {key for key, _ in learner.buffer.train} | {key for key, _ in learner.buffer.held}
    assert learner.memo.misses > 0 and set(learner.memo.rows) <= live  # it held buffered sequences only
    assert resident[1] - resident[0] < 32 * 2**20, f"memory grew by {(resident[1] - resident[0]) / 2**20:.0f} MiB"


def test_config_defaults_are_documented():
    config = OnlineConfig()
    assert config.budget == 0.05 and config.held_out >= 1


def test_a_refined_adapter_records_its_refinement_loads_back_and_checks(toy_target, tmp_path):
    from heads.fingerprint import state_fingerprint
    from tests.training.test_cli import _tokenizer, _write_prompts
    from training.cli import main

    toy_target.save_pretrained(tmp_path / "model")
    _tokenizer().save_pretrained(tmp_path / "model")
    heads.attach_heads(toy_target, num_heads=2, tree=8).save_pretrained(tmp_path / "start")
    spec = heads.load_heads(toy_target, tmp_path / "start")
    start = state_fingerprint({name: tensor.cpu() for name, tensor in spec.heads.state_dict().items()})
    learner = learn(spec, learning_rate=1e-2, batch_size=4, held_out=4, hold_every=4)
    assert spec.save_pretrained(tmp_path / "unchanged") is None and "online" not in \
        json.loads((tmp_path / "unchanged" / "adapter_config.json").read_text())["training"]  # nothing kept yet
    learner.pause()
    generator = torch.Generator().manual_seed(2)
    for _ in range(16):
        spec.generate(progression_batch(1, 5, generator), max_new_tokens=16)
    learner.step(updates=6)
    assert learner.kept > 0
    learner.resume()
    for _ in range(8):  # the served window the adapter records, after learning
        spec.generate(progression_batch(1, 5, generator), max_new_tokens=16)
    spec.save_pretrained(tmp_path / "refined")

    config = json.loads((tmp_path / "refined" / "adapter_config.json").read_text())
    entry = config["training"]["online"][-1]
    assert entry["refined_online"] and entry["from"] == {"adapter": str(tmp_path / "start"), "sha256": start}
    assert entry["updates_kept"] == learner.kept and entry["steps"] == learner.steps
    assert entry["tokens_seen"] == learner.buffer.seen_tokens and entry["trained_tokens"] > 0
    assert set(config["acceptance"]) == {"served"} and config["acceptance"]["served"]["split"] == "served"
    assert config["target"]["weights_sha256"] == heads.TargetPin.of(toy_target).recorded["weights_sha256"]

    loaded = heads.load_heads(toy_target, tmp_path / "refined")
    assert _same(_heads_state(loaded), _heads_state(spec)) and loaded.accuracy == spec.accuracy
    prompt = progression_batch(1, 5, generator)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=16), greedy_reference(toy_target, prompt, 16))
    learn(loaded, learning_rate=1e-2, tolerance=1e9).pause()  # refined again: its entry follows the first
    for _ in range(4):
        loaded.generate(progression_batch(1, 5, generator), max_new_tokens=16)
    assert loaded.learning.step(updates=1) == 1
    loaded.save_pretrained(tmp_path / "twice")
    online = json.loads((tmp_path / "twice" / "adapter_config.json").read_text())["training"]["online"]
    assert [item["from"]["adapter"] for item in online] == [str(tmp_path / "start"), str(tmp_path / "refined")]

    data = _write_prompts(tmp_path / "prompts.jsonl", 6, seed=3)
    code = main(["check", "--model", str(tmp_path / "model"), "--adapter", str(tmp_path / "refined"),
                 "--data", str(data), "--prompts", "6", "--threshold", "0.5", "--json", str(tmp_path / "check.json")])
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["mix"] == "served" and report["measured"]["identical"] and report["target_matches"]
    assert code == 0, report


def test_spec_learn_load_heads_and_attach_heads_take_a_learners_settings(toy_target, tmp_path):
    """``spec.learn(settings)``, ``load_heads(..., learn=settings)`` and ``attach_heads(..., learn=settings)``
    attach the learner ``settings.attach(spec)`` builds; None / False stops it, keeping what it learned in the
    spec's metadata; anything else is a TypeError before any work."""
    spec = heads.attach_heads(toy_target, num_heads=2, tree=8, learn=OnlineConfig(budget=2.0, batch_size=2,
                                                                                   held_out=2, hold_every=2,
                                                                                   tolerance=1e9))
    learner = spec.learning
    assert learner is not None and learner.config.budget == 2.0
    _serve(spec, toy_target, calls=4)
    assert learner.kept > 0
    assert spec.learn(False) is None and spec.learning is None
    assert spec.metadata["training"]["online"][-1]["updates_kept"] == learner.kept  # kept in the recipe
    spec.save_pretrained(str(tmp_path / "adapter"))
    loaded = heads.load_heads(toy_target, tmp_path / "adapter", learn=OnlineConfig(budget=0.5))
    assert loaded.learning is not None and loaded.learning.config.budget == 0.5
    again = loaded.learn(OnlineConfig(budget=0.1))
    assert loaded.learning is again and again.config.budget == 0.1
    for bad in (True, "yes", {"budget": 0.1}):
        with pytest.raises(TypeError, match="OnlineConfig"):
            loaded.learn(bad)
        with pytest.raises(TypeError, match="OnlineConfig"):
            heads.load_heads(toy_target, tmp_path / "adapter", learn=bad)
        with pytest.raises(TypeError, match="OnlineConfig"):
            heads.attach_heads(toy_target, num_heads=2, learn=bad)
    assert loaded.learning is again  # a refused call changed nothing
