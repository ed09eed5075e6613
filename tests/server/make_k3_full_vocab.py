"""Writes a tiny random-weight Kimi-K3.1 model with the full 163,840-token vocabulary, so the K3 chat
format (XTML) can be generated over HTTP with the real Kimi tokenizer (tests/server/test_openai.py).

    python3 tests/server/make_k3_full_vocab.py OUT_DIR

It starts from tests/golden/k3-a (AttnRes, latent MoE with MXFP4 experts, KDA + gated MLA-NoPE; hidden
45, 6 layers, random weights, a 301-token vocabulary) and:
  - widens embed_tokens and lm_head to 163,840 rows (the original rows kept, the rest random BF16 of
    magnitude 1/16..1/8 with random signs, deterministic);
  - adds the K3.1 lightning indexer to each MLA layer (SPEC 1.1 tensor names; 2 heads of 16 dims,
    index_topk 8, so prompts longer than 8 tokens attend sparsely);
  - points the token ids at the Kimi tokenizer (eos <|end_of_msg|> 163586) and copies its files
    (tiktoken.model, tokenizer_config.k3.json as tokenizer_config.json).
Plain Python (struct / random): ~60 MB written in a few seconds; nothing is committed.
"""
import json
import os
import random
import shutil
import struct
import sys
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "tests", "golden", "k3-a")
TOK = os.path.join(ROOT, "data", "kimi-tokenizer")
VOCAB = 163840
EOS = 163586  # <|end_of_msg|>
IDX_HEADS, IDX_DIM, IDX_TOPK = 2, 16, 8


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def write_safetensors(path, tensors):
    header, off, blobs = {}, 0, []
    for k in sorted(tensors):
        dtype, shape, blob = tensors[k]
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def bf16_random(rng, n):
    """n BF16 values: random sign and mantissa, exponent 2^-4 (magnitudes in [1/16, 1/8))."""
    raw = array("H", rng.randbytes(2 * n))
    return array("H", ((r & 0x807F) | (123 << 7) for r in raw)).tobytes()


def f32_to_bf16(blob):
    return array("H", (v >> 16 for v in array("I", blob))).tobytes()


def main(out):
    os.makedirs(out, exist_ok=True)
    rng = random.Random(20261130)
    cfg = json.load(open(os.path.join(SRC, "config.json")))
    tc = cfg["text_config"]
    t = read_safetensors(os.path.join(SRC, "model.safetensors"))
    hidden, old_vocab = tc["hidden_size"], tc["vocab_size"]
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"):
        dtype, shape, blob = t[name]
        assert dtype == "F32" and shape == [old_vocab, hidden], (name, dtype, shape)
        t[name] = ("BF16", [VOCAB, hidden], f32_to_bf16(blob) + bf16_random(rng, (VOCAB - old_vocab) * hidden))
    q_rank = tc["q_lora_rank"]
    for layer in tc["linear_attn_config"]["full_attn_layers"]:  # 1-based
        p = f"language_model.model.layers.{layer - 1}.self_attn.indexer."
        t[p + "wq_b.weight"] = ("BF16", [IDX_HEADS * IDX_DIM, q_rank], bf16_random(rng, IDX_HEADS * IDX_DIM * q_rank))
        t[p + "wk.weight"] = ("BF16", [IDX_DIM, hidden], bf16_random(rng, IDX_DIM * hidden))
        t[p + "k_norm.weight"] = ("F32", [IDX_DIM], struct.pack(f"<{IDX_DIM}f", *([1.0] * IDX_DIM)))
        t[p + "k_norm.bias"] = ("F32", [IDX_DIM], struct.pack(f"<{IDX_DIM}f", *([0.0] * IDX_DIM)))
        t[p + "weights_proj.weight"] = ("BF16", [IDX_HEADS, hidden], bf16_random(rng, IDX_HEADS * hidden))
    tc.update(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=163584, pad_token_id=163839,
              index_n_heads=IDX_HEADS, index_head_dim=IDX_DIM, index_topk=IDX_TOPK, index_rope=False)
    cfg.update(eos_token_id=EOS, bos_token_id=163584, pad_token_id=163839, media_placeholder_token_id=163605)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    write_safetensors(os.path.join(out, "model.safetensors"), t)
    shutil.copyfile(os.path.join(TOK, "tiktoken.model"), os.path.join(out, "tiktoken.model"))
    shutil.copyfile(os.path.join(TOK, "tokenizer_config.k3.json"), os.path.join(out, "tokenizer_config.json"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/lunar-k3-full-vocab")
