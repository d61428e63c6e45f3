#!/usr/bin/env python3
"""Train the small draft model shipped in benchmarks/targets/demo-draft (for ``kind="draft"``).

A 2-layer, hidden-128 ``LlamaForCausalLM`` with the demo target's own tokenizer (so token ids mean
the same tokens), trained **from scratch on text** (not distilled from the target) on the corpora
the target saw: the CPython standard library and Jane Austen's novels, split into train and test
by document exactly as ``train_target.py`` splits them (its loading and splitting functions are
imported, not copied). The same held-out documents stay held out.

Checkpointed: every ``--checkpoint-every`` steps the weights, the optimizer state and the batch
sampler's state are written (safetensors + JSON, never pickle) to ``--checkpoint-dir``;
``--resume`` continues from there. ``--max-minutes`` bounds the training time (resumed runs
included): the warmup + cosine schedule of ``--steps`` advances by steps done or by the share of
that time spent, whichever is further, so a slow (shared) machine still ends the schedule on time,
with fewer steps. At the end it writes ``--out-dir`` (bf16 ``model.safetensors``, ``config.json``,
``generation_config.json``, the target's tokenizer files) and ``train_summary.json`` in it:
held-out perplexity per mix, the share of held-out positions where the draft's argmax equals the
target's (a proxy for greedy acceptance), greedy samples, the per-step history.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/targets/train_draft.py --steps 900 --max-minutes 25
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import train_target as target_recipe  # noqa: E402  (the target's corpora, split and helpers)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def add_schedule_arguments(ap, *, batch_size: int, batch_help: str, steps: int, lr: float, warmup: int,
                           weight_decay: float, eval_every: int) -> None:
    """The optimisation and schedule flags both draft-training scripts take (their defaults differ)."""
    ap.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    ap.add_argument("--steps", type=int, default=steps, help="length of the learning-rate schedule")
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--weight-decay", type=float, default=weight_decay)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=eval_every)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code-dir", default=target_recipe.default_code_dir())
    ap.add_argument("--prose-dir", default="/tmp/corpora/janeaustenr-txt")
    ap.add_argument("--target-dir", default=os.path.join(HERE, "demo-llama"),
                    help="the target: its tokenizer is reused, its argmax is compared on held-out text")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "demo-draft"))
    ap.add_argument("--checkpoint-dir", default=os.path.join(HERE, "..", "results", "cache", "demo-draft-checkpoint"),
                    help="resumable state (default: benchmarks/results/cache/demo-draft-checkpoint, not tracked)")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--test-frac", type=float, default=0.05, help="must equal the target's (same held-out docs)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=352)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    add_schedule_arguments(ap, batch_size=8, batch_help="sequences per step (half code, half prose)", steps=900,
                           lr=4e-3, warmup=40, weight_decay=0.1, eval_every=150)
    ap.add_argument("--eval-chunks", type=int, default=16)
    ap.add_argument("--final-eval-chunks", type=int, default=64, help="held-out 256-token windows per mix at the end")
    ap.add_argument("--sample-new-tokens", type=int, default=40)
    ap.add_argument("--bench-steps", type=int, default=0, help="only time this many steps; write nothing")
    return ap.parse_args(argv)


def token_streams(args, tokenizer):
    """``{mix: (train ids, test ids)}`` packed as ``<|bos|> doc <|endoftext|>``, and corpus statistics."""
    import torch

    bos, eos = tokenizer.token_to_id(target_recipe.BOS), tokenizer.token_to_id(target_recipe.EOS)
    docs = {"code": target_recipe.collect_code_docs(args.code_dir),
            "prose": target_recipe.collect_prose_docs(args.prose_dir)}
    streams, stats = {}, {}
    for mix, collected in docs.items():
        if not collected:
            sys.exit(f"empty {mix} corpus")
        train, test = target_recipe.split_docs(collected, mix, args.test_frac)

        def pack(part):
            ids = []
            for encoding in tokenizer.encode_batch([text for _, text in part], add_special_tokens=False):
                ids += [bos, *encoding.ids, eos]
            return torch.tensor(ids, dtype=torch.int32)

        streams[mix] = (pack(train), pack(test))
        stats[mix] = {"docs_train": len(train), "docs_test": len(test), "tokens_train": len(streams[mix][0]),
                      "tokens_test": len(streams[mix][1])}
    return streams, stats


def save_checkpoint(directory, model, optimizer, generator, step, history) -> None:
    """Weights, optimizer state and sampler state as safetensors + JSON, swapped in atomically."""
    import torch
    from safetensors.torch import save_file

    staging = directory + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    # cloned: tied weights (embedding and head) share storage, which safetensors refuses
    save_file({name: t.detach().clone() for name, t in model.state_dict().items()},
              os.path.join(staging, "model.safetensors"))
    names = {id(p): name for name, p in model.named_parameters()}
    tensors, groups = {"generator": generator.get_state()}, []
    for group in optimizer.param_groups:
        groups.append({key: value for key, value in group.items() if key != "params"}
                      | {"params": [names[id(p)] for p in group["params"]]})
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"{names[id(p)]}::{key}"] = torch.as_tensor(value).detach().contiguous()
    save_file(tensors, os.path.join(staging, "optimizer.safetensors"))
    with open(os.path.join(staging, "state.json"), "w") as f:
        json.dump({"step": step, "param_groups": groups, "history": history}, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


def load_checkpoint(directory, model, optimizer, generator):
    """Restore what :func:`save_checkpoint` wrote; returns ``(step, history)``."""
    from safetensors.torch import load_file

    model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")), strict=True)
    tensors = load_file(os.path.join(directory, "optimizer.safetensors"))
    with open(os.path.join(directory, "state.json")) as f:
        state = json.load(f)
    generator.set_state(tensors.pop("generator"))
    parameters = dict(model.named_parameters())
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        if [parameters[name] for name in saved["params"]] != group["params"]:
            raise SystemExit(f"{directory}: optimizer groups do not match this model")
        group.update({key: value for key, value in saved.items() if key != "params"})
    for key, tensor in tensors.items():
        name, field = key.split("::")
        optimizer.state[parameters[name]][field] = tensor
    return state["step"], state["history"]


def argmax_agreement(draft, target, stream, seq_len, chunks, torch) -> float:
    """Share of held-out positions where the draft's and the target's next-token argmax agree."""
    same = total = 0
    with torch.no_grad():
        for index in range(min(chunks, (len(stream) - 1) // seq_len)):
            window = stream[index * seq_len: (index + 1) * seq_len].long()[None]
            same += int((draft(window).logits.argmax(-1) == target(window).logits.argmax(-1)).sum())
            total += window.numel()
    return same / max(1, total)


def main(argv=None):
    args = parse_args(argv)
    started = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = lambda message: print(f"[{time.time() - started:7.1f}s] {message}", flush=True)
    tokenizer = Tokenizer.from_file(os.path.join(args.target_dir, "tokenizer.json"))
    target_config = json.load(open(os.path.join(args.target_dir, "config.json")))
    vocab = tokenizer.get_vocab_size()
    if vocab != target_config["vocab_size"]:
        sys.exit(f"tokenizer vocabulary {vocab} != target vocab_size {target_config['vocab_size']}")
    streams, corpus_stats = token_streams(args, tokenizer)
    log(f"corpora: {corpus_stats}")

    bos, eos = target_config["bos_token_id"], target_config["eos_token_id"]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=target_config["pad_token_id"], hidden_act="silu",
        attention_bias=False, mlp_bias=False, use_cache=True,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in name]
    no_decay = [p for name, p in model.named_parameters() if not (p.dim() >= 2 and "embed_tokens" not in name)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    generator = torch.Generator().manual_seed(args.seed)
    step, history = 0, []
    if args.resume and os.path.isdir(args.checkpoint_dir):
        step, history = load_checkpoint(args.checkpoint_dir, model, optimizer, generator)
        log(f"resumed from {args.checkpoint_dir} at step {step}")
    log(f"model: {parameters:,} parameters; schedule {args.steps} steps x {args.batch_size} x {args.seq_len}")

    half, length = args.batch_size // 2, args.seq_len

    def batch():
        rows = []
        for mix, count in (("code", half), ("prose", args.batch_size - half)):
            train = streams[mix][0]
            for start in torch.randint(0, len(train) - length - 1, (count,), generator=generator).tolist():
                rows.append(train[start:start + length + 1])
        return torch.stack(rows).long()

    last_step = args.bench_steps or args.steps
    earlier = history[-1]["elapsed_s"] if history else 0.0  # training seconds of the runs resumed from
    train_started = time.time() - earlier
    model.train()
    while True:
        # the schedule's position: steps done, or the share of --max-minutes spent if that is further
        # (a busy machine then ends the cosine early instead of stopping mid-schedule)
        elapsed = time.time() - train_started
        position = max(step, int(args.steps * elapsed / (60 * args.max_minutes))) if args.max_minutes else step
        if step >= last_step or (position >= args.steps and not args.bench_steps):
            break
        learning_rate = target_recipe.lr_at(position, args)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        ids = batch()
        losses = F.cross_entropy(model(input_ids=ids[:, :-1]).logits.reshape(-1, vocab), ids[:, 1:].reshape(-1),
                                 reduction="none").view(len(ids), -1)
        loss = losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        optimizer.step()
        step += 1
        record = {"step": step, "position": position, "loss": round(loss.item(), 4),
                  "loss_code": round(losses[:half].mean().item(), 4),
                  "loss_prose": round(losses[half:].mean().item(), 4), "lr": learning_rate,
                  "grad_norm": round(norm, 3), "elapsed_s": round(time.time() - train_started, 1)}
        if step % args.eval_every == 0 and not args.bench_steps:
            record["eval"] = {mix: round(target_recipe.evaluate(model, streams[mix][1], length, args.eval_chunks,
                                                                [1] * vocab, torch)["loss"], 4) for mix in streams}
        history.append(record)
        if step % 25 == 0 or step == 1:
            log(f"step {step}: {record}")
        if not args.bench_steps and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, model, optimizer, generator, step, history)
    train_seconds = time.time() - train_started
    if args.bench_steps:
        print(json.dumps({"steps": step, "s_per_step": train_seconds / max(1, step), "params": parameters}))
        return 0
    save_checkpoint(args.checkpoint_dir, model, optimizer, generator, step, history)
    model.eval()

    os.makedirs(args.out_dir, exist_ok=True)
    for name in os.listdir(args.out_dir):
        os.remove(os.path.join(args.out_dir, name))
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos,
                                               pad_token_id=target_config["pad_token_id"], do_sample=False)
    model.to(torch.bfloat16).save_pretrained(args.out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(args.target_dir, name), os.path.join(args.out_dir, name))

    draft = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(args.out_dir)
    byte_lengths = target_recipe.token_byte_lengths(tokenizer)
    heldout = {}
    for mix in streams:
        result = target_recipe.evaluate(draft, streams[mix][1], length, args.final_eval_chunks, byte_lengths, torch)
        result["argmax_agreement_with_target"] = argmax_agreement(draft, target, streams[mix][1], length, 16, torch)
        heldout[mix] = result
        log(f"held-out {mix}: {result}")
    samples = {}
    for mix in ("code", "prose"):
        with open(os.path.join(HERE, "prompts", f"{mix}.jsonl")) as f:
            prompts = [json.loads(line)["prompt"] for line in f][:2]
        samples[mix] = [{"prompt": p, "greedy": target_recipe.greedy(draft, hf_tokenizer, p, args.sample_new_tokens,
                                                                     torch)} for p in prompts]
    files = {name: os.path.getsize(os.path.join(args.out_dir, name)) for name in sorted(os.listdir(args.out_dir))}
    summary = {
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "args": vars(args),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "corpora": corpus_stats,
        "model": {"params": parameters, "config": config.to_diff_dict()},
        "training": {"steps_done": step, "schedule_steps": args.steps, "schedule_by_time": step < args.steps,
                     "tokens_seen": step * args.batch_size * length, "train_s": round(train_seconds, 1),
                     "final_loss_mean_last_50": round(sum(r["loss"] for r in history[-50:]) / len(history[-50:]), 4)},
        "heldout": heldout,
        "samples": samples,
        "files": files,
        "total_bytes": sum(files.values()),
        "history": history,
    }
    with open(os.path.join(args.out_dir, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    log(f"wrote {args.out_dir} ({sum(files.values()) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
