"""Adapter costs: time to fingerprint a target, and adapter sizes on disk.

1. Fingerprint time (``heads.backbone.target_fingerprint``: config hash + a 1024-element strided
   sample of every tensor): on a Llama with 7B's tensor count (32 layers x 9 tensors + 3) but
   small tensors (per-tensor overhead), on a ~110M random Llama (``LLAMA_110M``), and per
   tensor on one 7B-sized MLP matrix (4096 x 11008, bf16: the cost of sampling a large tensor).
   The 7B estimate is 291 tensors x the per-tensor cost on large tensors. For contrast, sha256
   over every byte of the 110M model (what hashing whole weights would cost).
2. Adapter sizes on disk (bf16): Medusa with 4 heads, copied output heads vs shared, and the
   EAGLE drafter (plain and EAGLE-3 style), on the shipped target benchmarks/targets/demo-llama
   when its model.safetensors exists, else on the ~110M random Llama (the JSON says which).

Writes ``adapter.json`` beside this script and prints tables::

    python -m benchmarks.studies.adapter_costs.bench_adapter
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import heads
from benchmarks.studies.common import TARGET as DEMO_TARGET
from benchmarks.studies.common import median_seconds, table, write_json
from heads.backbone import _strided_sample, target_fingerprint

HERE = Path(__file__).resolve().parent
LLAMA_110M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12)
SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, vocab_size=32000)
SAMPLES = 1024
SMALL_TENSORS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                     num_attention_heads=4, num_key_value_heads=4)


def seven_b_tensor_count() -> int:
    return SEVEN_B["num_hidden_layers"] * 9 + 3  # q k v o gate up down + 2 norms per layer; embed, norm, head


def random_llama(**sizes) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, **sizes)).eval()


def fingerprint_times(repeats: int) -> dict:
    """Seconds for target_fingerprint on the two random models, and per tensor on a 7B matrix."""
    results = {}
    many = random_llama(**SMALL_TENSORS)
    assert len(many.state_dict()) == seven_b_tensor_count(), len(many.state_dict())
    results["7B-tensor-count, small tensors"] = {
        "tensors": len(many.state_dict()), "parameters": sum(p.numel() for p in many.parameters()),
        "seconds": median_seconds(lambda: target_fingerprint(many), repeats), "sizes": SMALL_TENSORS,
    }
    base = random_llama(**LLAMA_110M)
    results["llama-110M"] = {
        "tensors": len(base.state_dict()), "parameters": sum(p.numel() for p in base.parameters()),
        "seconds": median_seconds(lambda: target_fingerprint(base), repeats),
    }
    state = base.state_dict()
    full = median_seconds(lambda: [hashlib.sha256(t.numpy().tobytes()).digest() for t in state.values()], 1, 0)
    results["llama-110M"]["full_sha256_seconds"] = full
    results["llama-110M"]["full_sha256_ms"] = 1000 * full
    matrix = torch.randn(SEVEN_B["intermediate_size"], SEVEN_B["hidden_size"]).to(torch.bfloat16)
    per_tensor = median_seconds(lambda: _strided_sample(matrix, SAMPLES), repeats * 20)
    transposed = matrix.t()  # non-contiguous: an index gather, never a flattened copy
    per_tensor_strided = median_seconds(lambda: _strided_sample(transposed, SAMPLES), repeats * 20)
    results["7B MLP matrix (4096 x 11008 bf16)"] = {
        "seconds_per_tensor": per_tensor, "seconds_per_tensor_non_contiguous": per_tensor_strided,
        "us_per_tensor": 1e6 * per_tensor, "us_per_tensor_non_contiguous": 1e6 * per_tensor_strided,
        "bytes": matrix.numel() * 2,
    }
    for row in results.values():
        if "seconds" in row:
            row["ms"] = 1000 * row["seconds"]
            row["us_per_tensor"] = 1e6 * row["seconds"] / row["tensors"]
    return results


def estimate_seven_b(times: dict) -> dict:
    """7B fingerprint time from the measurements: tensor count x per-tensor cost."""
    count = seven_b_tensor_count()
    small = times["7B-tensor-count, small tensors"]["seconds"]
    large = times["7B MLP matrix (4096 x 11008 bf16)"]["seconds_per_tensor"]
    per_tensor_110m = times["llama-110M"]["seconds"] / times["llama-110M"]["tensors"]
    estimate = count * max(large, per_tensor_110m, small / count)
    touched = count * SAMPLES * 64  # one 64-byte cache line per sampled element at most
    return {"tensors": count, "estimate_seconds": estimate, "bytes_touched_at_most": touched,
            "goal_seconds": 2.0, "meets_goal": estimate < 2.0}


def size_target() -> tuple[object, str]:
    if (DEMO_TARGET / "model.safetensors").is_file():
        return AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.bfloat16).eval(), str(DEMO_TARGET)
    model = random_llama(**LLAMA_110M)
    return model.to(torch.bfloat16), f"random llama-110M ({DEMO_TARGET / 'model.safetensors'} not found)"


def adapter_sizes(model) -> list[dict]:
    """Bytes on disk of each adapter variant (safetensors + config)."""
    layers = model.config.num_hidden_layers
    variants = {
        "medusa K=4, copied output heads": dict(kind="medusa", num_heads=4),
        "medusa K=4, shared output head": dict(kind="medusa", num_heads=4, share_lm_head=True),
        "eagle (1 layer)": dict(kind="eagle"),
        "eagle-3 style (3 fused layers, 8192-token draft vocab)": dict(
            kind="eagle", feature_layers=[2, layers // 2, layers - 1], draft_vocab_size=8192),
    }
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, options in variants.items():
            spec = heads.attach_heads(model, **options)
            directory = Path(scratch) / name.replace(" ", "_")
            spec.save_pretrained(directory)
            weights = (directory / "adapter_model.safetensors").stat().st_size
            config = (directory / "adapter_config.json").stat().st_size
            parameters = sum(t.numel() for t in spec.heads.state_dict().values())
            rows.append({"adapter": name, "MB": (weights + config) / 1e6, "weights_bytes": weights,
                         "config_bytes": config, "parameters": parameters})
            del spec
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times = fingerprint_times(args.repeats)
    estimate = estimate_seven_b(times)
    model, target = size_target()
    sizes = adapter_sizes(model)
    print("fingerprint time:")
    print(table([{"model": name, **row} for name, row in times.items()],
                ["model", "tensors", "ms", "us_per_tensor", "us_per_tensor_non_contiguous", "full_sha256_ms"]))
    print(f"\n7B estimate: {estimate['tensors']} tensors x per-tensor cost = {estimate['estimate_seconds']:.3f} s "
          f"(goal < 2 s: {estimate['meets_goal']}); at most {estimate['bytes_touched_at_most'] / 1e6:.1f} MB touched")
    print(f"\nadapter sizes on disk (bf16) on {target}:")
    print(table(sizes, ["adapter", "MB", "parameters"]))
    path = write_json("adapter.json", {"threads": args.threads, "samples_per_tensor": SAMPLES,
                                       "fingerprint": times, "seven_b": estimate,
                                       "size_target": target, "sizes": sizes}, HERE)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
