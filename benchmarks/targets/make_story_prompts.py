"""Prompt sets for stories260K, sampled from the model itself.

Each story is sampled with ``do_sample=True``, temperature 1.0, no top-k/top-p, from ``<s>`` alone or
``<s>`` plus a short opening, and cut into a prompt of 16-64 tokens (not counting ``<s>``): the
first 1-3 sentences when one of those cuts falls in that range, else a word boundary at a random
token target.  The training and held-out sets use different seeds; prompts are deduplicated within
each set, and a training prompt that equals, extends or is extended by a held-out prompt is dropped.

    .venv/bin/python benchmarks/targets/make_story_prompts.py          # writes prompts/stories*.jsonl

Files hold one ``{"prompt": "..."}`` per line, like ``prompts/prose.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

HERE = Path(__file__).resolve().parent
# "" means <s> alone; it is listed several times so that about 40 % of stories start from <s> alone
OPENINGS = ("", "", "", "", "Once upon a time", "One day,", "There was a", "Tom and", "The sun", "Lily")
MIN_TOKENS, MAX_TOKENS = 16, 64
SENTENCE_END = re.compile(r"[.!?][\"']?(?=\s|$)")


def token_count(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Number of tokens of ``text`` without ``<s>``."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def sample_stories(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int, seed: int,
                   batch_size: int = 64, max_new_tokens: int = 96) -> list[tuple[str, bool]]:
    """``count`` sampled (story text, ended) pairs; ``ended`` is True when the story reached eos.

    Each row starts from an opening drawn from OPENINGS with ``random.Random(seed)``; rows are
    left-padded, and each batch is seeded with ``seed * 1_000_003 + batch``.
    """
    eos = set(model.generation_config.eos_token_id)
    rng = random.Random(seed)
    stories: list[tuple[str, bool]] = []
    for batch in range(math.ceil(count / batch_size)):
        rows = min(batch_size, count - batch * batch_size)
        encoded = tokenizer([rng.choice(OPENINGS) for _ in range(rows)], padding=True,
                            padding_side="left", return_tensors="pt")
        prompt_length = encoded["input_ids"].shape[1]  # [rows, prompt_length], <s> + opening, left-padded
        torch.manual_seed(seed * 1_000_003 + batch)
        output = model.generate(**encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                max_new_tokens=max_new_tokens)
        for row in output.tolist():  # [prompt_length + new]
            ended = any(token in eos for token in row[prompt_length:])
            stories.append((tokenizer.decode(row, skip_special_tokens=True), ended))
    return stories


def cut_prompt(tokenizer: PreTrainedTokenizerBase, story: str, ended: bool, rng: random.Random) -> str | None:
    """A 16-64-token prefix of ``story``: its first 1-3 sentences if possible, else a word-boundary cut.

    A cut at the very end of a finished story is not used (the prompt would be the whole story).
    Returns None when the story is too short.
    """
    text = story.rstrip()
    sentence_cuts = []
    for match in SENTENCE_END.finditer(text):
        prefix = text[:match.end()]
        if ended and match.end() == len(text):
            break
        tokens = token_count(tokenizer, prefix)
        if tokens > MAX_TOKENS:
            break
        if tokens >= MIN_TOKENS:
            sentence_cuts.append(prefix)
        if len(sentence_cuts) == 3:
            break
    if sentence_cuts:
        return rng.choice(sentence_cuts)
    target = rng.randint(MIN_TOKENS, MAX_TOKENS)
    best = None
    for match in re.finditer(r"\S+", text):
        prefix = text[:match.end()]
        if ended and match.end() == len(text):
            break
        tokens = token_count(tokenizer, prefix)
        if tokens > target:
            break
        if tokens >= MIN_TOKENS:
            best = prefix
    return best


def make_prompts(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int, seed: int,
                 exclude: list[str] = ()) -> list[str]:
    """``count`` distinct prompts from stories sampled with ``seed``, none overlapping ``exclude``.

    Samples more stories in rounds until enough prompts survive the cut, dedupe and exclusion.
    """
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    round_index = 0
    while len(prompts) < count:
        if round_index == 20:
            raise RuntimeError(f"only {len(prompts)} of {count} prompts after 20 rounds of sampling")
        stories = sample_stories(model, tokenizer, int((count - len(prompts)) * 1.3) + 16,
                                 seed=seed * 100 + round_index)
        round_index += 1
        for story, ended in stories:
            prompt = cut_prompt(tokenizer, story, ended, rng)
            if prompt is None or prompt in seen:
                continue
            if any(prompt.startswith(other) or other.startswith(prompt) for other in exclude):
                continue
            seen.add(prompt)
            prompts.append(prompt)
    return prompts[:count]


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``texts``, each scored on its own after ``<s>`` (which is not scored)."""
    total_nll, total_tokens = 0.0, 0
    for text in texts:
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]  # [1, T]
        logits = model(input_ids).logits[0, :-1].double()  # [T - 1, V]
        targets = input_ids[0, 1:]
        total_nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens), total_tokens


def write_jsonl(path: Path, prompts: list[str]) -> None:
    """One ``{"prompt": ...}`` per line, UTF-8."""
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sample stories260K prompt sets from the model itself.")
    parser.add_argument("--model", type=Path, default=HERE / "stories260K")
    parser.add_argument("--out", type=Path, default=HERE / "prompts")
    parser.add_argument("--train", type=int, default=500, help="prompts in stories_train.jsonl")
    parser.add_argument("--held-out", type=int, default=100, help="prompts in stories.jsonl")
    parser.add_argument("--train-seed", type=int, default=1)
    parser.add_argument("--held-out-seed", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    held_out = make_prompts(model, tokenizer, args.held_out, args.held_out_seed)
    train = make_prompts(model, tokenizer, args.train, args.train_seed, exclude=held_out)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, prompts in (("stories.jsonl", held_out), ("stories_train.jsonl", train)):
        write_jsonl(args.out / name, prompts)
        lengths = [token_count(tokenizer, prompt) for prompt in prompts]
        print(f"{args.out / name}: {len(prompts)} prompts, tokens min/mean/max "
              f"{min(lengths)}/{sum(lengths) / len(lengths):.1f}/{max(lengths)}")
    ppl, tokens = perplexity(model, tokenizer, held_out)
    print(f"held-out perplexity {ppl:.3f} over {tokens} tokens")


if __name__ == "__main__":
    main()
