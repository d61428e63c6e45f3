"""EAGLE's training recipe on a small pretrained-like target (issue 13): with the command line's
defaults and the same step budget, EAGLE's held-out depth-1 accuracy beats Medusa head 1's, and
the recipe before the issue (learning rate 1e-3, token weight 0.1, random projection) falls
clearly short of it; the projection's least-squares start is checked against ``torch.linalg.lstsq``.

The target is a tiny Llama shaped like stories260K (hidden 64, 8 query / 4 key-value heads of
dimension 8, tied embeddings), trained here in a few seconds on a fixed corpus of templated
stories, so that its continuations have the structure of a real language model's: a fixed
syntax, recurring names and objects, and real uncertainty at content words.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import heads
from heads.eagle.loss import fit_linear
from training.cli import build_parser
from training.commands.train import train_config
from training.trainer import make_trainer

NAMES = ("lily", "tom", "sue", "ben", "max", "mia", "sam", "ann")
THINGS = ("ball", "cat", "dog", "box", "cake", "tree", "boat", "kite", "hat", "bird")
COLORS = ("red", "big", "small", "blue", "green", "happy", "old")
PLACES = ("park", "house", "shop", "lake", "school")
OPENING = "once upon a time there was a {c} {t} ."
SENTENCES = ("{n} liked the {t} very much .", "one day {n} went to the {p} with {m} .",
             "{n} saw a {c} {t} at the {p} .", "{n} and {m} played with the {t} .", "they were very happy .",
             "{m} said : look at the {c} {t} !", "{n} gave the {t} to {m} .")
ENDING = "the end ."
WORDS = sorted({word for text in (OPENING, ENDING, *SENTENCES) for word in text.split() if "{" not in word}
               | set(NAMES) | set(THINGS) | set(COLORS) | set(PLACES))
IDS = {word: index + 3 for index, word in enumerate(WORDS)}  # 0 pad, 1 bos, 2 eos
VOCAB = 64
BUDGET = 120  # optimizer steps of every drafter (batch 8, the command line's default)


def _story(generator: torch.Generator) -> list[int]:
    """One story: an opening, 3-5 sentences about the same two names, object and place, an ending."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    name, friend, thing, place = pick(NAMES), pick(NAMES), pick(THINGS), pick(PLACES)
    text = [OPENING.format(c=pick(COLORS), t=thing)]
    for _ in range(int(torch.randint(3, 6, (1,), generator=generator))):
        text.append(pick(SENTENCES).format(n=name, m=friend, t=pick((thing, thing, pick(THINGS))), c=pick(COLORS),
                                           p=place))
    text.append(ENDING)
    return [1] + [IDS[word] for word in " ".join(text).split()]


def _corpus(seed: int, stories: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.tensor([token for _ in range(stories) for token in _story(generator)])


@pytest.fixture(scope="module")
def target():
    """A tiny pretrained-like Llama: tied embeddings, GQA, trained on the corpus (loss about 0.8 nats)."""
    assert len(IDS) + 3 <= VOCAB
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=256))
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    corpus = _corpus(0, 1500)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(200):
        starts = torch.randint(0, corpus.numel() - 65, (16,), generator=generator).tolist()
        batch = torch.stack([corpus[start:start + 64] for start in starts])
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model


@pytest.fixture(scope="module")
def sequences(target):
    """The target's greedy continuations (40 tokens) of 8-token windows of held-out stories."""
    text = _corpus(99, 300)
    starts = torch.randint(0, text.numel() - 9, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = torch.stack([text[start:start + 8] for start in starts])
    with torch.no_grad():
        output = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                 max_new_tokens=40)
    return list(output)


def _command_line_config(kind: str, **changes):
    """The ``TrainConfig`` ``selfdraft train --kind KIND --steps BUDGET`` builds, with ``changes``."""
    args = build_parser().parse_args(["train", "--model", "unused", "--kind", kind, "--data", "unused", "--out",
                                      "unused", "--steps", str(BUDGET)])
    return dataclasses.replace(train_config(args), validation_fraction=0.25, **changes)


def _depth1_accuracy(target, sequences, kind: str, fit: bool = True, **changes) -> float:
    """Held-out top-1 accuracy of the first drafted token (EAGLE's first step, Medusa's head 1);
    ``fit=False``: EAGLE's projection starts random, as before issue 13."""
    torch.manual_seed(0)  # as the command line seeds before attach_heads
    spec = heads.attach_heads(target, kind=kind)
    trainer = make_trainer(spec, sequences, _command_line_config(kind, **changes), progress=False)
    if not fit:
        trainer.hook.fit_projection = lambda: None
    return trainer.train().accuracy[0][0]


def test_eagle_beats_medusa_head1_with_the_default_recipe(target, sequences):
    medusa = _depth1_accuracy(target, sequences, "medusa")
    eagle = _depth1_accuracy(target, sequences, "eagle")
    before = _depth1_accuracy(target, sequences, "eagle", fit=False, learning_rate=1e-3, token_weight=0.1)
    assert eagle > medusa + 0.03, (eagle, medusa)  # both at their defaults (lr 1e-2): 0.99 vs 0.92
    assert eagle > before + 0.05, (eagle, before)


def test_fit_linear_matches_least_squares():
    """The ridge fit from accumulated moments equals lstsq on the stacked rows (tiny ridge), and a
    large ridge shrinks the weight towards 0."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(200, 5, generator=generator, dtype=torch.float64)
    weight, bias = torch.randn(3, 5, generator=generator, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    targets = inputs @ weight.T + bias + 0.01 * torch.randn(200, 3, generator=generator, dtype=torch.float64)
    extended = torch.cat([inputs, torch.ones(200, 1, dtype=torch.float64)], dim=1)
    fitted_weight, fitted_bias = fit_linear(extended.T @ extended, extended.T @ targets, ridge=1e-12)
    reference = torch.linalg.lstsq(extended, targets).solution  # (6, 3)
    torch.testing.assert_close(fitted_weight, reference[:-1].T)
    torch.testing.assert_close(fitted_bias, reference[-1])
    shrunk, _ = fit_linear(extended.T @ extended, extended.T @ targets, ridge=10.0)
    assert shrunk.norm() < 0.5 * fitted_weight.norm()


def test_training_starts_from_the_fitted_projection(target, sequences):
    """``prepare`` fits the projection: before any step the drafter already predicts the next token
    far better than at random, deterministically (two fits give the same tensors)."""
    torch.manual_seed(0)
    spec = heads.attach_heads(target, kind="eagle")
    trainer = make_trainer(spec, sequences, _command_line_config("eagle"), progress=False)
    random_start = trainer.rank_accuracy()[0][0]
    trainer.hook.prepare()
    fitted = trainer.rank_accuracy()[0][0]
    weight = spec.heads.projection.weight.clone()
    trainer.hook.prepare()
    assert torch.equal(weight, spec.heads.projection.weight)
    assert fitted > random_start + 0.2, (random_start, fitted)


def test_command_line_defaults_per_kind():
    """``--lr`` defaults to the kind's rate (EAGLE and Medusa 1e-2; the draft kind TrainConfig's 1e-3);
    ``--token-weight`` to 1.0; an explicit ``--lr`` wins."""
    assert _command_line_config("eagle").learning_rate == 1e-2
    assert _command_line_config("medusa").learning_rate == 1e-2
    assert _command_line_config("eagle").token_weight == 1.0
    args = build_parser().parse_args(["train", "--model", "m", "--kind", "eagle", "--data", "d", "--out", "o",
                                      "--lr", "3e-3"])
    assert train_config(args).learning_rate == 3e-3
