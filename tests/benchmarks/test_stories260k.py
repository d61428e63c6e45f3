"""The shipped stories260K target and the llama2.c converter that made it.

References are independent of the converter: llama2.c's greedy output, a llama2.c-style forward
(interleaved RoPE, GQA by integer division of the head index) written here on the raw arrays, and
llama2.c's ``encode`` merge loop written here on the raw ``tok512.bin``.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "benchmarks" / "targets" / "stories260K"
SHARED = REPO.parent / "shared" / "targets" / "stories260K"
CHECKPOINT, VOCAB_FILE = SHARED / "stories260K.bin", SHARED / "tok512.bin"
REFERENCE = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
             "One day, she saw a big, red ball. She wanted to play with it, but it was too high.")


def _load_converter():
    spec = importlib.util.spec_from_file_location("convert_llama2c", REPO / "benchmarks/targets/convert_llama2c.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


converter = _load_converter()
needs_shared = pytest.mark.skipif(not CHECKPOINT.is_file() or not VOCAB_FILE.is_file(),
                                  reason=f"llama2.c source files not found under {SHARED}")


@pytest.fixture(scope="module")
def shipped():
    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(SHIPPED)


def test_shipped_greedy_matches_llama2c(shipped):
    model, tokenizer = shipped
    encoded = tokenizer("Once upon a time", return_tensors="pt")
    assert encoded["input_ids"][0, 0].item() == 1
    output = model.generate(**encoded, max_new_tokens=60, do_sample=False)
    assert tokenizer.decode(output[0], skip_special_tokens=True).startswith(REFERENCE)
    assert set(model.generation_config.eos_token_id) == {1, 2}
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]


# ---------------------------------------------------------------- llama2.c reference forward
def llama2c_logits(weights: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int,
                   tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] in float64, computed as llama2.c's run.c does, from raw llama2.c arrays."""
    w = {name: tensor.double() for name, tensor in weights.items()}
    x = w["token_embedding"][tokens]  # [T, D]
    length, dim = x.shape
    head = dim // n_heads
    angles = torch.outer(torch.arange(length, dtype=torch.float64),
                         10000.0 ** -(torch.arange(0, head, 2, dtype=torch.float64) / head))  # [T, hd/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rms(v: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * gain

    def rope(v: torch.Tensor, heads: int) -> torch.Tensor:  # [T, heads * hd], pairs (2i, 2i + 1)
        pairs = v.view(length, heads, head // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).view(length, heads, head)

    mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
    for layer in range(w["wq"].shape[0]):
        h = rms(x, w["rms_att"][layer])
        q = rope(h @ w["wq"][layer].T, n_heads)  # [T, H, hd]
        k = rope(h @ w["wk"][layer].T, n_kv_heads).repeat_interleave(n_heads // n_kv_heads, 1)
        v = (h @ w["wv"][layer].T).view(length, n_kv_heads, head).repeat_interleave(n_heads // n_kv_heads, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / head ** 0.5 + mask  # [H, T, T]
        attended = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(length, dim)
        x = x + attended @ w["wo"][layer].T
        h = rms(x, w["rms_ffn"][layer])
        x = x + (torch.nn.functional.silu(h @ w["w1"][layer].T) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    classifier = w.get("wcls", w["token_embedding"])
    return rms(x, w["rms_final"]) @ classifier.T


@needs_shared
def test_shipped_logits_match_llama2c_forward(shipped):
    model, _ = shipped
    config, weights = converter.read_checkpoint(CHECKPOINT)
    tokens = [1] + torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = llama2c_logits(weights, config.n_heads, config.n_kv_heads, tokens)
    with torch.no_grad():
        actual = model(torch.tensor([tokens])).logits[0].double()
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-4)


@needs_shared
def test_conversion_reproduces_shipped_folder(tmp_path):
    out = converter.convert(CHECKPOINT, VOCAB_FILE, tmp_path / "converted")
    converted, shipped_weights = load_file(out / "model.safetensors"), load_file(SHIPPED / "model.safetensors")
    assert converted.keys() == shipped_weights.keys()
    for name, tensor in shipped_weights.items():
        assert torch.equal(converted[name], tensor), name
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        converted_json, shipped_json = (json.loads((folder / name).read_text()) for folder in (out, SHIPPED))
        converted_json.pop("transformers_version", None)
        shipped_json.pop("transformers_version", None)
        assert converted_json == shipped_json, name


# ---------------------------------------------------------------- synthetic checkpoints
SMALL = dict(dim=16, hidden_dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, seq_len=32)


def _random_arrays(shared: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    d, h, n, v, seq = (SMALL[key] for key in ("dim", "hidden_dim", "n_layers", "vocab_size", "seq_len"))
    kv, head = SMALL["n_kv_heads"] * d // SMALL["n_heads"], d // SMALL["n_heads"]
    g = torch.Generator().manual_seed(seed)
    arrays = {name: torch.randn(shape, generator=g) * 0.3 for name, shape in [
        ("token_embedding", (v, d)), ("wq", (n, d, d)), ("wk", (n, kv, d)), ("wv", (n, kv, d)), ("wo", (n, d, d)),
        ("w1", (n, h, d)), ("w2", (n, d, h)), ("w3", (n, h, d)), ("wcls", (v, d))]}
    for name, shape in [("rms_att", (n, d)), ("rms_ffn", (n, d)), ("rms_final", (d,))]:
        arrays[name] = 1 + 0.1 * torch.randn(shape, generator=g)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), 10000.0 ** -(torch.arange(0, head, 2) / head))
    arrays["freq_cis_real"], arrays["freq_cis_imag"] = angles.cos().float(), angles.sin().float()
    if shared:
        del arrays["wcls"]
    return arrays


def _write(path: Path, arrays: dict[str, torch.Tensor], shared: bool, version: int) -> Path:
    """A llama2.c file, laid out as llama2.c's export.py writes it (legacy_export / version1_export)."""
    sizes = [SMALL[key] for key in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")]
    if version == 0:
        sizes[5] = sizes[5] if shared else -sizes[5]
        header = struct.pack("<7i", *sizes)
        order = ["token_embedding", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final",
                 "freq_cis_real", "freq_cis_imag"]
    else:
        header = struct.pack("<Ii7iB", 0x616B3432, 1, *sizes, int(shared)).ljust(256, b"\0")
        order = ["rms_att", "rms_ffn", "rms_final", "token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    order += [] if shared else ["wcls"]
    path.write_bytes(header + b"".join(arrays[name].float().numpy().astype("<f4").tobytes() for name in order))
    return path


@pytest.mark.parametrize("shared", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("version", [0, 1], ids=["legacy", "v1"])
def test_synthetic_checkpoint_matches_llama2c_forward(tmp_path, shared, version):
    arrays = _random_arrays(shared)
    config, weights = converter.read_checkpoint(_write(tmp_path / "model.bin", arrays, shared, version))
    assert (config.shared_classifier, config.vocab_size, config.version) == (shared, SMALL["vocab_size"], version)
    model = converter.build_model(config, weights)
    assert model.config.tie_word_embeddings is shared
    tokens = torch.randint(0, SMALL["vocab_size"], (20,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = llama2c_logits(arrays, SMALL["n_heads"], SMALL["n_kv_heads"], tokens)
    with torch.no_grad():
        actual = model(torch.tensor([tokens])).logits[0].double()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_truncated_checkpoint_is_refused(tmp_path):
    path = _write(tmp_path / "model.bin", _random_arrays(True), True, 0)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"model\.bin: checkpoint is truncated: \d+ bytes, expected \d+ bytes"):
        converter.convert(path, path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda data: data + b"\0" * 8, "longer than its header says"),
    (lambda data: struct.pack("<7i", 16, 24, 2, 3, 2, 40, 32) + data[28:], "bad llama2.c header"),
    (lambda data: data[:20], "too short for a llama2.c checkpoint header"),
    (lambda data: struct.pack("<Ii", 0x616B3432, 2).ljust(256, b"\0"), "version 2 is not supported"),
])
def test_malformed_checkpoint_is_refused(tmp_path, damage, message):
    path = _write(tmp_path / "model.bin", _random_arrays(True), True, 0)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message) as error:
        converter.read_checkpoint(path)
    assert str(path) in str(error.value)


@needs_shared
def test_truncated_shared_files_are_refused(tmp_path):
    checkpoint = tmp_path / "stories260K.bin"
    checkpoint.write_bytes(CHECKPOINT.read_bytes()[: 500_000])
    with pytest.raises(ValueError, match="stories260K.bin: checkpoint is truncated: 500000 bytes, expected 1056540"):
        converter.read_checkpoint(checkpoint)
    vocab = tmp_path / "tok512.bin"
    vocab.write_bytes(VOCAB_FILE.read_bytes()[:3000])
    with pytest.raises(ValueError, match="tok512.bin: (tokenizer truncated|bad tokenizer entry)"):
        converter.read_vocab(vocab, 512)


# ---------------------------------------------------------------- tokenizer vs llama2.c encode
def llama2c_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """llama2.c's ``encode(text, bos=1, eos=0)``: dummy " " prefix, codepoints or bytes + 3, then
    repeatedly merge the leftmost pair whose concatenation has the highest score."""
    ids = {piece: index for index, piece in enumerate(pieces)}
    tokens = [ids[b" "]] if text else []
    for char in text:
        raw = char.encode("utf-8")
        tokens += [ids[raw]] if raw in ids else [byte + 3 for byte in raw]
    while True:
        best = None  # (score, position, id)
        for position in range(len(tokens) - 1):
            merged = ids.get(pieces[tokens[position]] + pieces[tokens[position + 1]])
            if merged is not None and (best is None or scores[merged] > best[0]):
                best = (scores[merged], position, merged)
        if best is None:
            return [1] + tokens
        tokens[best[1]:best[1] + 2] = [best[2]]


@pytest.fixture(scope="module")
def raw_vocab() -> tuple[list[bytes], list[float]]:
    if not VOCAB_FILE.is_file():
        pytest.skip(f"llama2.c tokenizer not found at {VOCAB_FILE}")
    data, offset, pieces, scores = VOCAB_FILE.read_bytes(), 4, [], []
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        pieces.append(data[offset + 8:offset + 8 + length])
        scores.append(score)
        offset += 8 + length
    return pieces, scores


@pytest.fixture(scope="module")
def shipped_tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.mark.parametrize("text", ["", "Once upon a time", " two  spaces\tand a tab\n", "Tim's dog said: \"Woof!\"",
                                  "naïve café ☃ 😀", "<0x41> <s> </s>"])
def test_tokenizer_matches_llama2c_encode_fixed(shipped_tokenizer, raw_vocab, text):
    assert shipped_tokenizer(text)["input_ids"] == llama2c_encode(text, *raw_vocab)


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=40))
def test_tokenizer_matches_llama2c_encode_random_ascii(shipped_tokenizer, raw_vocab, text):
    ids = shipped_tokenizer(text)["input_ids"]
    assert ids == llama2c_encode(text, *raw_vocab)
    assert shipped_tokenizer.decode(ids, skip_special_tokens=True) == text
