#!/usr/bin/env python3
"""Write a GGUF of Kimi-Linear-48B-A3B with random weights of the full shapes, for llama.cpp as a peer.

issue 9 asks for llama.cpp's Kimi-Linear support side by side with lunar on the same GPU. No checkpoint travels
to the device, so this writes what llama.cpp's loader expects for architecture "kimi-linear" (its
src/models/kimi-linear.cpp: tensor names, ggml shapes, metadata keys) from our HF config, with deterministic
random weights: Q4_0 or Q8_0 blocks (uniform codes, one fp16 scale chosen so each weight has std ~0.02, as the
dummy loader of lunar), F32 norms (1.0), router, convolutions and KDA gates. The tokenizer is "no_vocab" with
vocab_size tokens: llama-bench draws random token ids and never tokenises text.

Written from the GGUF v3 layout (header, key/values, tensor infos, 32-byte aligned data); nothing from llama.cpp's
own Python is used, so only numpy is needed. Quantised tensors are those llama-quantize would quantise for a
plain Q4_0/Q8_0 file: every 2-D+ weight whose rows are a multiple of 32 except norms, the router and the
convolutions; output.weight is Q8_0 (llama-quantize would pick Q6_K for Q4_0: a little fewer bytes).

  python3 tools/device/llamacpp_dummy_gguf.py configs/kimi-linear-48b-a3b.json /tmp/kl48.gguf --type q4_0
"""
import argparse
import json
import struct
import sys
import time

import numpy as np

GGUF_MAGIC = 0x46554747
T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_Q4_0, GGML_Q8_0 = 0, 2, 8
BLOCK = {GGML_Q4_0: 18, GGML_Q8_0: 34}  # bytes per 32 weights: fp16 scale + codes
ALIGN = 32


def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, typ, val):
    out = s(key) + struct.pack("<I", typ)
    if typ == T_U32:
        return out + struct.pack("<I", val)
    if typ == T_I32:
        return out + struct.pack("<i", val)
    if typ == T_F32:
        return out + struct.pack("<f", val)
    if typ == T_BOOL:
        return out + struct.pack("<?", val)
    if typ == T_STR:
        return out + s(val)
    if typ == T_ARR:  # arrays of u32 only here
        return out + struct.pack("<IQ", T_U32, len(val)) + b"".join(struct.pack("<I", v) for v in val)
    raise ValueError(typ)


def tensor_list(c, qtype):
    """(name, ggml ne list, ggml type, fill) in load order; fill: 'w' random weights, 'one', 'zero', 'a', 'conv'"""
    D, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    la = c["linear_attn_config"]
    H, dk, dc = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    full = set(la["full_attn_layers"])  # 1-based
    Hm, r = c["num_attention_heads"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    E, I, Id = c["num_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    Is = I * max(1, c.get("num_shared_experts", 1))
    nd = c.get("first_k_dense_replace", 0)

    def q(ne):  # quantised where its rows allow
        return qtype if ne[0] % 32 == 0 else GGML_F32

    t = [("token_embd.weight", [D, V], qtype, "w"), ("output_norm.weight", [D], GGML_F32, "one"),
         ("output.weight", [D, V], GGML_Q8_0, "w")]
    for i in range(L):
        p = f"blk.{i}."
        t.append((p + "attn_norm.weight", [D], GGML_F32, "one"))
        if (i + 1) not in full:  # KDA
            for x in "qkv":
                t.append((p + f"ssm_conv1d_{x}.weight", [dc, 1, dk * H, 1], GGML_F32, "conv"))
            for x in "qkv":
                t.append((p + f"attn_{x}.weight", [D, dk * H], q([D]), "w"))
            t += [(p + "ssm_f_a.weight", [D, dk], q([D]), "w"), (p + "ssm_f_b.weight", [dk, dk * H], q([dk]), "w"),
                  (p + "ssm_beta.weight", [D, H], q([D]), "w"), (p + "ssm_a", [1, H, 1, 1], GGML_F32, "a"),
                  (p + "ssm_dt.bias", [dk * H], GGML_F32, "zero"),
                  (p + "ssm_g_a.weight", [D, dk], q([D]), "w"), (p + "ssm_g_b.weight", [dk, dk * H], q([dk]), "w"),
                  (p + "ssm_norm.weight", [dk], GGML_F32, "one"),
                  (p + "attn_output.weight", [dk * H, D], q([dk * H]), "w")]
        else:  # MLA without q compression (q_lora_rank null), absorbed form: k_b / v_b
            t += [(p + "attn_kv_a_norm.weight", [r], GGML_F32, "one"),
                  (p + "attn_q.weight", [D, Hm * (dn + dr)], q([D]), "w"),
                  (p + "attn_kv_a_mqa.weight", [D, r + dr], q([D]), "w"),
                  (p + "attn_k_b.weight", [dn, r, Hm], q([dn]), "w"),
                  (p + "attn_v_b.weight", [r, dv, Hm], q([r]), "w"),
                  (p + "attn_output.weight", [Hm * dv, D], q([Hm * dv]), "w")]
        t.append((p + "ffn_norm.weight", [D], GGML_F32, "one"))
        if i < nd:
            t += [(p + "ffn_gate.weight", [D, Id], q([D]), "w"), (p + "ffn_down.weight", [Id, D], q([Id]), "w"),
                  (p + "ffn_up.weight", [D, Id], q([D]), "w")]
        else:
            t += [(p + "ffn_gate_inp.weight", [D, E], GGML_F32, "w"),
                  (p + "ffn_gate_exps.weight", [D, I, E], q([D]), "w"),
                  (p + "ffn_down_exps.weight", [I, D, E], q([I]), "w"),
                  (p + "ffn_up_exps.weight", [D, I, E], q([D]), "w"),
                  (p + "ffn_gate_shexp.weight", [D, Is], q([D]), "w"),
                  (p + "ffn_down_shexp.weight", [Is, D], q([Is]), "w"),
                  (p + "ffn_up_shexp.weight", [D, Is], q([D]), "w"),
                  (p + "exp_probs_b.bias", [E], GGML_F32, "zero")]
    return t


def nbytes(ne, typ):
    n = 1
    for d in ne:
        n *= d
    return n * 4 if typ == GGML_F32 else n // 32 * BLOCK[typ]


def metadata(c):
    a = "kimi-linear."
    la = c["linear_attn_config"]
    full = set(la["full_attn_layers"])
    L = c["num_hidden_layers"]
    r, dr = c["kv_lora_rank"], c["qk_rope_head_dim"]
    return [kv("general.architecture", T_STR, "kimi-linear"), kv("general.name", T_STR, "Kimi-Linear-48B-A3B (random)"),
            kv("general.alignment", T_U32, ALIGN),
            kv(a + "block_count", T_U32, L), kv(a + "context_length", T_U32, 1048576),
            kv(a + "embedding_length", T_U32, c["hidden_size"]),
            kv(a + "feed_forward_length", T_U32, c["intermediate_size"]),
            kv(a + "attention.head_count", T_U32, c["num_attention_heads"]),
            kv(a + "attention.head_count_kv", T_ARR, [1 if (i + 1) in full else 0 for i in range(L)]),
            kv(a + "rope.freq_base", T_F32, float(c.get("rope_theta", 10000.0))),
            kv(a + "attention.layer_norm_rms_epsilon", T_F32, float(c["rms_norm_eps"])),
            kv(a + "expert_count", T_U32, c["num_experts"]),
            kv(a + "expert_used_count", T_U32, c["num_experts_per_token"]),
            kv(a + "expert_group_count", T_U32, c.get("num_expert_group", 1)),
            kv(a + "expert_group_used_count", T_U32, c.get("topk_group", 1)),
            kv(a + "expert_gating_func", T_U32, 2),  # sigmoid
            kv(a + "vocab_size", T_U32, c["vocab_size"]),
            kv(a + "ssm.conv_kernel", T_U32, la["short_conv_kernel_size"]),
            kv(a + "kda.head_dim", T_U32, la["head_dim"]),
            kv(a + "attention.kv_lora_rank", T_U32, r),
            kv(a + "rope.dimension_count", T_U32, dr),
            kv(a + "attention.key_length", T_U32, r + dr), kv(a + "attention.value_length", T_U32, r),
            kv(a + "attention.key_length_mla", T_U32, c["qk_nope_head_dim"] + dr),
            kv(a + "attention.value_length_mla", T_U32, c["v_head_dim"]),
            kv(a + "expert_feed_forward_length", T_U32, c["moe_intermediate_size"]),
            kv(a + "expert_shared_count", T_U32, c.get("num_shared_experts", 1)),
            kv(a + "leading_dense_block_count", T_U32, c.get("first_k_dense_replace", 0)),
            kv(a + "expert_weights_scale", T_F32, float(c.get("routed_scaling_factor", 1.0))),
            kv(a + "expert_weights_norm", T_BOOL, bool(c.get("moe_renormalize", True))),
            kv("tokenizer.ggml.model", T_STR, "no_vocab")]


def pools(rng):
    """1 MiB-aligned pools of blocks per type, reused cyclically: the codes only need to look random"""
    n = 1 << 22  # blocks per pool
    out = {}
    for typ, scale in ((GGML_Q4_0, 0.02 / 4.6), (GGML_Q8_0, 0.02 / 73.0)):  # std of the uniform codes
        b = np.empty((n, BLOCK[typ]), np.uint8)
        b[:, :2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        b[:, 2:] = rng.integers(0, 256, (n, BLOCK[typ] - 2), dtype=np.uint8)
        out[typ] = b.reshape(-1)
    out[GGML_F32] = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint8)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    args = ap.parse_args()
    c = json.load(open(args.config))
    qtype = {"q4_0": GGML_Q4_0, "q8_0": GGML_Q8_0}[args.type]
    ts = tensor_list(c, qtype)
    meta = metadata(c)
    infos, off = [], 0
    for name, ne, typ, _ in ts:
        infos.append(s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) +
                     struct.pack("<IQ", typ, off))
        off += (nbytes(ne, typ) + ALIGN - 1) // ALIGN * ALIGN
    head = struct.pack("<IIQQ", GGUF_MAGIC, 3, len(ts), len(meta)) + b"".join(meta) + b"".join(infos)
    head += b"\0" * ((-len(head)) % ALIGN)
    rng = np.random.default_rng(0)
    pool = pools(rng)
    t0 = time.time()
    with open(args.out, "wb") as f:
        f.write(head)
        for name, ne, typ, fill in ts:
            nb = nbytes(ne, typ)
            if fill == "one":
                data = np.ones(nb // 4, np.float32).view(np.uint8)
            elif fill == "zero":
                data = np.zeros(nb // 4, np.float32).view(np.uint8)
            elif fill == "a":  # A = -exp(A_log), A_log ~ log U(1, 16): decays as the real model's
                data = (-rng.uniform(1.0, 16.0, nb // 4).astype(np.float32)).view(np.uint8)
            elif fill == "conv":
                data = (rng.standard_normal(nb // 4, dtype=np.float32) * 0.3).view(np.uint8)
            else:
                p = pool[typ]
                done = 0
                while done < nb:  # whole pool copies, then a tail; stays block-aligned
                    k = min(nb - done, len(p))
                    f.write(memoryview(p[:k]))
                    done += k
                data = None
            if data is not None:
                f.write(memoryview(data))
            f.write(b"\0" * ((-nb) % ALIGN))
    size = off + len(head)
    print(f"{args.out}: {len(ts)} tensors, {size / 1e9:.2f} GB, {args.type}, written in {time.time() - t0:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
