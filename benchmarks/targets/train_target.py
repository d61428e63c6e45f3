#!/usr/bin/env python3
"""Train the small Llama-architecture demo target model shipped in benchmarks/targets/demo-llama.

Everything is trained from scratch on this machine, on CPU, from two corpora:

* code:  the CPython standard library ``.py`` sources (test directories,
         site-packages, encodings/ codec tables and pydoc_data excluded);
* prose: plain-text files (by default Jane Austen's six novels, extracted from the
         Debian package ``r-cran-janeaustenr`` with ``extract_janeaustenr.py``).

Steps (all deterministic for a given ``--seed`` and ``--threads``):

1. collect documents (code: one document per file, sorted by relative path;
   prose: one document per chapter, sorted by file name), hold out a test split
   per mix by document (the ``--test-frac`` of documents with the smallest
   SHA-256 of their id);
2. train a byte-level BPE tokenizer on the training split;
3. tokenize, pack each mix into one token stream (``<|bos|> doc <|endoftext|>``);
4. train ``LlamaForCausalLM`` with AdamW, linear warmup + cosine decay, fp32,
   each batch half code windows and half prose windows;
5. report held-out perplexity per mix, save the model in bf16 plus tokenizer and
   generation config, reload the saved directory with the Auto classes, re-check
   perplexity and greedy generation, and write held-out / training prompt sets.

See benchmarks/targets/README.md for the exact command used for the shipped model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BOS = "<|bos|>"
EOS = "<|endoftext|>"

CODE_EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                     "pydoc_data", "encodings"}


def default_code_dir() -> str:
    cand = "/root/.pyenv/versions/3.11.7/lib/python3.11"
    return cand if os.path.isdir(cand) else sysconfig.get_paths()["stdlib"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code-dir", default=default_code_dir(), help="CPython Lib directory with the stdlib .py files")
    ap.add_argument("--prose-dir", default="/tmp/corpora/janeaustenr-txt", help="directory of UTF-8 .txt files")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "demo-llama"))
    ap.add_argument("--prompts-dir", default=os.path.join(HERE, "prompts"))
    ap.add_argument("--summary", default=os.path.join(HERE, "train_summary.json"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed for determinism)")
    ap.add_argument("--test-frac", type=float, default=0.05)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step (half code, half prose)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-chunks", type=int, default=16, help="held-out chunks per mix for the periodic eval")
    ap.add_argument("--final-eval-max-tokens", type=int, default=65536,
                    help="held-out tokens per mix for the final perplexity of the shipped model (0 = whole test split)")
    ap.add_argument("--fp32-eval-chunks", type=int, default=32,
                    help="held-out windows per mix on which the fp32 model and the bf16 shipped model are compared")
    ap.add_argument("--compile", type=int, default=1, help="torch.compile the training forward/backward (1/0)")
    ap.add_argument("--n-test-prompts", type=int, default=300)
    ap.add_argument("--n-train-prompts", type=int, default=2000)
    ap.add_argument("--prompt-min-tokens", type=int, default=32)
    ap.add_argument("--prompt-max-tokens", type=int, default=96)
    ap.add_argument("--sample-new-tokens", type=int, default=40)
    ap.add_argument("--bench-steps", type=int, default=0,
                    help="only time this many training steps (throughput measurement) and exit; writes nothing")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- corpora

def collect_code_docs(root: str):
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in CODE_EXCLUDE_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("_sysconfigdata"):
                continue
            path = os.path.join(dirpath, fn)
            try:
                with open(path, "rb") as f:
                    text = f.read().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            text = text.replace("\r\n", "\n")
            if len(text.strip()) < 200:
                continue
            docs.append((os.path.normpath(os.path.relpath(path, root)), text))
    docs.sort(key=lambda d: d[0])
    return docs


_CHAPTER_RE = re.compile(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLCDM]+\.?\s*$", re.M)


def _unwrap(text: str) -> str:
    paras = []
    for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        p = " ".join(line.strip() for line in p.split("\n") if line.strip())
        if p:
            paras.append(p)
    return "\n\n".join(paras)


def collect_prose_docs(root: str):
    """One document per chapter (falls back to ~16 kB paragraph-aligned chunks)."""
    docs = []
    for fn in sorted(os.listdir(root)):
        if not fn.endswith(".txt"):
            continue
        with open(os.path.join(root, fn), encoding="utf-8") as f:
            raw = f.read()
        starts = [m.start() for m in _CHAPTER_RE.finditer(raw)]
        pieces = []
        if len(starts) >= 3:
            starts[0] = 0  # title page goes with the first chapter
            for i, s in enumerate(starts):
                pieces.append(raw[s: starts[i + 1] if i + 1 < len(starts) else len(raw)])
        else:
            cur = ""
            for p in re.split(r"\n\s*\n", raw):
                cur += p + "\n\n"
                if len(cur) > 16000:
                    pieces.append(cur)
                    cur = ""
            if cur.strip():
                pieces.append(cur)
        for i, piece in enumerate(pieces):
            text = _unwrap(piece)
            if len(text) > 200:
                docs.append((f"{fn}#{i:04d}", text))
    return docs


def split_docs(docs, mix: str, frac: float):
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"{mix}:{d[0]}".encode()).hexdigest())
    n_test = max(1, math.ceil(frac * len(docs)))
    test_ids = {d[0] for d in ranked[:n_test]}
    train = [d for d in docs if d[0] not in test_ids]
    test = [d for d in docs if d[0] in test_ids]
    return train, test


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def token_byte_lengths(tok):
    lens = [0] * tok.get_vocab_size()
    for t, i in tok.get_vocab().items():
        lens[i] = 0 if t in (BOS, EOS) else len(t)  # each ByteLevel char is exactly one byte
    return lens


# ----------------------------------------------------------------------------- prompts

def make_code_prompts(docs, tok, n, rng, lo, hi):
    out, seen = [], set()
    weights = [len(t) for _, t in docs]
    attempts = 0
    while len(out) < n and attempts < n * 200:
        attempts += 1
        _, text = rng.choices(docs, weights=weights)[0]
        lines = text.split("\n")
        if rng.random() < 0.5:
            cands = [i for i, l in enumerate(lines) if re.match(r"\s*(async\s+)?(def|class)\s", l)]
            if not cands:
                continue
            start = rng.choice(cands)
        else:
            start = rng.randrange(len(lines))
        if not lines[start].strip():
            continue
        target = rng.randint(lo, hi)
        chunk, best = "", None
        for line in lines[start:]:
            cand = chunk + line + "\n"
            ntok = len(tok.encode(cand, add_special_tokens=False).ids)
            if ntok > hi:
                break
            chunk = cand
            if ntok >= lo:
                best = chunk
            if ntok >= target:
                break
        if best is None or best in seen or len(best.strip()) < 40:
            continue
        seen.add(best)
        out.append(best)
    return out


def make_prose_prompts(docs, tok, n, rng, lo, hi):
    out, seen = [], set()
    paras = []
    for _, text in docs:
        ps = text.split("\n\n")
        for i, p in enumerate(ps):
            if len(p) >= 120:
                paras.append((ps, i))
    attempts = 0
    while len(out) < n and attempts < n * 200:
        attempts += 1
        ps, i = rng.choice(paras)
        text = ps[i]
        if i > 0 and rng.random() < 0.3:  # sometimes include the previous paragraph
            text = ps[i - 1] + "\n\n" + text
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) < lo:
            continue
        target = rng.randint(lo, min(hi, len(enc.ids)))
        end = enc.offsets[target - 1][1]
        cut = text[:end]
        # end at a word boundary, without trailing whitespace
        if end < len(text) and not text[end].isspace():
            sp = cut.rfind(" ")
            if sp <= 0:
                continue
            cut = cut[:sp]
        cut = cut.rstrip()
        ntok = len(tok.encode(cut, add_special_tokens=False).ids)
        if ntok < lo or ntok > hi or cut in seen:
            continue
        seen.add(cut)
        out.append(cut)
    return out


def write_jsonl(path, prompts):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- training helpers

def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    prog = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def evaluate(model, stream, seq_len, max_chunks, byte_lens, torch, batch=8):
    """Mean next-token NLL over non-overlapping windows of the held-out stream."""
    import torch.nn.functional as F

    n_chunks = (len(stream) - 1) // seq_len
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    tot_nll, tot_tok, tot_bytes = 0.0, 0, 0
    bl = torch.tensor(byte_lens, dtype=torch.long)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b0 in range(0, n_chunks, batch):
            idx = range(b0, min(n_chunks, b0 + batch))
            x = torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in idx]).long()
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            tot_nll += nll.item()
            tot_tok += x[:, 1:].numel()
            tot_bytes += int(bl[x[:, 1:]].sum())
    if was_training:
        model.train()
    mean = tot_nll / max(1, tot_tok)
    return {"tokens": tot_tok, "bytes": tot_bytes, "loss": mean, "ppl": math.exp(mean),
            "bits_per_byte": tot_nll / math.log(2) / max(1, tot_bytes)}


def greedy(model, hf_tok, prompt, n_new, torch):
    enc = hf_tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n_new, do_sample=False)
    return hf_tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=False)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM, PreTrainedTokenizerFast)

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    def log(msg):
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # 1. corpora
    code_docs = collect_code_docs(args.code_dir)
    prose_docs = collect_prose_docs(args.prose_dir)
    if not code_docs or not prose_docs:
        sys.exit(f"empty corpus: {len(code_docs)} code docs from {args.code_dir}, "
                 f"{len(prose_docs)} prose docs from {args.prose_dir}")
    code_train, code_test = split_docs(code_docs, "code", args.test_frac)
    prose_train, prose_test = split_docs(prose_docs, "prose", args.test_frac)
    nbytes = lambda ds: sum(len(t.encode("utf-8")) for _, t in ds)
    corpus_stats = {
        "code": {"dir": args.code_dir, "docs_train": len(code_train), "docs_test": len(code_test),
                 "bytes_train": nbytes(code_train), "bytes_test": nbytes(code_test),
                 "test_docs": [d for d, _ in code_test]},
        "prose": {"dir": args.prose_dir, "docs_train": len(prose_train), "docs_test": len(prose_test),
                  "bytes_train": nbytes(prose_train), "bytes_test": nbytes(prose_test),
                  "test_docs": [d for d, _ in prose_test]},
    }
    for m in ("code", "prose"):
        s = corpus_stats[m]
        log(f"{m}: {s['docs_train']} train docs ({s['bytes_train']:,} B), {s['docs_test']} test docs "
            f"({s['bytes_test']:,} B)")

    # 2. tokenizer (training split only)
    tok = train_tokenizer([t for _, t in code_train] + [t for _, t in prose_train], args.vocab_size)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    log(f"tokenizer: vocab {vocab}, bos={bos_id} eos={eos_id}, sha256 "
        f"{hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]}")

    # 3. token streams
    def stream_of(docs):
        encs = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
        ids = []
        for e in encs:
            ids.append(bos_id)
            ids.extend(e.ids)
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.int32)

    streams = {"code": (stream_of(code_train), stream_of(code_test)),
               "prose": (stream_of(prose_train), stream_of(prose_test))}
    for m, (tr, te) in streams.items():
        corpus_stats[m]["tokens_train"] = len(tr)
        corpus_stats[m]["tokens_test"] = len(te)
        log(f"{m}: {len(tr):,} train tokens, {len(te):,} test tokens "
            f"({corpus_stats[m]['bytes_train'] / len(tr):.2f} bytes/token)")
    byte_lens = token_byte_lengths(tok)

    # 4. model
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, hidden_act="silu",
        attention_bias=False, mlp_bias=False, use_cache=True,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"model: {n_params:,} parameters ({n_params - n_emb:,} non-embedding)")

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=False, foreach=True)

    fwd = model
    if args.compile:
        fwd = torch.compile(model)  # same parameters; eval/generation below use the eager module

    gen = torch.Generator().manual_seed(args.seed)
    half = args.batch_size // 2
    L = args.seq_len

    def batch():
        rows = []
        for m, k in (("code", half), ("prose", args.batch_size - half)):
            tr = streams[m][0]
            starts = torch.randint(0, len(tr) - L - 1, (k,), generator=gen)
            rows.extend(tr[s: s + L + 1] for s in starts.tolist())
        return torch.stack(rows).long()

    n_steps = args.bench_steps or args.steps
    history = []
    log(f"training: {n_steps} steps x {args.batch_size} x {L} = {n_steps * args.batch_size * L:,} tokens, "
        f"{args.threads} threads")
    t_train = time.time()
    ema = None
    pbar = tqdm(range(n_steps), desc="train", mininterval=20, file=sys.stdout, dynamic_ncols=False, ncols=110)
    for step in pbar:
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch()
        logits = fwd(input_ids=x[:, :-1]).logits
        tok_loss = F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="none").view(len(x), -1)
        loss = tok_loss.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        lc, lp = tok_loss[:half].mean().item(), tok_loss[half:].mean().item()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        el = time.time() - t_train
        tps = (step + 1) * args.batch_size * L / el
        pbar.set_postfix_str(f"loss {ema:.3f} lr {lr:.2e} {tps:.0f} tok/s")
        rec = {"step": step + 1, "loss": round(loss.item(), 4), "loss_code": round(lc, 4),
               "loss_prose": round(lp, 4), "lr": lr, "grad_norm": round(gnorm, 3), "elapsed_s": round(el, 1)}
        if (step + 1) % 50 == 0 or step == 0:
            log(f"step {step + 1}/{n_steps} loss {loss.item():.3f} (code {lc:.3f} prose {lp:.3f}) "
                f"ema {ema:.3f} lr {lr:.2e} gnorm {gnorm:.2f} {tps:.0f} tok/s")
        if not args.bench_steps and args.eval_every and ((step + 1) % args.eval_every == 0) and step + 1 < n_steps:
            ev = {m: evaluate(model, streams[m][1], L, args.eval_chunks, byte_lens, torch) for m in streams}
            rec["eval"] = {m: round(v["loss"], 4) for m, v in ev.items()}
            log(f"eval @ {step + 1}: " + ", ".join(f"{m} loss {v['loss']:.3f} ppl {v['ppl']:.2f}" for m, v in ev.items()))
        history.append(rec)
    pbar.close()
    train_s = time.time() - t_train
    tokens_seen = n_steps * args.batch_size * L
    log(f"training done: {train_s:.1f}s, {tokens_seen / train_s:.0f} tok/s")
    if args.bench_steps:
        print(json.dumps({"bench_steps": n_steps, "train_s": train_s, "tok_per_s": tokens_seen / train_s,
                          "s_per_step": train_s / n_steps, "params": n_params}))
        return 0

    # 5a. held-out perplexity of the fp32 model
    max_chunks = args.final_eval_max_tokens // L if args.final_eval_max_tokens else 0
    t_eval = time.time()
    del fwd
    final_fp32 = {m: evaluate(model, streams[m][1], L, args.fp32_eval_chunks, byte_lens, torch) for m in streams}
    for m, v in final_fp32.items():
        log(f"held-out {m} subset (fp32 weights): {v['tokens']:,} tokens, loss {v['loss']:.4f}, ppl {v['ppl']:.3f}")

    # 5b. save (bf16 weights), tokenizer, generation config
    os.makedirs(args.out_dir, exist_ok=True)
    for fn in os.listdir(args.out_dir):
        os.remove(os.path.join(args.out_dir, fn))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                     model_max_length=args.max_pos, clean_up_tokenization_spaces=False)
    hf_tok.save_pretrained(args.out_dir)
    # name the generic fast-tokenizer class (also understood by transformers 4.x)
    tc_path = os.path.join(args.out_dir, "tokenizer_config.json")
    with open(tc_path, encoding="utf-8") as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tc_path, "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2)
        f.write("\n")
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                                               do_sample=False)
    model.to(torch.bfloat16).save_pretrained(args.out_dir, safe_serialization=True)
    model.to(torch.float32)
    sizes = {fn: os.path.getsize(os.path.join(args.out_dir, fn)) for fn in sorted(os.listdir(args.out_dir))}
    log(f"saved to {args.out_dir}: {sizes} (total {sum(sizes.values()) / 1e6:.2f} MB)")

    # 5c. reload the shipped directory and check it
    del model
    rtok = AutoTokenizer.from_pretrained(args.out_dir)
    rmodel = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    rmodel.eval()
    assert rtok.bos_token_id == bos_id == rmodel.config.bos_token_id == rmodel.generation_config.bos_token_id
    assert rtok.eos_token_id == eos_id == rmodel.config.eos_token_id == rmodel.generation_config.eos_token_id
    for sample in (code_test[0][1][:2000], prose_test[0][1][:2000]):
        ids = rtok(sample)["input_ids"]
        assert ids[0] == bos_id and ids[1:] == tok.encode(sample, add_special_tokens=False).ids
        assert rtok.decode(ids, skip_special_tokens=True) == sample, "tokenizer round-trip failed"
    log(f"reloaded {type(rtok).__name__} + {type(rmodel).__name__}; tokenizer round-trip ok")
    shipped_subset = {m: evaluate(rmodel, streams[m][1], L, args.fp32_eval_chunks, byte_lens, torch) for m in streams}
    for m, v in shipped_subset.items():
        log(f"held-out {m} subset (shipped bf16 weights): {v['tokens']:,} tokens, loss {v['loss']:.4f}, "
            f"ppl {v['ppl']:.3f}")
    final_shipped = {m: evaluate(rmodel, streams[m][1], L, max_chunks, byte_lens, torch) for m in streams}
    for m, v in final_shipped.items():
        log(f"held-out {m} (shipped bf16 weights, fp32 compute): {v['tokens']:,} tokens, loss {v['loss']:.4f}, "
            f"ppl {v['ppl']:.3f}, {v['bits_per_byte']:.3f} bits/byte")
    eval_s = time.time() - t_eval

    # 5d. prompt sets
    prng = random.Random(args.seed)
    lo, hi = args.prompt_min_tokens, args.prompt_max_tokens
    prompt_sets = {
        "code": make_code_prompts(code_test, tok, args.n_test_prompts, prng, lo, hi),
        "prose": make_prose_prompts(prose_test, tok, args.n_test_prompts, prng, lo, hi),
        "train_code": make_code_prompts(code_train, tok, args.n_train_prompts, prng, lo, hi),
        "train_prose": make_prose_prompts(prose_train, tok, args.n_train_prompts, prng, lo, hi),
    }
    prompt_stats = {}
    for name, ps in prompt_sets.items():
        path = os.path.join(args.prompts_dir, f"{name}.jsonl")
        write_jsonl(path, ps)
        lens = [len(tok.encode(p, add_special_tokens=False).ids) for p in ps]
        prompt_stats[name] = {"n": len(ps), "min_tokens": min(lens), "max_tokens": max(lens),
                              "mean_tokens": round(sum(lens) / len(lens), 1), "bytes": os.path.getsize(path)}
        log(f"prompts {path}: {prompt_stats[name]}")

    # 5e. sample greedy continuations from the reloaded model
    samples = {}
    for m in ("code", "prose"):
        samples[m] = [{"prompt": p, "greedy": greedy(rmodel, rtok, p, args.sample_new_tokens, torch)}
                      for p in prompt_sets[m][:3]]
        for s in samples[m]:
            log(f"sample [{m}] {s['prompt']!r} -> {s['greedy']!r}")

    summary = {
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "args": vars(args),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__, "python": sys.version.split()[0]},
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "platform": sys.platform},
        "corpora": corpus_stats,
        "tokenizer": {"vocab_size": vocab, "bos": BOS, "bos_id": bos_id, "eos": EOS, "eos_id": eos_id},
        "model": {"params": n_params, "non_embedding_params": n_params - n_emb, "config": config.to_diff_dict()},
        "training": {"steps": n_steps, "batch_size": args.batch_size, "seq_len": L, "tokens_seen": tokens_seen,
                     "train_s": round(train_s, 1), "tok_per_s": round(tokens_seen / train_s, 1),
                     "final_train_loss_ema": round(ema, 4)},
        "heldout_subset_fp32": final_fp32,
        "heldout_subset_shipped": shipped_subset,
        "heldout_shipped": final_shipped,
        "eval_and_save_s": round(eval_s, 1),
        "saved_files": sizes,
        "prompts": prompt_stats,
        "samples": samples,
        "total_wall_s": round(time.time() - t_start, 1),
        "history": history,
    }
    with open(args.summary, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    log(f"summary written to {args.summary}; total wall {summary['total_wall_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
