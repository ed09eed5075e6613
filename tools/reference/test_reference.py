#!/usr/bin/env python3
"""Pins each piece of tools/reference/kimi_k3_reference.py to code nobody here wrote, on random inputs.

    python3 tools/reference/test_reference.py          # prints the table of max errors
    python3 -m pytest tools/reference -q               # same checks as pytest tests

Outside code: fla 0.6.0 (naive_kda_lowerbound_gate, naive_recurrent_kda, naive_chunk_kda, naive_attnres),
transformers 5.x (Glm5NextTextForgetGate, Glm5NextTextLinearAttention [a whole KDA layer with the bounded gate],
KimiLinearAttention, KimiLinearTopkRouter, KimiLinearMLP, DeepseekV32Indexer), compressed-tensors (MXFP4 unpack
and E8M0 scales; optional: found on sys.path or in /tmp/ctpkg, skipped when absent).
"""
import math
import os
import sys

import torch

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kimi_k3_reference as R  # noqa: E402

RESULTS = []


def record(name, err, tol, against):
    RESULTS.append((name, err, tol, against))
    assert err <= tol, f"{name}: max error {err:.3e} > {tol:.1e}"


def maxerr(a, b):
    return float((a.float() - b.float()).abs().max())


def gen(seed):
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# KDA


def test_kda_gate():
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextForgetGate
    gen(1)
    T, H, d, D = 9, 3, 12, 20
    f = torch.randn(T, H * d) * 2
    A_log = torch.empty(8).uniform_(-3, 3)
    A_log[:H] = torch.empty(H).uniform_(0.5, 4).log()
    dt = torch.randn(H * d)
    mine = R.kda_gate(f, A_log, dt, H, -5.0)
    ref = naive_kda_lowerbound_gate(f.reshape(T, H, d), A_log[:H], dt, lower_bound=-5.0)
    record("KDA bounded gate", maxerr(mine, ref), 1e-6, "fla naive_kda_lowerbound_gate")
    cfg = Glm5NextTextConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=d, linear_lower_bound=-5.0)
    fg = Glm5NextTextForgetGate(cfg).float()
    with torch.no_grad():
        for p in fg.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        x = torch.randn(1, T, D)
        ref2 = fg(x)[0]
        W = {"f_a_proj.weight": fg.f_a_proj.weight, "f_b_proj.weight": fg.f_b_proj.weight}
        f2 = (x[0] @ W["f_a_proj.weight"].t()) @ W["f_b_proj.weight"].t()
        Apad = torch.cat([fg.A_log.data, torch.full((128 - H,), 9.0)])       # padded 1-D A_log, K3 style
        mine2 = R.kda_gate(f2, Apad, fg.dt_bias, H, -5.0)
    record("KDA bounded gate (f_a/f_b, padded A_log)", maxerr(mine2, ref2), 1e-6, "transformers Glm5NextTextForgetGate")


def _kda_inputs(T, H, d, seed):
    gen(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, d), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, d), dim=-1)
    v = torch.randn(T, H, d)
    g = -5.0 * torch.sigmoid(torch.randn(T, H, d) * 2)
    beta = torch.sigmoid(torch.randn(T, H))
    S0 = torch.randn(H, d, d) * 0.3
    return q, k, v, g, beta, S0


def test_kda_kernels():
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    T, H, d = 128, 3, 12
    q, k, v, g, beta, S0 = _kda_inputs(T, H, d, 2)
    sc = d ** -0.5
    B = lambda x: x[None]                                                  # noqa: E731
    o_ref, S_ref = naive_recurrent_kda(B(q), B(k), B(v), B(g), B(beta), initial_state=B(S0), output_final_state=True)
    o, S = R.kda_recurrent(q * sc, k, v, g, beta, S0)
    record("KDA recurrence: output", maxerr(o, o_ref[0]), 1e-5, "fla naive_recurrent_kda")
    record("KDA recurrence: final state", maxerr(S, S_ref[0]), 1e-5, "fla naive_recurrent_kda")
    o_ch, S_ch = naive_chunk_kda(B(q), B(k), B(v), B(g), B(beta), initial_state=B(S0), output_final_state=True)
    o2, S2 = R.kda_chunked(q * sc, k, v, g, beta, S0)
    record("KDA chunked (T=128, 2 chunks): output", maxerr(o2, o_ch[0]), 1e-4, "fla naive_chunk_kda")
    record("KDA chunked (T=128, 2 chunks): state", maxerr(S2, S_ch[0]), 1e-4, "fla naive_chunk_kda")
    T = 83                                                                 # partial last chunk
    q, k, v, g, beta, S0 = _kda_inputs(T, H, d, 3)
    o_ref, S_ref = naive_recurrent_kda(B(q), B(k), B(v), B(g), B(beta), initial_state=B(S0), output_final_state=True)
    o3, S3 = R.kda_chunked(q * sc, k, v, g, beta, S0)
    record("KDA chunked (T=83, partial chunk) vs recurrence", max(maxerr(o3, o_ref[0]), maxerr(S3, S_ref[0])), 1e-4,
           "fla naive_recurrent_kda")


def test_kda_layer():
    """Whole KDA layer (projections, causal conv + SiLU, L2 norms, bounded gate, beta, delta rule, gated o_norm,
    o_proj) against transformers' GLM-5-Next KDA layer, whose output gate is low-rank: g_proj := g_b @ g_a."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    import inspect

    from transformers.models.glm5_next import modeling_glm5_next as G
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
    # transformers swaps in fla's triton kernels when fla is installed; use its own torch implementations instead
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        setattr(G, fn, inspect.unwrap(getattr(G, fn)))
    gen(4)
    T, H, d, D = 70, 3, 12, 33
    cfg = Glm5NextTextConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=d, linear_conv_kernel_dim=4,
                             linear_lower_bound=-5.0, rms_norm_eps=1e-5, hidden_act="silu", num_hidden_layers=1,
                             layer_types=["linear_attention"])
    m = Glm5NextTextLinearAttention(cfg, 0).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty(H).uniform_(0.5, 4).log())
            elif n.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape) * 0.5 - 1)
            elif "norm" in n:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]) * (0.5 if "conv" in n else 1.0) * (
                    math.sqrt(p.shape[-1]) if "conv" in n else 1.0))
        x = torch.randn(1, T, D)
        ref = m(x)[0]
        conv = m.conv1d.weight
        W = {"q_proj.weight": m.q_proj.weight, "k_proj.weight": m.k_proj.weight, "v_proj.weight": m.v_proj.weight,
             "q_conv1d.weight": conv[:H * d], "k_conv1d.weight": conv[H * d:2 * H * d],
             "v_conv1d.weight": conv[2 * H * d:], "f_a_proj.weight": m.forget_gate.f_a_proj.weight,
             "f_b_proj.weight": m.forget_gate.f_b_proj.weight, "dt_bias": m.forget_gate.dt_bias,
             "A_log": torch.cat([m.forget_gate.A_log, torch.full((8 - H,), 7.0)]),
             "b_proj.weight": m.b_proj.weight, "g_proj.weight": m.g_b_proj.weight @ m.g_a_proj.weight,
             "o_norm.weight": m.o_norm.weight, "o_proj.weight": m.o_proj.weight}
        c = type("C", (), dict(kda_h=H, kda_d=d, conv_k=4, lower_bound=-5.0, eps=1e-5))()
        st = {}
        pre = R.kda_layer(x[0, :T - 4], W, "", c, st)                      # chunked prefill, fills conv + state
        dec = torch.cat([R.kda_layer(x[0, t:t + 1], W, "", c, st) for t in range(T - 4, T)])   # recurrent decode
        full = R.kda_layer(x[0], W, "", c, {})
    scale = float(ref.abs().max())
    record("KDA layer prefill (chunked)", maxerr(pre, ref[:T - 4]) / scale, 2e-5, "transformers Glm5NextTextLinearAttention")
    record("KDA layer decode (recurrent + conv state)", maxerr(dec, ref[T - 4:]) / scale, 2e-5,
           "transformers Glm5NextTextLinearAttention")
    record("KDA layer full (T=70, one call)", maxerr(full, ref) / scale, 2e-5, "transformers Glm5NextTextLinearAttention")


# ---------------------------------------------------------------------------------------------------------------
# AttnRes


def test_attnres():
    from fla.ops.attnres.naive import naive_attnres
    gen(5)
    D, n = 45, 7
    for S in (1, 2, 5, 9):
        v = [torch.randn(n, D) * (0.3 + 0.7 * i) for i in range(S)]
        p = torch.randn(1, D) * 0.3
        r = torch.rand(D) + 0.5
        on = torch.rand(D) + 0.5
        ref = naive_attnres(p, v, r, output_rms_weight=on, rms_eps=1e-5)
        record(f"AttnRes mix + out-norm, {S} candidates", maxerr(R.attnres_mix(v, p, r, on, 1e-5), ref), 1e-5,
               "fla naive_attnres")


# ---------------------------------------------------------------------------------------------------------------
# MLA, router, shared MLP vs transformers KimiLinear


def _kimi_cfg(**kw):
    from transformers import KimiLinearConfig
    base = dict(hidden_size=37, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=17, kv_lora_rank=13,
                qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=7, num_experts=7, num_experts_per_token=3,
                moe_intermediate_size=11, num_shared_experts=2, routed_scaling_factor=2.5, moe_renormalize=True,
                rms_norm_eps=1e-5, hidden_act="silu", num_hidden_layers=1, vocab_size=50, mla_use_nope=True,
                linear_attn_config={"full_attn_layers": [1], "kda_layers": [], "num_heads": 2, "head_dim": 8})
    base.update(kw)
    c = KimiLinearConfig(**base)
    c._attn_implementation = "eager"
    return c


def test_mla():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention
    gen(6)
    cfg = _kimi_cfg()
    m = KimiLinearAttention(cfg, 0).float().eval()
    T = 19
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "layernorm" in n else torch.randn(p.shape) / math.sqrt(p.shape[-1]))
        m.kv_a_proj_with_mqa.weight[:13] *= 0.01         # tiny latent: kv_a_layernorm eps 1e-6 shows
        x = torch.randn(1, T, 37)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        ref = m(x, mask)[0][0]
        W = {k + ".weight" if not k.endswith("weight") else k: v for k, v in
             {n: p.detach() for n, p in m.named_parameters()}.items()}
        c = type("C", (), dict(nh=3, nope=10, rope=6, vd=7, kv_lora=13, idx_topk=0))()
        full = R.mla_layer(x[0], W, "", c, {})
        st = {}
        R.mla_layer(x[0, :T - 3], W, "", c, st)
        dec = torch.cat([R.mla_layer(x[0, t:t + 1], W, "", c, st) for t in range(T - 3, T)])
    record("MLA-NoPE (q_lora, eps 1e-6) prefill", maxerr(full, ref), 1e-5, "transformers KimiLinearAttention")
    record("MLA absorbed decode over latent cache", maxerr(dec, ref[T - 3:]), 1e-5, "transformers KimiLinearAttention")


def test_router_and_mlp():
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMLP, KimiLinearTopkRouter
    gen(7)
    cfg = _kimi_cfg()
    rt = KimiLinearTopkRouter(cfg)
    with torch.no_grad():
        rt.weight.copy_(torch.randn(7, 37) / math.sqrt(37) * 1.5)
        rt.e_score_correction_bias.copy_(torch.empty(7).uniform_(-0.1, 0.1))
        x = torch.randn(40, 37)
        _, w_ref, i_ref = rt(x)
        idx, wts, _ = R.router(x, rt.weight, rt.e_score_correction_bias, 3, True, 2.5)
    o_ref, o = i_ref.sort(-1), idx.sort(-1)
    same = bool(torch.equal(o_ref.values, o.values))
    err = maxerr(wts.gather(-1, o.indices), w_ref.gather(-1, o_ref.indices)) if same else float("inf")
    record("router: selected experts identical, weights", err, 1e-6, "transformers KimiLinearTopkRouter")
    mlp = KimiLinearMLP(cfg, intermediate_size=22)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
        ref = mlp(x)
        # SiTU with beta -> inf and no linear beta is SwiGLU: pins the MLP wiring (gate/up/down roles)
        mine = R.mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, 1e7, 0.0)
    record("shared/dense MLP wiring (SiTU beta->inf = SwiGLU)", maxerr(mine, ref), 1e-5, "transformers KimiLinearMLP")
    # SiTU itself has no outside implementation here: checked against the spec formula written out in float64
    g, u = torch.randn(1000) * 6, torch.randn(1000) * 40
    gd, ud = g.double(), u.double()
    f = 4 * torch.tanh(gd / 4) / (1 + torch.exp(-gd)) * 25 * torch.tanh(ud / 25)
    record("SiTU (beta 4, beta_l 25)", maxerr(R.situ(g, u, 4.0, 25.0), f) / float(f.abs().max()), 1e-6,
           "k3_spec 6.1 formula (float64)")


# ---------------------------------------------------------------------------------------------------------------
# Indexer


def test_indexer():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as M
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    gen(8)
    D, nh, d, ql, topk, T = 41, 4, 32, 19, 8, 40
    cfg = DeepseekV32Config(hidden_size=D, index_n_heads=nh, index_head_dim=d, qk_rope_head_dim=8,
                            index_topk=topk, q_lora_rank=ql)
    ix = M.DeepseekV32Indexer(cfg, 0).float().eval()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
        ix.k_norm.weight.uniform_(0.5, 1.5)
        ix.k_norm.bias.uniform_(-0.5, 0.5)
        x, cq = torch.randn(1, T, D), torch.randn(1, T, ql)
        ones, zeros = torch.ones(1, T, 8), torch.zeros(1, T, 8)               # cos=1, sin=0: index_rope=false
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        ref = ix(x, cq, (ones, zeros), mask, None, cache=None)[0]            # [T, topk] (top-k over T columns)
        W = {"indexer.wq_b.weight": ix.wq_b.weight, "indexer.wk.weight": ix.wk.weight,
             "indexer.k_norm.weight": ix.k_norm.weight, "indexer.k_norm.bias": ix.k_norm.bias,
             "indexer.weights_proj.weight": ix.weights_proj.weight}
        c = type("C", (), dict(idx_h=nh, idx_d=d))()
        iq_h, ik_h, w = R.indexer_qkw(x[0], cq[0], W, "", c)                  # Hadamard-rotated
        iq = (cq[0] @ ix.wq_b.weight.t()).reshape(T, nh, d)
        ik = ix.k_norm(ix.wk(x[0]))
        I = R.index_scores(iq, w, ik, torch.ones(T), 0, fp8=False)
        I_rot = R.index_scores(iq_h, w, ik_h, torch.ones(T), 0, fp8=False)
        sel = R.topk_select(I, 0, topk)
    # transformers returns topk among all T columns (masked -inf included for t < topk); compare rows t >= topk-1
    # torch.topk breaks ties arbitrarily; with ReLU, exact-zero ties are common. A row agrees when both picks have the
    # same multiset of scores (identical sets unless the boundary is an exact tie, which we break to the lower position)
    bad = ties = 0
    for t in range(topk - 1, T):
        mine_s = torch.nonzero(sel[t]).flatten()
        if set(ref[t].tolist()) != set(mine_s.tolist()):
            ties += 1
            if not torch.equal(I[t, ref[t].long()].sort()[0], I[t, mine_s].sort()[0]):
                bad += 1
    print(f"  indexer: {ties} rows pick differently among exactly tied (zero) scores")
    record("indexer top-k (no Hadamard/FP8), rows differing beyond exact ties", float(bad), 0,
           "transformers DeepseekV32Indexer")
    fin = torch.isfinite(I)
    record("indexer scores: Hadamard rotation leaves them unchanged", maxerr(I[fin], I_rot[fin]), 1e-5,
           "H orthonormal (H^T H = I)")
    # Hadamard vs the explicit Sylvester matrix
    Hm = torch.ones(1, 1, dtype=torch.float64)
    while Hm.shape[0] < d:
        Hm = torch.cat([torch.cat([Hm, Hm], 1), torch.cat([Hm, -Hm], 1)], 0)
    z = torch.randn(5, d)
    record("Hadamard butterfly vs Sylvester matrix / sqrt(n)", maxerr(R.hadamard(z), z.double() @ Hm.t() / math.sqrt(d)),
           1e-6, "Sylvester construction")
    # FP8 power-of-two scale vs the DeepSeek-V3.2 formula s = 2^ceil(log2(amax/448)) in exact arithmetic
    z = torch.randn(200, d) * torch.logspace(-6, 3, 200)[:, None]
    q, s = R.fp8_quant_pow2(z)
    worst = 0.0
    for i in range(200):
        amax = max(float(z[i].abs().max()), 1e-4)
        s_ref = 2.0 ** math.ceil(math.log2(float(torch.tensor(amax / 448.0, dtype=torch.float32))))
        worst = max(worst, abs(float(s[i, 0]) - s_ref) / s_ref)
    record("FP8 ue8m0 scale rule", worst, 0.0, "V3.2 act_quant formula 2^ceil(log2(amax/448))")
    record("FP8 e4m3 codes (torch float8_e4m3fn RNE) within half an ulp", float(((q * s - z).abs() / (z.abs() + 1e-30) > 2 ** -4 + 1e-7)
           [(z / s).abs() >= 2 ** -6].sum()), 0, "e4m3 3-bit mantissa")


# ---------------------------------------------------------------------------------------------------------------
# MXFP4


def _direct_dequant(packed, scale):
    """A literal reading of the compressed-tensors layout, one element at a time."""
    O, half = packed.shape
    out = torch.empty(O, 2 * half, dtype=torch.float64)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for r in range(O):
        for c in range(2 * half):
            b = int(packed[r, c // 2])
            nib = b & 15 if c % 2 == 0 else b >> 4
            val = mags[nib & 7] * (-1 if nib & 8 else 1)
            out[r, c] = val * 2.0 ** (int(scale[r, c // 32]) - 127)
    return out


def test_mxfp4():
    gen(9)
    O, I = 13, 96
    w = torch.randn(O, I) * torch.logspace(-3, 2, O)[:, None]
    w[0, :32] = 0.0
    packed, scale = R.mxfp4_quantize(w)
    deq = R.mxfp4_dequant(packed, scale)
    record("MXFP4 dequant vs literal nibble/E8M0 reading", maxerr(deq, _direct_dequant(packed, scale)), 0.0,
           "compressed-tensors layout, by hand")
    rel = ((deq - w).abs() / w.abs().reshape(O, I // 32, 32).amax(-1).repeat_interleave(32, 1).clamp_min(1e-30)).max()
    record("MXFP4 quantise error / group max (bound 1/4: E2M1 half-step)", float(rel), 0.25, "OCP MX bound")
    try:
        if "/tmp/ctpkg" not in sys.path and os.path.isdir("/tmp/ctpkg"):
            sys.path.append("/tmp/ctpkg")
        from compressed_tensors.compressors.mx_utils import decompress_mx_scale
        from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    except Exception as e:                                                      # noqa: BLE001
        print(f"  (compressed-tensors not importable, skipped: {e})")
        return
    ct = unpack_fp4_from_uint8(packed, O, I, dtype=torch.float32) * \
        decompress_mx_scale(scale).float().repeat_interleave(32, 1)
    record("MXFP4 dequant", maxerr(deq, ct), 0.0, "compressed-tensors unpack_fp4_from_uint8 + decompress_mx_scale")
    vals = deq / decompress_mx_scale(scale).float().repeat_interleave(32, 1)
    record("MXFP4 packing (bytes differing)", float((pack_fp4_to_uint8(vals) != packed).sum()), 0,
           "compressed-tensors pack_fp4_to_uint8")


# ---------------------------------------------------------------------------------------------------------------
# The committed goldens: metadata, and the reference reproduces them from the saved checkpoint


def test_goldens():
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file
    root = os.path.join(HERE, "..", "..", "tests", "golden")
    for name in ("k3-a", "k3-b", "k31-a", "k31-b"):
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        with safe_open(os.path.join(d, "golden.safetensors"), "pt") as f:
            meta = f.metadata()
        with open(os.path.join(d, "config.json"), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        assert meta["magic"] == "lunar-golden" and meta["version"] == "1" and meta["config_sha256"] == sha
        W, c = R.load_dir(d)
        g = load_file(os.path.join(d, "golden.safetensors"))
        pre, dec = R.run_golden(W, c, g["prompt_ids"].long(), g["decode_ids"].long())
        record(f"golden {name}: reference reproduces prefill+decode logits",
               max(maxerr(pre, g["prefill_logits"]), maxerr(dec, g["decode_logits"])), 0.0, "itself (determinism)")


# ---------------------------------------------------------------------------------------------------------------


def main():
    tests = [test_kda_gate, test_kda_kernels, test_kda_layer, test_attnres, test_mla, test_router_and_mlp,
             test_indexer, test_mxfp4, test_goldens]
    failed = 0
    for t in tests:
        try:
            t()
        except AssertionError as e:
            failed += 1
            print("FAIL", t.__name__, e)
    w = max(len(r[0]) for r in RESULTS)
    print(f"\n{'check':<{w}}  {'max error':>10}  {'tol':>7}  pinned to")
    for name, err, tol, against in RESULTS:
        print(f"{name:<{w}}  {err:10.3e}  {tol:7.2g}  {against}")
    print(f"\n{len(RESULTS)} checks, {failed} failing tests")
    return failed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
