"""EAGLE's training recipe on the shipped pretrained targets: which ingredient sets its acceptance.

Each *variant* trains a drafter from scratch on the same data as ``selfdraft train`` (the target's
greedy continuations of the training prompts, batch 8, the CLI's defaults unless the variant says
otherwise) and is measured on held-out prompts:

* ``heldout_top1`` / ``heldout_top4`` per depth ``j``: teacher-forced accuracy on the target's own
  continuations of held-out prompts (only positions decoding drafts at: origin ``t`` at or after the
  last prompt token). Depth 1 is exactly what a top-1 chain accepts at depth 1 (its root is the
  target's token, its context the committed features). EAGLE drafts deeper steps on its own
  predicted features; Medusa head ``j`` reads ``f_t`` alone.
* ``decode``: ``spec.generate`` on held-out prompts (greedy, 64 tokens, no plain run): tau and
  acceptance by depth with the kind's default tree, a top-1 chain of 4 (both kinds) and, for EAGLE,
  a 16-node tree of top_k 4 (Medusa's default tree also holds 16 nodes).

Variants change one ingredient each (``VARIANTS`` in ``eagle_recipe_variants.py``), starting from
``BEFORE``, the recipe ``selfdraft train`` used before issue 13; ``init`` is applied after
``attach_heads`` so that every initialisation can be reproduced whatever the library's default,
and the least-squares start of the projection (:meth:`heads.eagle.loss.EagleLoss.fit_projection`)
runs only for variants with ``fit``. ``after`` is the command line's recipe since issue 13. Results
merge into ``eagle_recipe.json`` beside this script under ``runs[target][variant][seed]``, so runs can be split;
``--speed`` times saved adapters against ``model.generate`` instead (``speed[target/mix][method]``).

Run (2-core CPU: one thread, a minute or two per variant on stories260K)::

    OMP_NUM_THREADS=1 nice -n 10 python -m benchmarks.studies.eagle_recipe.bench_eagle_recipe --target stories \\
        --variants medusa,before,after --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import heads
from benchmarks.studies.common import PROMPTS, RESULTS, mixed_training_file, table, write_json
from benchmarks.studies.eagle_recipe.variants import (BEFORE, VARIANTS, apply_variant, scaled_learning_rates,
                                                      use_prenorm_input)
from heads.backbone import target_fingerprint
from training.commands.common import load_model, read_prompts
from training.distill_data import generate_distillation_data
from training.evaluate import encode_prompts, measure
from training.prompts import tokenize_prompts, tokenizer_pad_id
from training.sequences import collate
from training.trainer import TrainConfig, make_trainer

HERE = Path(__file__).resolve().parent
TARGETS = {
    # the budgets of the shipped stories260K and demo-llama adapters
    "stories": dict(model=RESULTS.parent / "targets" / "stories260K", data=PROMPTS / "stories_train.jsonl",
                    max_prompts=200, max_new_tokens=96, steps=300, eval=("stories",)),
    "demo": dict(model=RESULTS.parent / "targets" / "demo-llama", data=None, max_prompts=192,
                 max_new_tokens=128, steps=150, eval=("code", "prose")),
}
MAX_LENGTH = 256  # the CLI's --max-length
HELD_OUT_PROMPTS = 48  # teacher-forced accuracy: prompts per eval file, continued for 64 tokens
DECODE_PROMPTS = 8  # as the CLI's final evaluation (--eval-prompts)
DECODE_TOKENS = 64
CHAIN = {"eagle": {"depth": 4, "top_k": 1, "total_tokens": 4}, "medusa": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}
WIDE = {"depth": 4, "top_k": 4, "total_tokens": 16}


def training_sequences(name: str, model, tokenizer, cache_dir: Path) -> list[torch.Tensor]:
    """The sequences ``selfdraft train`` trains on for this target (same settings, same cache key)."""
    spec = TARGETS[name]
    data = spec["data"] or mixed_training_file(cache_dir / "train_mixed.jsonl", spec["max_prompts"] // 2)
    prompts = read_prompts(str(data), tokenizer)[: spec["max_prompts"]]
    sequences = generate_distillation_data(
        model, tokenizer, prompts, max_new_tokens=spec["max_new_tokens"], temperature=0.0, seed=0,
        cache_dir=cache_dir, target_id=target_fingerprint(model)["weights_sha256"], batch_size=8,
        max_prompt_tokens=max(1, MAX_LENGTH - spec["max_new_tokens"]), truncate=True)
    return [sequence[:MAX_LENGTH] for sequence in sequences if sequence.numel() > 2]


def held_out(name: str, model, tokenizer, cache_dir: Path) -> dict:
    """Per eval file: held-out sequences (prompt + the target's 64 greedy tokens), their prompt
    lengths, and the decode prompts ``[1, L]``."""
    sets = {}
    for stem in TARGETS[name]["eval"]:
        texts = read_prompts(str(PROMPTS / f"{stem}.jsonl"), tokenizer)
        chosen = texts[DECODE_PROMPTS:DECODE_PROMPTS + HELD_OUT_PROMPTS]  # not the decode prompts
        sequences = generate_distillation_data(
            model, tokenizer, chosen, max_new_tokens=DECODE_TOKENS, temperature=0.0, seed=0, cache_dir=cache_dir,
            target_id=target_fingerprint(model)["weights_sha256"], batch_size=8, max_prompt_tokens=128,
            truncate=True)
        lengths = [ids.numel() for ids in tokenize_prompts(tokenizer, chosen, 128, truncate=True)]
        sets[stem] = dict(sequences=sequences, prompt_lengths=lengths,
                          prompts=encode_prompts(tokenizer, texts, DECODE_PROMPTS))
    return sets



# ---- measurements ----

@torch.no_grad()
def heldout_accuracy(spec, sets: dict, pad_id: int, depth: int = 3, hook=None) -> dict:
    """Teacher-forced top-1 / top-4 accuracy per depth on the held-out continuations."""
    target, drafter = spec.target, spec.heads
    results = {}
    for stem, data in sets.items():
        hits = torch.zeros(2, depth)
        total = torch.zeros(depth)
        sequences, lengths = data["sequences"], data["prompt_lengths"]
        for start in range(0, len(sequences), 8):
            ids, mask = collate(sequences[start:start + 8], pad_id)
            if hook is not None and hasattr(hook, "_targets"):
                top, inputs, teacher_logits, embeddings = hook._targets(ids, mask)
            else:
                top = inputs = target.features(ids, None, mask, None)
                teacher_logits, embeddings = target.logits(top).float(), target.input_embeddings(ids)
            teacher = teacher_logits.argmax(-1)
            length = ids.shape[1]
            origins = torch.arange(length)[None, :]
            after_prompt = origins >= torch.tensor(lengths[start:start + 8])[:, None] - 1  # (B, T)
            if spec.kind == "eagle":
                rows = drafter.draft_rows(target)
                predictions = drafter(inputs, embeddings, depth)
                logits = [target.logits(p, rows) for p in predictions]
            else:
                logits = list(drafter(top, target.logits, count=depth))
            for index in range(depth):
                shift = index + 1
                valid = (after_prompt[:, :length - shift] & mask[:, shift:].bool())
                ranked = logits[index][:, :length - shift].topk(4, dim=-1).indices
                if spec.kind == "eagle":
                    ranked = drafter.target_ids(ranked)
                match = ranked == teacher[:, shift:, None]
                hits[0, index] += match[..., 0][valid].float().sum()
                hits[1, index] += match.any(-1)[valid].float().sum()
                total[index] += valid.sum()
        results[stem] = {"top1": (hits[0] / total).tolist(), "top4": (hits[1] / total).tolist(),
                         "positions": int(total[0])}
    return results


def decode(spec, sets: dict) -> dict:
    trees = {"default": None, "chain4": CHAIN[spec.kind]}
    if spec.kind == "eagle":
        trees["wide16"] = WIDE
    results = {}
    for stem, data in sets.items():
        for tree_name, tree in trees.items():
            spec.set_tree(tree)
            report = measure(spec, data["prompts"], DECODE_TOKENS, plain=False)
            results[f"{stem}/{tree_name}"] = {"tau": report.tau, "acceptance": report.acceptance_by_position,
                                              "draft_seconds": report.draft_seconds,
                                              "verify_seconds": report.verify_seconds}
        spec.set_tree(None)
    return results


def parse_tree(text: str | None):
    """``depth:top_k:total`` (EAGLE) or a node count (Medusa); None: the adapter's own."""
    if not text:
        return None
    parts = [int(part) for part in text.split(":")]
    return dict(zip(("depth", "top_k", "total_tokens"), parts)) if len(parts) == 3 else parts[0]


@torch.no_grad()
def speed(model, adapters: dict, prompts: list, rounds: int = 2) -> list[dict]:
    """Wall clock of ``spec.generate`` per adapter against ``model.generate`` (greedy, batch 1,
    ``DECODE_TOKENS`` each), all in one process, methods in rotating order per prompt and round.
    Per method: median over prompts of plain time / method time, tau, acceptance by depth and the
    loop's per-phase seconds per step (``DecodeStats.phases``)."""
    specs = {}
    for name, (directory, tree) in adapters.items():
        spec = heads.load_heads(model, directory)
        spec.set_tree(parse_tree(tree))
        spec.generate(prompts[0], max_new_tokens=8)  # warm-up
        specs[name] = spec
    model.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), do_sample=False, max_new_tokens=8)
    methods = ["generate", *specs]
    times = {name: [] for name in methods}
    phases = {name: {} for name in specs}
    steps = dict.fromkeys(specs, 0)
    accepted = {name: [] for name in specs}
    for index in range(rounds * len(prompts)):
        prompt = prompts[index % len(prompts)]
        order = methods[index % len(methods):] + methods[:index % len(methods)]
        for name in order:
            started = time.perf_counter()
            if name == "generate":
                output = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                        max_new_tokens=DECODE_TOKENS)
            else:
                output = specs[name].generate(prompt, max_new_tokens=DECODE_TOKENS)
            times[name].append(time.perf_counter() - started)
            if name != "generate":
                stats = specs[name].last_stats
                for phase, seconds in stats.phases.items():
                    phases[name][phase] = phases[name].get(phase, 0.0) + seconds
                steps[name] += stats.target_forwards - 1
                accepted[name].append((stats.new_tokens, stats.target_forwards, stats.acceptance_by_position,
                                       len(stats.accepted_lengths)))
            else:
                reference = output
        del reference
    rows = []
    plain = times["generate"]
    for name in specs:
        ratios = sorted(p / t for p, t in zip(plain, times[name]))
        tokens = sum(a[0] for a in accepted[name])
        forwards = sum(a[1] for a in accepted[name])
        depth = max(len(a[2]) for a in accepted[name])
        total_steps = sum(a[3] for a in accepted[name])
        acceptance = [sum(a[3] * (a[2][i] if i < len(a[2]) else 0.0) for a in accepted[name]) / total_steps
                      for i in range(depth)]
        per_step = {phase: 1000 * seconds / max(1, steps[name]) for phase, seconds in phases[name].items()}
        rows.append({"method": name, "adapter": str(adapters[name][0]), "tree": adapters[name][1] or "adapter's",
                     "speedup": ratios[len(ratios) // 2], "tau": tokens / forwards, "acceptance_by_depth": acceptance,
                     "draft ms/step": per_step.get("draft", 0.0) + per_step.get("tree", 0.0),
                     "forward ms/step": per_step.get("forward", 0.0),
                     "other ms/step": sum(v for k, v in per_step.items() if k not in ("draft", "tree", "forward")),
                     "plain ms/token": 1000 * sum(plain) / (len(plain) * DECODE_TOKENS), "phases ms/step": per_step})
    return rows


def evaluate_adapter(name: str, directory: str, model, tokenizer, sets) -> dict:
    """An adapter trained elsewhere (e.g. by ``selfdraft train``), measured as the variants are."""
    spec = heads.load_heads(model, directory)
    summary = Path(str(directory).rstrip("/") + ".json")
    row = {"variant": name, "adapter": str(directory), "final_loss": float("nan"), "seed": "-",
           "heldout": heldout_accuracy(spec, sets, tokenizer_pad_id(tokenizer)), "decode": decode(spec, sets)}
    if summary.is_file():
        row["training_summary"] = {k: v for k, v in json.loads(summary.read_text()).items()
                                   if k not in ("losses", "agreement")}
    return row


def run_variant(name: str, variant: dict, model, tokenizer, sequences, sets, seed: int, steps: int,
                save_dir: str | None = None) -> dict:
    kind = variant.get("kind", "eagle")
    torch.manual_seed(seed)  # as the CLI seeds before attach_heads
    spec = heads.attach_heads(model, kind=kind, **variant.get("options", {}))
    if kind == "eagle":
        apply_variant(spec, variant, model, sequences, tokenizer_pad_id(tokenizer))
    recipe = {**BEFORE[kind], **variant.get("train", {})}
    config = TrainConfig(steps=variant.get("steps", steps), seed=seed, **recipe)
    trainer = make_trainer(spec, sequences, config, pad_id=tokenizer_pad_id(tokenizer), progress=False)
    if kind == "eagle" and not variant.get("fit"):
        trainer.hook.fit_projection = lambda: None  # the start before issue 13 (or the variant's own init)
    elif kind == "eagle" and variant.get("eval_before"):
        trainer.hook.fit_projection()  # what train() starts from (train() fits again, identically)
    before = heldout_accuracy(spec, sets, tokenizer_pad_id(tokenizer)) if variant.get("eval_before") else None
    handle = use_prenorm_input(trainer.hook, model) if variant.get("prenorm_input") else None
    with scaled_learning_rates(spec.heads, variant.get("lr_scale")):
        result = trainer.train()
    row = {"variant": name, "seed": seed, "steps": config.steps, "train_seconds": result.seconds,
           "final_loss": result.losses[-1], "loss_at": {str(s): result.losses[s - 1] for s in (1, 50, 100, 200, 300)
                                                      if s <= len(result.losses)},
           "validation_top1": [r[0] for r in result.accuracy],
           "heldout": heldout_accuracy(spec, sets, tokenizer_pad_id(tokenizer),
                                       hook=trainer.hook if variant.get("prenorm_input") else None)}
    if before is not None:
        row["heldout_before_training"] = before
    if save_dir is not None and handle is None and not variant.get("own_head") and not variant.get("mha"):
        spec.save_pretrained(Path(save_dir) / f"{name}-seed{seed}")
    if handle is None:
        row["decode"] = decode(spec, sets)
    else:
        handle.remove()
    return row


def record(name: str, keys: tuple[str, ...], value) -> None:
    """Set ``payload[k1][k2]...`` of ``results/name`` to ``value``, re-reading the file first so that
    runs in parallel processes keep each other's results."""
    path = HERE / name
    payload = json.loads(path.read_text()) if path.is_file() else {}
    payload.pop("machine", None)
    payload["definitions"] = __doc__
    node = payload
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    write_json(name, payload, HERE)


def run_speed(args, model, tokenizer) -> None:
    adapters = {}
    for item in args.speed.split(","):
        name, _, rest = item.partition("=")
        directory, _, tree = rest.partition("@")
        adapters[name] = (directory, tree or None)
    for stem in TARGETS[args.target]["eval"]:
        prompts = encode_prompts(tokenizer, read_prompts(str(PROMPTS / f"{stem}.jsonl"), tokenizer), DECODE_PROMPTS)
        rows = speed(model, adapters, prompts, args.rounds)
        key = f"{args.target}/{stem}"
        for row in rows:
            record(args.out, ("speed", key, row["method"]), row)
        print(key)
        print(table(rows, ["method", "tree", "speedup", "tau", "acceptance_by_depth", "draft ms/step",
                           "forward ms/step", "other ms/step", "plain ms/token"]), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=tuple(TARGETS), default="stories")
    parser.add_argument("--variants", default="medusa,before,after", help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--steps", type=int, default=None, help="default: the target's budget (300 / 150)")
    parser.add_argument("--cache-dir", default=str(RESULTS / "cache"), help="distillation data cache")
    parser.add_argument("--out", default="eagle_recipe.json")
    parser.add_argument("--speed", default=None,
                        help="instead of training: time adapters, NAME=DIR[@TREE] comma-separated (TREE: "
                             "depth:top_k:total for EAGLE, a node count for Medusa)")
    parser.add_argument("--rounds", type=int, default=2, help="--speed: passes over the decode prompts")
    parser.add_argument("--save", default=None, help="save each trained drafter as DIR/VARIANT-seedS")
    parser.add_argument("--adapters", default=None,
                        help="also measure adapters trained elsewhere, NAME=DIR comma-separated (no training)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    spec = TARGETS[args.target]
    steps = args.steps or spec["steps"]
    model, tokenizer = load_model(str(spec["model"]))
    if args.speed:
        run_speed(args, model, tokenizer)
        return
    cache_dir = Path(args.cache_dir)
    sequences = training_sequences(args.target, model, tokenizer, cache_dir)
    sets = held_out(args.target, model, tokenizer, cache_dir)
    for item in (args.adapters or "").split(","):
        if item:
            name, _, directory = item.partition("=")
            row = evaluate_adapter(name, directory, model, tokenizer, sets)
            record(args.out, ("runs", args.target, name, "-"), row)
            print(name, json.dumps(row["heldout"]), flush=True)
    for name in names:
        for seed in (int(s) for s in args.seeds.split(",")):
            started = time.perf_counter()
            row = run_variant(name, VARIANTS[name], model, tokenizer, sequences, sets, seed, steps, args.save)
            row["seconds"] = time.perf_counter() - started
            record(args.out, ("runs", args.target, name, str(seed)), row)
            stem = spec["eval"][0]
            decoded = row.get("decode", {})
            print(table([{"variant": name, "seed": seed, "loss": row["final_loss"],
                          "top1": row["heldout"][stem]["top1"], "top4": row["heldout"][stem]["top4"],
                          "chain": decoded.get(f"{stem}/chain4", {}).get("acceptance", []),
                          "default": decoded.get(f"{stem}/default", {}).get("acceptance", []),
                          "s": row["seconds"]}],
                        ["variant", "seed", "loss", "top1", "top4", "chain", "default", "s"]), flush=True)


if __name__ == "__main__":
    main()
