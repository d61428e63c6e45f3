"""Tiny random models of every supported family, built from configs (no downloads), fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
    Qwen2Config, Qwen2ForCausalLM,
)

torch.set_num_threads(1)  # the CI machine has 2 cores; a second thread mostly spins

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _llama(tied: bool = False):
    return LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=tied))


BUILDERS = {
    "llama": _llama,
    "llama-tied": lambda: _llama(tied=True),
    # small sliding windows so that prompts + generations cross them
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=12)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        **_COMMON, head_dim=8, sliding_window=10, final_logit_softcapping=30.0, pad_token_id=0)),
}
ARCHITECTURES = tuple(BUILDERS)


def build_model(name: str, seed: int = 0, attn_implementation: str = "sdpa", eos: int | None = None):
    """A tiny random model of family ``name`` in eval mode, with ``eos`` as its only eos token."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    if name == "gemma2":
        attn_implementation = "eager"  # transformers offers only eager attention for Gemma-2
    model.set_attn_implementation(attn_implementation)
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def random_prompt(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def left_pad(prompts, width: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts as a left-padded batch ``[B, width]`` (default: the longest) and its attention mask."""
    width = width or max(prompt.numel() for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel():], mask[row, width - prompt.numel():] = prompt, 1
    return ids, mask


def record_drafted_tokens(spec) -> list[int]:
    """Wrap ``spec``'s drafter so that every drafted (non-root) token it proposes is appended to the
    returned list."""
    proposed: list[int] = []
    original = spec.drafter.propose

    def watch(batch):
        trees = original(batch)
        proposed.extend(token for tree in trees.trees() for token in tree.tokens[1:].tolist())
        return trees

    spec.drafter.propose = watch
    return proposed


def greedy_reference(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=max_new_tokens)


@pytest.fixture
def full_precision_drafters():
    """Lean drafter forwards on the float32 weights themselves (``heads.lean.full_precision``): for
    tests that compare decode-time drafter arithmetic with a training or reference forward to float
    rounding, where a single-row step's float16 copies would differ by half-precision rounding."""
    from heads import lean

    with lean.full_precision():
        yield


@pytest.fixture(params=ARCHITECTURES)
def architecture(request) -> str:
    return request.param


def progression_batch(count: int, length: int, generator: torch.Generator, vocab: int = VOCAB,
                      noise: float = 0.0) -> torch.Tensor:
    """Arithmetic progressions over ids 3..vocab-1 (stride 1-3, random start): a language a tiny
    model can learn. With ``noise``, that share of tokens is replaced by random ones."""
    span = vocab - 3
    starts = torch.randint(0, span, (count, 1), generator=generator)
    strides = torch.randint(1, 4, (count, 1), generator=generator)
    batch = 3 + (starts + strides * torch.arange(length)) % span
    if noise:
        flip = torch.rand(batch.shape, generator=generator) < noise
        batch = torch.where(flip, torch.randint(3, vocab, batch.shape, generator=generator), batch)
    return batch


def train_toy_target(steps: int = 150, seed: int = 0, vocab: int = VOCAB, noise: float = 0.0, batches=None):
    """A tiny Llama trained for a few seconds on progressions: its greedy continuations are
    predictable, so draft heads can learn them (random weights give near-unlearnable loops).
    With ``noise`` its distributions keep real spread (for sampling tests). ``batches(generator)``
    replaces the progressions with another language (``[32, 24]`` ids per step)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": vocab}))
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = batches(generator) if batches else progression_batch(32, 24, generator, vocab, noise)
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


@pytest.fixture(scope="session")
def toy_target():
    return train_toy_target()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (minutes each: the manual's training commands)")


def pytest_collection_modifyitems(config, items):
    """A test marked ``slow(reason=...)`` is skipped with that reason unless ``--run-slow`` is given."""
    if config.getoption("--run-slow"):
        return
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            reason = marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"slow ({reason}); pytest --run-slow runs it"))
