"""``drafting="auto"``: an EAGLE drafter trained for parallel drafting drafts each step sequentially
or in parallel. Greedy parity under every sequence of modes (the two drafters share one cache), the
choice's bursts and measurements, sampled calls never switching, the training-time choice, the
config and the command line's defaults."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import heads
from heads.eagle import DraftingChoice, EagleConfig, EagleDrafter, ParallelEagleDrafter, SwitchingEagleDrafter
from heads.eagle import cli as eagle_cli
from heads.eagle import switch
from tests.conftest import build_model, greedy_reference, left_pad, progression_batch, random_prompt
from training.trainer import TrainConfig, make_trainer


class ScriptedChoice(DraftingChoice):
    """Modes from a repeating script instead of measurements (records what it was asked to measure)."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script, self.index, self.measured = script, 0, []

    def choose(self):
        mode = {"s": "sequential", "p": "parallel"}[self.script[self.index % len(self.script)]]
        self.index += 1
        self.steps[mode] += 1
        return mode, False

    def observe(self, mode, tokens, seconds, rows=1):
        self.measured.append((mode, tokens))
        super().observe(mode, tokens, seconds, rows)


def _scripted(spec, script: str) -> ScriptedChoice:
    choice = ScriptedChoice(script)
    spec.drafter.choice = choice
    return choice


@pytest.mark.parametrize("name, options", [
    ("llama", {}), ("mistral", dict(top_k=2, total_tokens=5, depth=3)), ("gpt2", {}), ("gemma2", {}),
    ("qwen2", dict(draft_vocab_size=40)),
])
@pytest.mark.parametrize("script", ["sp", "ssp", "pps"])
def test_greedy_parity_under_any_sequence_of_modes(name, options, script):
    model = build_model(name, seed=3)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto", **options)
    assert isinstance(spec.drafter, SwitchingEagleDrafter)
    choice = _scripted(spec, script)
    for seed, length in enumerate((1, 15)):  # longer than the tiny sliding windows once generated
        prompt = random_prompt(length, seed)
        assert torch.equal(spec.generate(prompt, max_new_tokens=24), greedy_reference(model, prompt, 24))
    assert choice.steps["sequential"] and choice.steps["parallel"]
    prompts = [random_prompt(length, length)[0] for length in (3, 11, 6)]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20), expected)


def test_measurements_skip_first_steps_and_count_committed_tokens():
    model = build_model("llama", seed=1)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto")
    choice = _scripted(spec, "sp")
    prompt = random_prompt(6, 0)
    output = spec.generate(prompt, max_new_tokens=16, min_new_tokens=16)
    # every step but the first (it also committed the prompt) is measured at the next step; the last step's
    # outcome is never seen by the drafter
    steps = spec.last_stats.target_forwards - 1
    assert len(choice.measured) == steps - 2
    modes = [mode for mode, _ in choice.measured]
    assert modes == [("sequential", "parallel")[(index + 1) % 2] for index in range(len(modes))]
    assert sum(tokens for _, tokens in choice.measured) <= output.shape[1] - prompt.shape[1]


class PinnedCalls(switch.CallModeChoice):
    """Every sampled call in one mode (records the calls it was told about)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.seen = mode, []

    def choose(self) -> str:
        return self.mode

    def observe(self, mode, tokens, seconds):
        self.seen.append((mode, tokens))
        super().observe(mode, tokens, seconds)


def test_sampled_calls_keep_one_mode_and_greedy_calls_choose(monkeypatch):
    model = build_model("llama", seed=1)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto")
    prompt = random_prompt(5, 1)
    sample = lambda seed: spec.generate(prompt, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=0,
                                        generator=torch.Generator().manual_seed(seed))
    modes = []
    original = switch.SwitchingEagleDrafter.propose
    monkeypatch.setattr(switch.SwitchingEagleDrafter, "propose",
                        lambda self, batch: modes.append(self._mode(batch)) or original(self, batch))
    monkeypatch.setattr(switch.SwitchingEagleDrafter, "_mode", lambda self, batch, inner=switch.SwitchingEagleDrafter._mode:
                        self._pinned if getattr(self, "_pinned", None) else inner(self, batch))
    sample(0)
    assert sum(spec.drafter.choice.steps.values()) == 0  # the greedy choice is not consulted
    monkeypatch.undo()
    for mode in switch.MODES:  # given its mode, a seeded call reproduces
        pinned = PinnedCalls(mode)
        key = next(key for key in spec.heads.drafting_choices if "sampled" in key)
        spec.heads.drafting_choices[key] = pinned
        first, again = sample(3), sample(3)
        assert torch.equal(first, again)
        sample(4)
        assert [seen[0] for seen in pinned.seen] == [mode] * 2 and all(seen[1] > 0 for seen in pinned.seen)
    spec.generate(prompt, max_new_tokens=12)
    assert sum(spec.drafter.choice.steps.values()) > 0


def test_call_mode_choice_tries_both_then_keeps_the_faster_and_retries_the_other():
    choice = switch.CallModeChoice()
    rates = {"sequential": 100.0, "parallel": 150.0}
    picked = []
    for _ in range(24):
        mode = choice.choose()
        picked.append(mode)
        choice.observe(mode, rates[mode], 1.0)
    assert picked[:2] == ["sequential", "parallel"]
    assert picked[2:].count("parallel") == 19 and picked[2:].count("sequential") == 3  # retried every 8 calls
    rates["sequential"] = 300.0  # the traffic changed: the retry notices
    for _ in range(16):
        mode = choice.choose()
        picked.append(mode)
        choice.observe(mode, rates[mode], 1.0)
    assert picked[-8:].count("sequential") == 7  # the faster one now, the other retried once in 8 calls


def _feed(choice: DraftingChoice, rates: dict[str, float], steps: int) -> list[str]:
    """Drive ``choice`` for ``steps`` steps where mode m commits 2 tokens in ``2 / rates[m]`` seconds."""
    modes = []
    for _ in range(steps):
        mode, skip = choice.choose()
        modes.append(mode)
        if not skip:
            choice.observe(mode, 2.0, 2.0 / rates[mode])
    return modes


@pytest.mark.parametrize("faster", ["sequential", "parallel"])
def test_choice_explores_in_windows_then_keeps_the_faster(faster):
    choice = DraftingChoice()
    slower = "parallel" if faster == "sequential" else "sequential"
    modes = _feed(choice, {faster: 130.0, slower: 100.0}, 2000)
    warm, window = switch.WARMUP, switch.FIRST_EXPLORE
    assert modes[:warm] == ["sequential"] * warm
    explored = modes[warm:warm + window]  # the modes alternate in blocks, on the same stretch of text
    assert explored[:2 * switch.BLOCK] == ["sequential"] * switch.BLOCK + ["parallel"] * switch.BLOCK
    assert explored.count(faster) == explored.count(slower)
    assert choice.faster() == faster and choice.windows >= 2
    later = modes[warm + window:]
    assert later[:switch.EXPLOIT] == [faster] * switch.EXPLOIT
    share = later.count(slower) / len(later)
    assert 0 < share < 0.05, share  # windows keep measuring the slower mode, a small share of the steps
    # a narrow gap measures again sooner than a wide one
    narrow = DraftingChoice()
    narrow_later = _feed(narrow, {faster: 104.0, slower: 100.0}, 2000)[warm + window:]
    assert narrow_later.count(slower) > later.count(slower)
    # the machine changes: the other mode becomes faster, and the next window follows
    modes = _feed(choice, {faster: 60.0, slower: 100.0}, 1500)
    assert choice.faster() == slower and modes[-100:].count(slower) > 80


def test_a_stretch_whose_rate_drifts_is_measured_again():
    """The first window sees a hard stretch of text where the modes tie (or a passing load favours
    the parallel mode); on the easier text that follows the chain is twice as fast. The stretch's rate
    drifts from its window's, so after CHECK measured steps a new window measures both on the new text
    and the faster mode takes over, long before the stretch would have ended."""
    for first in ({"sequential": 100.0, "parallel": 101.0}, {"sequential": 100.0, "parallel": 150.0}):
        choice = DraftingChoice()
        while not choice.windows:  # the window closes (after EARLY steps on a wide gap) and the stretch starts
            _feed(choice, first, 1)
        easy = {"sequential": 400.0, "parallel": 200.0}
        modes = _feed(choice, easy, switch.CHECK + switch.EXPLORE + 20)  # the stretch's first step ran above
        assert modes[:switch.CHECK - 1] == ["parallel"] * (switch.CHECK - 1) and modes[switch.CHECK - 1] == "sequential"
        assert choice.rechecks == 1 and choice.faster() == "sequential"
        assert modes[-20:] == ["sequential"] * 20
    # a stretch that keeps its window's rate runs to its end
    steady = DraftingChoice()
    _feed(steady, {"sequential": 200.0, "parallel": 100.0}, 2000)
    assert steady.rechecks == 0


def _feed_steps(choice: DraftingChoice, per_step: dict, steps: int) -> list[str]:
    """Drive ``choice`` where a step of mode m commits ``per_step[m] = (tokens, seconds)``."""
    modes = []
    for _ in range(steps):
        mode, skip = choice.choose()
        modes.append(mode)
        if not skip:
            choice.observe(mode, *per_step[mode])
    return modes


def test_a_saturated_shallow_stretch_is_measured_again():
    """A window on hard text picks the 3-deep parallel tree (15% ahead); on easy text it commits nearly
    its most (4 tokens a step) at an unchanged rate, so the drift check cannot fire, while the chain
    commits twice as much. Saturation ends the stretch after SATURATION_STEPS steps and the chain takes
    over; a saturated sequential chain (the deeper mode) or a mode without a ceiling keeps its stretch."""
    choice = DraftingChoice({"parallel": 4.0})
    _feed_steps(choice, {"sequential": (2.4, 0.024), "parallel": (2.76, 0.024)}, switch.WARMUP + switch.FIRST_EXPLORE)
    easy = {"sequential": (8.0, 0.040), "parallel": (3.9, 0.037)}  # rates 200 and 105 tokens/s
    modes = _feed_steps(choice, easy, switch.SATURATION_STEPS + switch.EXPLORE + 20)
    assert modes[:switch.SATURATION_STEPS] == ["parallel"] * switch.SATURATION_STEPS
    assert choice.rechecks == 1 and choice.faster() == "sequential" and modes[-20:] == ["sequential"] * 20
    unbounded = DraftingChoice()
    _feed_steps(unbounded, {"sequential": (2.4, 0.024), "parallel": (2.45, 0.024)}, switch.WARMUP + switch.FIRST_EXPLORE)
    assert _feed_steps(unbounded, {"sequential": (8.0, 0.040), "parallel": (3.9, 0.037)}, 40) == ["parallel"] * 40


def test_choice_compares_modes_on_the_same_text():
    """Tokens per step swing with the text (here: every other block of 8 steps is easy); alternating
    blocks inside a window measure both modes on both kinds of text."""
    choice = DraftingChoice()
    for step in range(3000):
        mode, skip = choice.choose()
        easy = (step // 8) % 2 == 0
        tokens = (6.0 if easy else 1.5) * (1.2 if mode == "sequential" else 1.0)
        if not skip:
            choice.observe(mode, tokens, 0.01)
    assert choice.faster() == "sequential"
    assert choice.steps["sequential"] > 0.9 * sum(choice.steps.values())


def test_config_and_older_adapters(tmp_path):
    assert EagleConfig().drafting == "sequential"
    assert EagleConfig(parallel=3).drafting == "parallel"  # adapters written before the field
    with pytest.raises(ValueError, match="needs a drafter trained for parallel drafting"):
        EagleConfig(drafting="auto")
    with pytest.raises(ValueError, match="drafting must be one of"):
        EagleConfig(parallel=2, drafting="fastest")
    with pytest.raises(ValueError, match="parallel_tokens"):
        EagleConfig(parallel=2, drafting="auto", parallel_tokens=0)
    model = build_model("llama", seed=2)
    sequential = heads.attach_heads(model, kind="eagle", parallel=3, drafting="sequential")
    assert type(sequential.drafter) is EagleDrafter
    assert isinstance(heads.attach_heads(model, kind="eagle", parallel=3).drafter, ParallelEagleDrafter)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto", parallel_tokens=6)
    assert spec.drafter.parallel.template.size == 7 and spec.drafter.parallel.template.max_depth <= 3
    spec.save_pretrained(tmp_path / "auto")
    saved = json.loads((tmp_path / "auto" / "adapter_config.json").read_text())
    assert saved["drafter"]["drafting"] == "auto" and saved["drafter"]["parallel_tokens"] == 6
    assert isinstance(heads.load_heads(model, tmp_path / "auto").drafter, SwitchingEagleDrafter)


def test_training_an_auto_drafter_and_the_mask_query_weight(tmp_path):
    model = build_model("llama", seed=4)
    sequences = list(greedy_reference(model, progression_batch(24, 6, torch.Generator().manual_seed(7)), 12))
    losses = {}
    for mode in ("mask", "heads"):
        for weight in (0.0, 1.0):
            torch.manual_seed(0)
            spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto", parallel_mode=mode)
            trainer = make_trainer(spec, sequences, TrainConfig(steps=1, batch_size=4, mask_query_weight=weight),
                                   progress=False)
            losses[mode, weight] = trainer.train().losses[0]
    assert losses["mask", 1.0] > losses["mask", 0.0]  # the mask queries' losses count only with their weight
    assert losses["heads", 1.0] == losses["heads", 0.0]  # and the heads mode has none
    assert spec.config.drafting == "auto" and isinstance(spec.drafter, SwitchingEagleDrafter)
    spec.save_pretrained(tmp_path / "auto")
    loaded = heads.load_heads(model, tmp_path / "auto")
    assert isinstance(loaded.drafter, SwitchingEagleDrafter) and loaded.accuracy == spec.accuracy
    prompt = sequences[0][:5][None]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=10), greedy_reference(model, prompt, 10))
    with pytest.raises(ValueError, match="mask_query_weight"):
        TrainConfig(mask_query_weight=-1.0)


def _cli_args(**flags) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    eagle_cli.add_arguments(parser)
    args = parser.parse_args([item for name, value in flags.items() for item in (f"--{name.replace('_', '-')}", value)])
    args.kind = "eagle"
    return args


def test_command_line_defaults():
    options = eagle_cli.options(_cli_args())
    assert options["parallel"] == eagle_cli.PARALLEL and options["drafting"] == "auto"
    config = heads.eagle.make_config(**{k: v for k, v in options.items() if v is not None})
    assert config.parallel_mode == "heads" and config.head_input == "prediction"
    assert eagle_cli.options(_cli_args(head_input="feature"))["head_input"] == "feature"
    with pytest.raises(ValueError, match="head_input must be one of"):
        heads.eagle.EagleConfig(parallel=3, head_input="root")
    assert eagle_cli.options(_cli_args(parallel_mode="mask"))["parallel_mode"] == "mask"
    with pytest.raises(ValueError, match="parallel_mode must be one of"):
        heads.eagle.EagleConfig(parallel=3, parallel_mode="queries")
    assert eagle_cli.train_options(_cli_args())["mask_query_weight"] == 0.2
    assert eagle_cli.train_options(_cli_args(mask_query_weight="0.5"))["mask_query_weight"] == 0.5
    for flags in (dict(unroll_steps="2"), dict(eagle_layout="eagle1"), dict(drafting="sequential")):
        assert eagle_cli.options(_cli_args(**flags))["parallel"] is None, flags
    assert eagle_cli.options(_cli_args(parallel="1"))["drafting"] is None
    assert options["siblings"] is None and eagle_cli.options(_cli_args(siblings="0"))["siblings"] == 0
    assert heads.eagle.make_config(**{k: v for k, v in eagle_cli.options(_cli_args(siblings="0")).items()
                                      if v is not None}).siblings == 0
    assert heads.eagle.make_config().siblings == heads.eagle.config.DEFAULT_SIBLINGS == 1
    other = _cli_args()
    other.kind = "medusa"  # another kind's run: EAGLE's options stay unset
    assert eagle_cli.options(other)["parallel"] is None and eagle_cli.options(other)["drafting"] is None
    assert eagle_cli.target_options(other, 8192) == {}


def test_draft_vocabulary_default():
    """``--draft-vocab-size auto`` (the default) is resolved against the loaded target: a quarter of a
    vocabulary of 8192 tokens or more, all of a smaller one, all for the eagle1 export layout; a count
    or ``full`` is taken as given; anything else is refused by argparse."""
    assert eagle_cli.options(_cli_args())["draft_vocab_size"] is None  # unresolved until the target is known
    assert eagle_cli.target_options(_cli_args(), 8192) == {"draft_vocab_size": 2048}
    assert eagle_cli.target_options(_cli_args(), 128256) == {"draft_vocab_size": 32064}
    assert eagle_cli.target_options(_cli_args(), 512) == {}
    assert eagle_cli.target_options(_cli_args(eagle_layout="eagle1"), 32000) == {}
    assert eagle_cli.target_options(_cli_args(draft_vocab_size="full"), 32000) == {}
    given = _cli_args(draft_vocab_size="1000")
    assert eagle_cli.options(given)["draft_vocab_size"] == 1000 and eagle_cli.target_options(given, 32000) == {}
    for bad in ("0", "-3", "half"):
        with pytest.raises(SystemExit):
            _cli_args(draft_vocab_size=bad)


def test_speculate_auto_and_lookup_hybrid_stay_lossless():
    """The auto policy builds a switching drafter per tree size; the hybrid wraps one; both greedy-exact."""
    model = build_model("qwen2", seed=5)
    spec = heads.attach_heads(model, kind="eagle", parallel=3, drafting="auto", lookup=True)
    # ungated: every step runs the switching drafter (the gate learns within a few steps that an
    # untrained drafter adds nothing over lookup's drafts and skips it: tests/heads/lookup/test_gate.py)
    spec.set_lookup(gate=False)
    prompts = [random_prompt(length, 40 + length)[0] for length in (4, 9)]
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    for _ in range(3):  # the choice carries over between calls
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20, speculate="auto"), expected)
        assert torch.equal(spec.generate(ids, attention_mask=mask, max_new_tokens=20), expected)
    assert sum(choice.steps["parallel"] for choice in spec.heads.drafting_choices.values()) > 0


def test_checks_that_change_nothing_back_off(monkeypatch):
    """stories260K: the 3-deep parallel tree saturates on easy text and wins every window that the
    saturation check opens. Each such window doubles the steps before the next check (up to PATIENCE),
    so the slower chain is measured less and less often; a window that changes the mode resets it."""
    stories = {"sequential": (6.0, 0.015), "parallel": (3.9, 0.006)}  # 400 and 650 tokens/s

    def sequential_share(patience: int) -> tuple[float, DraftingChoice]:
        monkeypatch.setattr(switch, "PATIENCE", patience)
        choice = DraftingChoice({"parallel": 4.0})
        modes = _feed_steps(choice, stories, 3000)
        return modes.count("sequential") / len(modes), choice

    eager, _ = sequential_share(1)
    patient, choice = sequential_share(16)
    assert choice.patience == 16 and choice.faster() == "parallel"
    assert patient < eager / 2, (patient, eager)
    # the text turns easy enough for the chain to win: the next check's window switches and resets
    easy = {"sequential": (12.0, 0.012), "parallel": (3.9, 0.006)}  # 1000 against 650 tokens/s
    modes = _feed_steps(choice, easy, 16 * switch.SATURATION_STEPS + switch.EXPLORE + 50)
    assert choice.faster() == "sequential" and choice.patience == 1 and modes[-20:] == ["sequential"] * 20


def test_a_decisive_window_closes_early():
    """A gap over EARLY_GAP after EARLY steps closes the window (half the slower mode's steps); a
    narrower one is measured for the whole window."""
    wide = DraftingChoice()
    modes = _feed(wide, {"sequential": 100.0, "parallel": 150.0}, switch.WARMUP + switch.FIRST_EXPLORE)
    window = modes[switch.WARMUP:]
    assert window[:switch.EARLY].count("sequential") == switch.EARLY // 2
    assert window[switch.EARLY:] == ["parallel"] * (switch.FIRST_EXPLORE - switch.EARLY) and wide.windows == 1
    narrow = DraftingChoice()
    modes = _feed(narrow, {"sequential": 100.0, "parallel": 130.0}, switch.WARMUP + switch.FIRST_EXPLORE)
    assert modes[switch.WARMUP:].count("sequential") == switch.FIRST_EXPLORE // 2 and narrow.windows == 0



def test_a_split_window_gives_a_short_stretch():
    """A window whose cycles disagree (each mode faster in half of them: text noise, not a gap) keeps
    its choice for the shortest stretch, whatever the gap of its sums; a window whose every cycle
    agrees keeps it for a stretch that grows with the gap."""
    def stretch(per_cycle: list[dict]) -> int:
        choice = DraftingChoice()
        _feed_steps(choice, {"sequential": (2.0, 0.01), "parallel": (2.0, 0.01)}, switch.WARMUP)
        step = 0
        while not choice.windows:
            mode, skip = choice.choose()
            rates = per_cycle[(step // (2 * switch.BLOCK)) % len(per_cycle)]
            if not skip:
                choice.observe(mode, rates[mode], 0.01)
            step += 1
        return choice._left
    split = stretch([{"sequential": 2.0, "parallel": 6.0}, {"sequential": 2.2, "parallel": 2.0}])  # 2.5x on sums
    agreed = stretch([{"sequential": 2.0, "parallel": 2.6}])
    assert split <= int(switch.EXPLOIT * 0.25) < agreed  # (the first stretch step has run)


def test_a_near_tie_on_hard_text_keeps_the_mode_that_won_before():
    """Earlier windows count, decayed: after windows on easy text where the chain was twice as fast,
    a window on a hard prompt where the parallel tree is 2% ahead (a tie within the noise) keeps the
    chain; a clear reversal still switches within one window."""
    choice = DraftingChoice()
    _feed(choice, {"sequential": 200.0, "parallel": 100.0}, switch.WARMUP + switch.FIRST_EXPLORE)
    assert choice.faster() == "sequential"
    choice._left = 0  # the stretch ends: the next step opens a window on the hard prompt
    _feed(choice, {"sequential": 100.0, "parallel": 102.0}, switch.EXPLORE + 1)
    assert choice.faster() == "sequential" and choice.windows == 2
    choice._left = 0
    _feed(choice, {"sequential": 100.0, "parallel": 250.0}, switch.EXPLORE + 1)
    assert choice.faster() == "parallel"
