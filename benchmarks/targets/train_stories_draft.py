#!/usr/bin/env python3
"""Train the draft model shipped in benchmarks/targets/stories260K-draft (for ``kind="draft"``).

A shallower ``LlamaForCausalLM`` (default: 1 layer, hidden 128, tied embeddings) with stories260K's own
tokenizer, distilled from the target at the sequence level: the target writes the training text,
one greedy and ``--samples`` temperature-1.0 continuations of ``--new-tokens`` tokens per prompt of
``prompts/stories_train.jsonl`` (never ``prompts/stories.jsonl``: its lines are the benchmark's
tuning and check prompts), and the draft learns the target's next-token distribution at every
position of that text (forward KL to the target's logits, computed on the fly: the target is tiny),
or the sampled tokens alone (``--loss ce``). The last ``--heldout-prompts`` training prompts and
their continuations are held out: the summary reports the draft's argmax agreement with the
target there (the share of positions where greedy verification would accept the draft's token).

``--init target`` starts from the target's own weights where the shapes allow it (the embedding,
the final norm and the target layers ``--init-layers``); ``random`` from scratch.

Checkpointed: the sampled text once (``data.safetensors``), then every ``--checkpoint-every`` steps
the weights, optimizer and batch sampler (``train_draft.save_checkpoint``: safetensors + JSON, never
pickle) in ``--checkpoint-dir``; ``--resume`` continues from there. ``--max-minutes`` bounds the
training time (resumed runs included), advancing the warmup + cosine schedule of ``--steps`` by
steps or by the share of that time spent, whichever is further (as ``train_draft.py`` does). At the
end it writes ``--out-dir``: float32 ``model.safetensors``, ``config.json``,
``generation_config.json`` (the target's), the target's tokenizer files and ``train_summary.json``
(arguments, data, per-step loss history, held-out agreement, a greedy-parity check of the draft
kind on held-out prompts).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/targets/train_stories_draft.py --max-minutes 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import train_draft as draft_recipe  # noqa: E402  (checkpoints, tokenizer files)
import train_target as target_recipe  # noqa: E402  (learning-rate schedule)

GENERATION_FILES = ("generation_config.json",)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-dir", default=os.path.join(HERE, "stories260K"))
    ap.add_argument("--prompts", default=os.path.join(HERE, "prompts", "stories_train.jsonl"))
    ap.add_argument("--out-dir", default=os.path.join(HERE, "stories260K-draft"))
    ap.add_argument("--checkpoint-dir",
                    default=os.path.join(HERE, "..", "results", "cache", "stories260K-draft-checkpoint"),
                    help="sampled data and resumable state (default under benchmarks/results/cache, not tracked)")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    ap.add_argument("--seed", type=int, default=260)
    ap.add_argument("--threads", type=int, default=1)
    # data
    ap.add_argument("--heldout-prompts", type=int, default=50, help="last prompts of --prompts kept out of training")
    ap.add_argument("--samples", type=int, default=7, help="temperature-1.0 continuations per prompt (plus 1 greedy)")
    ap.add_argument("--heldout-samples", type=int, default=2, help="sampled continuations per held-out prompt")
    ap.add_argument("--new-tokens", type=int, default=192, help="tokens per continuation (fewer where eos comes)")
    ap.add_argument("--sample-batch", type=int, default=64, help="rows per target generate call")
    # model
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=344)
    ap.add_argument("--init", choices=("target", "random"), default="random")
    ap.add_argument("--init-layers", default="0", help="target layers copied into the draft's layers (--init target)")
    # training
    ap.add_argument("--loss", choices=("kl", "ce"), default="kl")
    draft_recipe.add_schedule_arguments(ap, batch_size=16, batch_help="sequences per step", steps=7000, lr=3e-3,
                                        warmup=50, weight_decay=0.0, eval_every=500)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--check-prompts", type=int, default=4, help="held-out prompts of the greedy-parity check")
    return ap.parse_args(argv)


def read_prompts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def sample_rows(target, tokenizer, prompts, greedy, count, new_tokens, batch_size, seed, torch):
    """Token rows ``<s> prompt continuation`` (each cut after its first eos), ``count`` per prompt:
    greedy, or sampled at temperature 1.0 with no top-k/top-p; each generate call is seeded with
    ``seed * 1_000_003 + call``. Returns ``(rows, prompt_lengths)``: lists of 1-D int64 tensors / ints."""
    eos = set(target.generation_config.eos_token_id)
    pad = target.generation_config.pad_token_id
    texts = [prompt for prompt in prompts for _ in range(count)]
    rows, prompt_lengths = [], []
    for call, start in enumerate(range(0, len(texts), batch_size)):
        chunk = texts[start:start + batch_size]
        lengths = [len(tokenizer(text)["input_ids"]) for text in chunk]
        encoded = tokenizer(chunk, padding=True, padding_side="left", return_tensors="pt")
        width = encoded["input_ids"].shape[1]  # [rows, width]: <s> + prompt, left-padded
        torch.manual_seed(seed * 1_000_003 + call)
        settings = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        with torch.no_grad():
            output = target.generate(**encoded, max_new_tokens=new_tokens, pad_token_id=pad, **settings)
        for row, length in zip(output, lengths):
            new = row[width:].tolist()
            end = next((i + 1 for i, token in enumerate(new) if token in eos), len(new))
            rows.append(torch.cat([row[width - length:width], torch.tensor(new[:end])]))
            prompt_lengths.append(length)
    return rows, prompt_lengths


def pack(rows, pad, torch):
    """``[N, L]`` int64 right-padded with ``pad``, and the lengths ``[N]``."""
    lengths = torch.tensor([len(row) for row in rows])
    ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = row
    return ids, lengths


def make_data(args, target, tokenizer, torch):
    """The training and held-out text as tensors (``train_ids`` [N, L], ``train_lengths`` [N],
    ``heldout_*`` likewise, ``heldout_prompt_lengths`` [M], ``heldout_greedy`` [M] bool)."""
    prompts = read_prompts(args.prompts)
    train, heldout = prompts[:-args.heldout_prompts], prompts[-args.heldout_prompts:]
    sampling = dict(new_tokens=args.new_tokens, batch_size=args.sample_batch, torch=torch)
    greedy_rows, _ = sample_rows(target, tokenizer, train, True, 1, seed=args.seed, **sampling)
    sampled_rows, _ = sample_rows(target, tokenizer, train, False, args.samples, seed=args.seed + 1, **sampling)
    held_greedy, greedy_prompt = sample_rows(target, tokenizer, heldout, True, 1, seed=args.seed + 2, **sampling)
    held_sampled, sampled_prompt = sample_rows(target, tokenizer, heldout, False, args.heldout_samples,
                                               seed=args.seed + 3, **sampling)
    pad = target.generation_config.pad_token_id
    train_ids, train_lengths = pack(greedy_rows + sampled_rows, pad, torch)
    heldout_ids, heldout_lengths = pack(held_greedy + held_sampled, pad, torch)
    return {"train_ids": train_ids, "train_lengths": train_lengths,
            "heldout_ids": heldout_ids, "heldout_lengths": heldout_lengths,
            "heldout_prompt_lengths": torch.tensor(greedy_prompt + sampled_prompt),
            "heldout_greedy": torch.tensor([True] * len(held_greedy) + [False] * len(held_sampled)),
            "train_greedy_rows": torch.tensor(len(greedy_rows))}


def build_draft(args, target, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": args.layers,
                            "hidden_size": args.hidden, "num_attention_heads": args.heads,
                            "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate,
                            "head_dim": args.hidden // args.heads, "dtype": "float32"})
    config._attn_implementation = "sdpa"
    draft = LlamaForCausalLM(config)
    if args.init == "target":
        layers = [int(index) for index in args.init_layers.split(",")]
        shapes = (args.hidden, args.heads, args.kv_heads, args.intermediate)
        if shapes != (target.config.hidden_size, target.config.num_attention_heads,
                      target.config.num_key_value_heads, target.config.intermediate_size):
            sys.exit("--init target needs the target's hidden size, heads, kv heads and intermediate size")
        if len(layers) != args.layers or not all(0 <= i < target.config.num_hidden_layers for i in layers):
            sys.exit(f"--init-layers {args.init_layers}: one target layer per draft layer (0-"
                     f"{target.config.num_hidden_layers - 1})")
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)  # tied: the head too
            draft.model.norm.weight.copy_(target.model.norm.weight)
            for mine, theirs in zip(draft.model.layers, layers):
                mine.load_state_dict(target.model.layers[theirs].state_dict())
    return draft


def distill_loss(draft_logits, target_logits, ids, mask, loss, F):
    """Mean over positions ``mask`` of forward KL(target || draft) (``kl``) or the cross-entropy of the
    next token (``ce``); logits ``[B, L - 1, V]`` at the positions predicting ``ids[:, 1:]``."""
    log_q = F.log_softmax(draft_logits, dim=-1)
    if loss == "kl":
        log_p = F.log_softmax(target_logits, dim=-1)
        per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        per_position = -log_q.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (per_position * mask).sum() / mask.sum()


def heldout_metrics(draft, target, data, batch_size, torch, F):
    """Per held-out set (greedy / sampled continuations): the share of continuation positions where
    the draft's argmax equals the target's, the mean KL(target || draft) there, and the tokens counted."""
    ids, lengths = data["heldout_ids"], data["heldout_lengths"]
    counts = {name: [0, 0.0, 0] for name in ("greedy", "sampled_T1")}
    draft.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            rows = slice(start, start + batch_size)
            batch, width = ids[rows], int(lengths[rows].max())
            batch = batch[:, :width]
            positions = torch.arange(width - 1)[None]
            # position t predicts token t + 1; count those whose token is a continuation token
            mask = (positions + 1 < lengths[rows, None]) & (positions + 1 >= data["heldout_prompt_lengths"][rows, None])
            log_q = F.log_softmax(draft(batch).logits[:, :-1], -1)
            log_p = F.log_softmax(target(batch).logits[:, :-1], -1)
            same = log_q.argmax(-1) == log_p.argmax(-1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
            for row, greedy in enumerate(data["heldout_greedy"][rows].tolist()):
                entry = counts["greedy" if greedy else "sampled_T1"]
                entry[0] += int((same[row] & mask[row]).sum())
                entry[1] += float((kl[row] * mask[row]).sum())
                entry[2] += int(mask[row].sum())
    draft.train()
    return {name: {"argmax_agreement": round(same / max(1, total), 4), "kl": round(kl / max(1, total), 4),
                   "tokens": total} for name, (same, kl, total) in counts.items()}


def parity_check(target, draft, tokenizer, prompts, new_tokens, torch):
    """Greedy ``spec.generate`` with the draft against ``target.generate`` on ``prompts``: identical
    outputs, and tokens per target forward (tau) over all of them."""
    import heads

    spec = heads.attach_heads(target, kind="draft", draft_model=draft)
    identical, new, forwards = True, 0, 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False)
        drafted = spec.generate(ids, max_new_tokens=new_tokens)
        identical &= torch.equal(plain, drafted)
        new += spec.last_stats.new_tokens
        forwards += spec.last_stats.target_forwards
    return {"prompts": len(prompts), "max_new_tokens": new_tokens, "identical": identical,
            "tau": round(new / max(1, forwards), 3)}


def main(argv=None):
    args = parse_args(argv)
    started = time.time()
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = lambda message: print(f"[{time.time() - started:7.1f}s] {message}", flush=True)
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    for parameter in target.parameters():
        parameter.requires_grad_(False)

    data_path = os.path.join(args.checkpoint_dir, "data.safetensors")
    if args.resume and os.path.isfile(data_path):
        data = load_file(data_path)
        log(f"data from {data_path}")
    else:
        data = make_data(args, target, tokenizer, torch)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in data.items()}, data_path)
    sampling_seconds = time.time() - started
    train_ids, train_lengths = data["train_ids"], data["train_lengths"]
    data_stats = {"train_sequences": len(train_ids), "train_greedy_sequences": int(data["train_greedy_rows"]),
                  "train_tokens": int(train_lengths.sum()), "heldout_sequences": len(data["heldout_ids"]),
                  "heldout_tokens": int(data["heldout_lengths"].sum()),
                  "sampling_s": round(sampling_seconds, 1)}
    log(f"data: {data_stats}")

    draft = build_draft(args, target, torch)
    parameters = sum(p.numel() for p in draft.parameters())
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=args.weight_decay, foreach=True)
    generator = torch.Generator().manual_seed(args.seed)
    step, history = 0, []
    checkpoint = os.path.join(args.checkpoint_dir, "state")
    if args.resume and os.path.isdir(checkpoint):
        step, history = draft_recipe.load_checkpoint(checkpoint, draft, optimizer, generator)
        log(f"resumed from {checkpoint} at step {step}")
    log(f"draft: {parameters:,} parameters; schedule {args.steps} steps x {args.batch_size} sequences")
    evaluations = [] if not history else [{"step": r["step"], **r["heldout"]} for r in history if "heldout" in r]
    if not history:
        evaluations.append({"step": 0, **heldout_metrics(draft, target, data, 64, torch, F)})
        log(f"held-out at step 0: {evaluations[-1]}")

    earlier = history[-1]["elapsed_s"] if history else 0.0
    train_started = time.time() - earlier
    draft.train()
    while True:
        elapsed = time.time() - train_started
        position = max(step, int(args.steps * elapsed / (60 * args.max_minutes))) if args.max_minutes else step
        if position >= args.steps:
            break
        learning_rate = target_recipe.lr_at(position, args)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate
        rows = torch.randint(0, len(train_ids), (args.batch_size,), generator=generator)
        lengths = train_lengths[rows]
        ids = train_ids[rows, :int(lengths.max())]  # [B, L], right-padded
        mask = (torch.arange(ids.shape[1] - 1)[None] + 1 < lengths[:, None]).float()  # [B, L - 1]
        with torch.no_grad():
            target_logits = target(ids).logits[:, :-1] if args.loss == "kl" else None
        loss = distill_loss(draft(ids).logits[:, :-1], target_logits, ids, mask, args.loss, F)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip).item()
        optimizer.step()
        step += 1
        record = {"step": step, "position": position, "loss": round(loss.item(), 4), "lr": learning_rate,
                  "grad_norm": round(norm, 3), "elapsed_s": round(time.time() - train_started, 1)}
        if step % args.eval_every == 0:
            record["heldout"] = heldout_metrics(draft, target, data, 64, torch, F)
            evaluations.append({"step": step, **record["heldout"]})
        history.append(record)
        if step % args.log_every == 0 or step == 1 or "heldout" in record:
            log(f"step {step}: {record}")
        if step % args.checkpoint_every == 0:
            draft_recipe.save_checkpoint(checkpoint, draft, optimizer, generator, step, history)
    train_seconds = time.time() - train_started
    draft_recipe.save_checkpoint(checkpoint, draft, optimizer, generator, step, history)
    final = heldout_metrics(draft, target, data, 64, torch, F)
    log(f"held-out at step {step}: {final}")

    os.makedirs(args.out_dir, exist_ok=True)
    for name in os.listdir(args.out_dir):
        os.remove(os.path.join(args.out_dir, name))
    draft.eval().save_pretrained(args.out_dir)
    for name in (*draft_recipe.TOKENIZER_FILES, *GENERATION_FILES):
        shutil.copy(os.path.join(args.target_dir, name), os.path.join(args.out_dir, name))
    shipped = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32).eval()
    check = parity_check(target, shipped, tokenizer, read_prompts(args.prompts)[-args.check_prompts:], 64, torch)
    log(f"greedy parity on held-out prompts: {check}")
    files = {name: os.path.getsize(os.path.join(args.out_dir, name)) for name in sorted(os.listdir(args.out_dir))}
    summary = {
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "args": vars(args),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "data": data_stats,
        "model": {"params": parameters, "config": shipped.config.to_diff_dict()},
        "training": {"steps_done": step, "schedule_steps": args.steps, "schedule_by_time": step < args.steps,
                     "train_s": round(train_seconds, 1),
                     "final_loss_mean_last_50": round(sum(r["loss"] for r in history[-50:]) / max(1, len(history[-50:])), 4)},
        "heldout": final,
        "heldout_history": evaluations,
        "greedy_parity": check,
        "files": files,
        "history": [{key: value for key, value in record.items() if key != "heldout"} for record in history],
    }
    with open(os.path.join(args.out_dir, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    log(f"wrote {args.out_dir}")
    return 0 if check["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
