"""Convert a llama2.c checkpoint and tokenizer into a Hugging Face ``LlamaForCausalLM`` folder.

Checkpoint formats (all little-endian, float32 weights):

* legacy (version 0): a 28-byte header of 7 int32 ``dim, hidden_dim, n_layers, n_heads,
  n_kv_heads, vocab_size, seq_len`` (a negative ``vocab_size`` means an unshared classifier), then
  ``token_embedding[V, D], rms_att[L, D], wq[L, D, D], wk[L, KV, D], wv[L, KV, D], wo[L, D, D],
  rms_ffn[L, D], w1[L, H, D], w2[L, D, H], w3[L, H, D], rms_final[D], freq_cis_real[S, hd/2],
  freq_cis_imag[S, hd/2]`` and, when unshared, ``wcls[V, D]``.  ``KV = n_kv_heads * hd`` and
  ``hd = D / n_heads``.
* version 1: uint32 magic ``0x616b3432`` ("ak42"), int32 version 1, the same 7 int32, a uint8
  shared-classifier flag, zero padding to 256 bytes, then ``rms_att, rms_ffn, rms_final,
  token_embedding, wq, wk, wv, wo, w1, w2, w3`` and ``wcls`` when unshared (no RoPE tables).
* version 2 (int8 "Q8_0") is refused with a ValueError.

llama2.c rotates interleaved pairs ``(x[2i], x[2i+1])`` with RoPE while HF Llama rotates the two
halves of each head, so the rows of ``wq`` and ``wk`` are permuted per head (the permutation of
transformers' ``convert_llama_weights_to_hf``).

The tokenizer file (``tok512.bin`` and the like) holds int32 ``max_token_length`` then, per vocab
entry, float32 score, int32 byte length and the UTF-8 bytes.  It becomes a ``tokenizers`` byte-fallback
BPE whose merges are ranked by the merged piece's score, which reproduces llama2.c's ``encode``.
"""

from __future__ import annotations

import argparse
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

MAGIC = 0x616B3432
LEGACY_HEADER_BYTES = 28
V1_HEADER_BYTES = 256
SPACE_PIECE = "\u2581"  # SentencePiece's "▁", written as " " in llama2.c's tokenizer file
SPECIAL_PIECES = {0: "<unk>", 1: "<s>", 2: "</s>"}
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5


@dataclass(frozen=True)
class Llama2cConfig:
    """Hyper-parameters from a llama2.c checkpoint header."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    version: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every float32 array, in file order."""
        d, h, n, v, kv = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.kv_dim
        norms = [("rms_att", (n, d)), ("rms_ffn", (n, d)), ("rms_final", (d,))]
        matrices = [("wq", (n, d, d)), ("wk", (n, kv, d)), ("wv", (n, kv, d)), ("wo", (n, d, d))]
        ffn = [("w1", (n, h, d)), ("w2", (n, d, h)), ("w3", (n, h, d))]
        embedding = [("token_embedding", (v, d))]
        if self.version == 0:
            rope = [("freq_cis_real", (self.seq_len, self.head_dim // 2)),
                    ("freq_cis_imag", (self.seq_len, self.head_dim // 2))]
            shapes = embedding + norms[:1] + matrices + norms[1:2] + ffn + norms[2:] + rope
        else:
            shapes = norms + embedding + matrices + ffn
        if not self.shared_classifier:
            shapes.append(("wcls", (v, d)))
        return shapes


def _parse_header(path: Path, data: bytes) -> tuple[Llama2cConfig, int]:
    """Read the header; return the config and the byte offset where the weights begin."""
    if len(data) < LEGACY_HEADER_BYTES:
        raise ValueError(f"{path}: {len(data)} bytes is too short for a llama2.c checkpoint header "
                         f"(expected at least {LEGACY_HEADER_BYTES})")
    (first,) = struct.unpack_from("<I", data, 0)
    if first == MAGIC:
        if len(data) < V1_HEADER_BYTES:
            raise ValueError(f"{path}: magic 'ak42' found but the file has only {len(data)} bytes; "
                             f"expected a {V1_HEADER_BYTES}-byte header")
        (version,) = struct.unpack_from("<i", data, 4)
        if version != 1:
            raise ValueError(f"{path}: llama2.c checkpoint version {version} is not supported; expected "
                             f"the legacy format or version 1 (float32); version 2 is int8-quantized")
        fields = struct.unpack_from("<7i", data, 8)
        shared = bool(data[36])
        offset = V1_HEADER_BYTES
    else:
        fields = struct.unpack_from("<7i", data, 0)
        shared = fields[5] > 0
        version, offset = 0, LEGACY_HEADER_BYTES
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = fields
    config = Llama2cConfig(dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len, shared, version)
    positive = dict(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                    vocab_size=abs(vocab), seq_len=seq_len)
    bad = {name: value for name, value in positive.items() if not 0 < value <= 1 << 20}
    if bad or dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise ValueError(f"{path}: bad llama2.c header {positive}: expected positive sizes, dim divisible "
                         f"by n_heads into an even head size, and n_heads divisible by n_kv_heads")
    return config, offset


def read_checkpoint(path: str | Path) -> tuple[Llama2cConfig, dict[str, torch.Tensor]]:
    """Read a llama2.c checkpoint into float32 tensors named as in :meth:`Llama2cConfig.weight_shapes`.

    Raises ValueError naming the file when the header is malformed or the size does not match it.
    """
    path = Path(path)
    data = path.read_bytes()
    config, offset = _parse_header(path, data)
    shapes = config.weight_shapes()
    expected = offset + 4 * sum(int(np.prod(shape)) for _, shape in shapes)
    if len(data) != expected:
        kind = "truncated" if len(data) < expected else "longer than its header says"
        raise ValueError(f"{path}: checkpoint is {kind}: {len(data)} bytes, expected {expected} bytes for "
                         f"header {config} ({offset} header bytes + float32 weights)")
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        count = int(np.prod(shape))
        array = np.frombuffer(data, dtype="<f4", count=count, offset=offset)
        weights[name] = torch.from_numpy(array.copy()).reshape(shape)
        offset += 4 * count
    if not all(bool(torch.isfinite(tensor).all()) for tensor in weights.values()):
        raise ValueError(f"{path}: checkpoint holds non-finite weights; expected finite float32 values")
    if config.version == 0:
        _check_rope_tables(path, config, weights["freq_cis_real"], weights["freq_cis_imag"])
    return config, weights


def _check_rope_tables(path: Path, config: Llama2cConfig, real: torch.Tensor, imag: torch.Tensor) -> None:
    """Refuse a legacy file whose RoPE tables [S, hd/2] are not those of theta 10000."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), ROPE_THETA ** -exponents)
    error = max(float((real.double() - angles.cos()).abs().max()), float((imag.double() - angles.sin()).abs().max()))
    if error > 1e-3:
        raise ValueError(f"{path}: RoPE tables differ from theta={ROPE_THETA} by up to {error:.3g}; "
                         f"expected llama2.c's precompute_freqs_cis with theta {ROPE_THETA}")


def permute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection [n_heads * hd, D] from interleaved to half-split RoPE.

    Within each head, row ``2i`` goes to ``i`` and row ``2i + 1`` to ``hd/2 + i``.
    """
    rows, columns = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def hf_config(config: Llama2cConfig) -> LlamaConfig:
    """The ``LlamaConfig`` equivalent to a llama2.c config (ids: 0 <unk>, 1 <s>, 2 </s>)."""
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, max_position_embeddings=config.seq_len,
        rms_norm_eps=RMS_NORM_EPS, rope_theta=ROPE_THETA, hidden_act="silu", attention_bias=False,
        mlp_bias=False, tie_word_embeddings=config.shared_classifier, bos_token_id=1, eos_token_id=[2, 1],
        pad_token_id=0, dtype="float32",
    )


def hf_state_dict(config: Llama2cConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map llama2.c arrays to ``LlamaForCausalLM`` parameter names (q/k rows permuted for HF RoPE)."""
    state = {"model.embed_tokens.weight": weights["token_embedding"], "model.norm.weight": weights["rms_final"]}
    state["lm_head.weight"] = weights["token_embedding"] if config.shared_classifier else weights["wcls"]
    for layer in range(config.n_layers):
        prefix = f"model.layers.{layer}."
        state[prefix + "input_layernorm.weight"] = weights["rms_att"][layer]
        state[prefix + "post_attention_layernorm.weight"] = weights["rms_ffn"][layer]
        state[prefix + "self_attn.q_proj.weight"] = permute_rotary(weights["wq"][layer], config.n_heads)
        state[prefix + "self_attn.k_proj.weight"] = permute_rotary(weights["wk"][layer], config.n_kv_heads)
        state[prefix + "self_attn.v_proj.weight"] = weights["wv"][layer]
        state[prefix + "self_attn.o_proj.weight"] = weights["wo"][layer]
        state[prefix + "mlp.gate_proj.weight"] = weights["w1"][layer]
        state[prefix + "mlp.down_proj.weight"] = weights["w2"][layer]
        state[prefix + "mlp.up_proj.weight"] = weights["w3"][layer]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def build_model(config: Llama2cConfig, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A float32 ``LlamaForCausalLM`` in eval mode holding the checkpoint's weights exactly."""
    model = LlamaForCausalLM(hf_config(config)).to(torch.float32)
    state = hf_state_dict(config, weights)
    model.load_state_dict(state, strict=True)  # raises on any missing or unexpected name
    if config.shared_classifier:
        model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 1], pad_token_id=0)
    return model.eval()


def read_vocab(path: str | Path, vocab_size: int) -> list[tuple[str, float]]:
    """Read ``vocab_size`` (piece, score) pairs from a llama2.c tokenizer file.

    Pieces come back in SentencePiece spelling: " " becomes "▁", ids 0-2 become <unk>, <s>, </s>.
    """
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: {len(data)} bytes is too short for a llama2.c tokenizer "
                         f"(expected an int32 max_token_length header)")
    (max_length,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_length <= 1024:
        raise ValueError(f"{path}: bad tokenizer header: max_token_length {max_length}; expected 1..1024")
    offset, vocab = 4, []
    for index in range(vocab_size):
        if offset + 8 > len(data):
            raise ValueError(f"{path}: tokenizer truncated at entry {index}: expected {vocab_size} entries "
                             f"(float32 score, int32 length, bytes)")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if not 0 < length <= max_length or offset + length > len(data):
            raise ValueError(f"{path}: bad tokenizer entry {index}: length {length} (max_token_length "
                             f"{max_length}, {len(data) - offset} bytes left)")
        raw = data[offset:offset + length]
        offset += length
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: tokenizer entry {index} is not UTF-8: {raw!r}") from error
        vocab.append((SPECIAL_PIECES.get(index, piece.replace(" ", SPACE_PIECE)), float(score)))
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes left after {vocab_size} tokenizer entries; "
                         f"expected a vocabulary of exactly {vocab_size} (the checkpoint's vocab_size)")
    return vocab


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def bpe_merges(vocab: list[tuple[str, float]]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary pieces, ranked by the merged piece's score (highest first).

    Special and byte pieces are never merge results.  Ties keep vocabulary order, then split position.
    """
    index = {piece: position for position, (piece, _) in enumerate(vocab)}
    candidates = []
    for position, (piece, score) in enumerate(vocab):
        if position in SPECIAL_PIECES or _is_byte_piece(piece):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                candidates.append((-score, position, cut, left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def build_tokenizer(vocab: list[tuple[str, float]]) -> PreTrainedTokenizerFast:
    """A fast tokenizer equal to llama2.c's ``encode(text, bos=1, eos=0)`` and ``decode``.

    ``split_special_tokens=True``: like llama2.c, "<s>" in the text is the three characters, not BOS.
    """
    ids = {piece: position for position, (piece, _) in enumerate(vocab)}
    if len(ids) != len(vocab):
        raise ValueError("tokenizer vocabulary has duplicate pieces; expected unique pieces")
    missing = [f"<0x{byte:02X}>" for byte in range(256) if f"<0x{byte:02X}>" not in ids]
    if missing:
        raise ValueError(f"tokenizer vocabulary lacks byte-fallback pieces {missing[:4]}...; expected all 256")
    model = models.BPE(vocab=ids, merges=bpe_merges(vocab), unk_token="<unk>", byte_fallback=True,
                       fuse_unk=True)
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_PIECE),
                                                 normalizers.Replace(" ", SPACE_PIECE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens(list(SPECIAL_PIECES.values()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>", clean_up_tokenization_spaces=False,
                                   split_special_tokens=True)


def convert(checkpoint_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF folder (model.safetensors, config.json, generation_config.json, tokenizer files).

    Returns ``out_dir``.  Raises ValueError naming the file when an input is malformed.
    """
    config, weights = read_checkpoint(checkpoint_path)
    tokenizer = build_tokenizer(read_vocab(tokenizer_path, config.vocab_size))
    tokenizer.model_max_length = config.seq_len
    model = build_model(config, weights)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # name the class every transformers 5.x maps to the tokenizers backend, as demo-llama does
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out_dir / "model.safetensors").chmod(0o644)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python benchmarks/targets/convert_llama2c.py --checkpoint C --tokenizer T --out DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="llama2.c model .bin (legacy or v1)")
    parser.add_argument("--tokenizer", required=True, type=Path, help="llama2.c tokenizer .bin (e.g. tok512.bin)")
    parser.add_argument("--out", required=True, type=Path, help="output folder for the HF model")
    args = parser.parse_args(argv)
    out = convert(args.checkpoint, args.tokenizer, args.out)
    config = json.loads((out / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    print(f"wrote {out}: " + ", ".join(f"{key}={config[key]}" for key in keys))


if __name__ == "__main__":
    main()
