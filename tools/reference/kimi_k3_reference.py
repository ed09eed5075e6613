#!/usr/bin/env python3
"""Plain fp32 PyTorch reference of the Kimi-K3 / Kimi-K3.1 Pro text model, written from the spec.

    reference/k3_spec.md  sections 1-7 (AttnRes, KDA with bounded gate + full-rank g_proj, gated MLA-NoPE,
                          latent MoE + SiTU + sigmoid/noaux router, MXFP4 experts)
    SPEC.md section 1.1   the K3.1 DSA indexer (Hadamard, FP8 e4m3 with power-of-two scales, ReLU scores,
                          top-k with ties to the lower position) restricting MLA

Everything is fp32 (bf16 checkpoint weights are widened once; MXFP4 experts are dequantised exactly). The model is
functional: weights live in a dict {checkpoint name: fp32 tensor}, so the same code reads a saved checkpoint
directory (`load_dir`) or a freshly generated state dict.

Paths:
  * prefill (T > 1): KDA uses the chunked (WY / UT-transform) form, chunk 64, written here from the recurrence
    (own transcription; pinned to fla's naive_chunk_kda in test_reference.py). MLA uses the expanded (MHA) form.
  * decode (T == 1 with a cache): KDA uses the token recurrence (own transcription; pinned to fla's
    naive_recurrent_kda), conv state = last K-1 pre-conv inputs, MLA attends over the cached normalised latent
    [c | kpe] (absorbed form), the indexer over the cached FP8 index keys.

This file imports nothing outside torch: test_reference.py pins every piece to outside code.
"""
import json
import math
import os

import torch
import torch.nn.functional as F

PFX = "language_model.model."
KDA_CHUNK = 64

# ------------------------------------------------------------------------------------------------------------------
# Config


class Cfg:
    """The keys of text_config the model reads (k3_spec 1.2, SPEC 1.1)."""

    def __init__(self, cfg_json):
        t = cfg_json.get("text_config", cfg_json)
        lac = t["linear_attn_config"]
        self.D = t["hidden_size"]
        self.V = t["vocab_size"]
        self.L = t["num_hidden_layers"]
        self.eps = t["rms_norm_eps"]
        self.nh = t["num_attention_heads"]
        self.q_lora = t["q_lora_rank"]
        self.kv_lora = t["kv_lora_rank"]
        self.nope = t["qk_nope_head_dim"]
        self.rope = t["qk_rope_head_dim"]
        self.vd = t["v_head_dim"]
        self.kda_h = lac["num_heads"]
        self.kda_d = lac["head_dim"]
        self.conv_k = lac.get("short_conv_kernel_size", 4)
        self.lower_bound = lac["gate_lower_bound"]
        self.mla_layers = [n - 1 for n in lac["full_attn_layers"]]   # 1-based in the config
        self.kda_layers = [n - 1 for n in lac["kda_layers"]]
        assert sorted(self.mla_layers + self.kda_layers) == list(range(self.L))
        self.first_dense = t["first_k_dense_replace"]
        self.moe_freq = t.get("moe_layer_freq", 1)
        self.dense_inter = t["intermediate_size"]
        assert t["hidden_act"] == "situ"
        self.beta = t["activation_situ_beta"]
        self.beta_l = t.get("activation_situ_linear_beta") or 0.0
        self.E = t["num_experts"]
        self.topk = t["num_experts_per_token"]
        self.n_shared = t.get("num_shared_experts", 0)
        self.moe_inter = t["moe_intermediate_size"]
        self.lat = t["routed_expert_hidden_size"]
        self.lat_norm = t.get("latent_moe_use_norm", True)
        self.renorm = t.get("moe_renormalize", True)
        assert t.get("moe_router_activation_func", "sigmoid") == "sigmoid"
        assert t.get("num_expert_group", 1) == 1 and t.get("topk_group", 1) == 1
        self.scaling = t.get("routed_scaling_factor", 1.0)
        self.attn_res = t["attn_res_block_size"]
        self.idx_topk = t.get("index_topk", 0) or 0
        self.idx_h = t.get("index_n_heads", 0)
        self.idx_d = t.get("index_head_dim", 0)
        assert not t.get("index_rope", False), "index_rope=true is not implemented (K3.1 uses false)"

    def is_mla(self, n):
        return n in self.mla_layers

    def is_dense(self, n):
        return n < self.first_dense or (n % self.moe_freq) != 0


# ------------------------------------------------------------------------------------------------------------------
# Elementary ops (k3_spec notation; RMSNorm = x (mean x^2 + eps)^-1/2 * w, no 1+w)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layernorm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def situ(g, u, beta, beta_l):
    """SiTU-GLU (k3_spec 6.1): beta tanh(g/beta) sigmoid(g) * beta_l tanh(u/beta_l); u unchanged when beta_l = 0."""
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return a * (beta_l * torch.tanh(u / beta_l) if beta_l else u)


def mlp(x, wg, wu, wd, beta, beta_l):
    return situ(x @ wg.t(), x @ wu.t(), beta, beta_l) @ wd.t()


def attnres_mix(cands, proj, norm, out_norm, eps):
    """k3_spec 3.2: softmax over candidates of RMSNorm(v_i; norm) . proj, weighted sum of the raw v_i, out-norm."""
    v = torch.stack(cands, 0)                                  # [n, T, D]
    score = (rmsnorm(v, norm, eps) * proj.reshape(-1)).sum(-1)  # [n, T]
    a = torch.softmax(score, dim=0)
    m = (a[..., None] * v).sum(0)
    return rmsnorm(m, out_norm, eps)


# ---- MXFP4 (k3_spec 2.2, compressed-tensors mxfp4-pack-quantized) -------------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_dequant(packed, scale):
    """W[r, c] = E2M1(nibble(r, c)) * 2^(scale[r, c/32] - 127); column 2j = low nibble of packed[r, j]."""
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    O, half = packed.shape
    assert scale.shape == (O, half * 2 // 32) and not bool((scale == 255).any())
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], -1).reshape(O, 2 * half)
    s = torch.pow(2.0, scale.to(torch.float64) - 127.0).repeat_interleave(32, dim=1)
    return (E2M1.double()[codes] * s).float()                 # exact: 3 significant bits times a power of two


def mxfp4_quantize(w):
    """fp32 [O, I] -> (packed u8 [O, I/2], scale u8 [O, I/32]). Same rule as src/backend/cpu/mxfp4.c
    (OCP MX: shared exponent floor(log2 amax) - 2, E2M1 round to nearest, ties to the even code, saturate at 6)."""
    O, I = w.shape
    assert I % 32 == 0
    g = w.reshape(O, I // 32, 32).double()
    amax = g.abs().amax(-1)
    _, fe = torch.frexp(amax)
    e = torch.where(amax > 0, fe - 3, torch.full_like(fe, -127)).clamp(-127, 127)
    a = g / torch.pow(2.0, e.double())[..., None]
    m = a.abs()
    code = ((m > 0.25).long() + (m >= 0.75).long() + (m > 1.25).long() + (m >= 1.75).long()
            + (m > 2.5).long() + (m >= 3.5).long() + (m > 5.0).long())
    code = code | (torch.signbit(a).long() << 3)
    code = code.reshape(O, I)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, (e + 127).to(torch.uint8)


# ---- FP8 e4m3 with a power-of-two scale, Hadamard (SPEC 1.1; DeepSeek-V3.2 act_quant ue8m0) ----------------------


def fp8_quant_pow2(x):
    """Rows of x (last dim = one group): amax = max(|x|, 1e-4); s = 2^ceil(log2(amax/448)) (fp32 division, then the
    exponent-bit rule of kernel.py); q = e4m3(clamp(x/s, +-448)), round to nearest even. Returns (q as fp32, s)."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = (amax / 448.0).float()
    bits = s.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = torch.pow(2.0, e.double()).float()
    q = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return q, scale


def hadamard(x):
    """Orthonormal Sylvester Walsh-Hadamard over the last dim (butterfly (a+b, a-b), natural order) times n^-1/2."""
    n = x.shape[-1]
    assert n & (n - 1) == 0
    y = x.clone()
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], -2).reshape(x.shape)
        h *= 2
    return y * (1.0 / math.sqrt(n))


# ------------------------------------------------------------------------------------------------------------------
# KDA (k3_spec 4)


def kda_gate(f, A_log, dt_bias, H, lower_bound):
    """gk[h,i] = lb * sigmoid(exp(A_log[h]) * (f[h*d+i] + dt_bias[h*d+i])); A_log is 1-D, first H entries real."""
    d = f.shape[-1] // H
    g = (f + dt_bias).reshape(*f.shape[:-1], H, d)
    return lower_bound * torch.sigmoid(torch.exp(A_log[:H]).reshape(H, 1) * g)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, S):
    """Token recurrence (k3_spec 4.6). q,k,g [T,H,dk], v [T,H,dv], beta [T,H], S [H,dk,dv] (k-major, as fla).
    q is already scaled by dk^-1/2. Returns o [T,H,dv], S."""
    o = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][..., None] * u[:, None, :]
        o.append(torch.einsum("hk,hkv->hv", q[t], S))
    return torch.stack(o), S


def kda_chunked(q, k, v, g, beta, S, C=KDA_CHUNK):
    """Chunked form of the same recurrence (UT transform per chunk; last chunk may be partial). Within a chunk with
    state S0 and cumulative log-decay G_i = sum_{j<=i} g_j:
        u = (I + A)^-1 beta (v - (k * e^G) S0),  A[i,j] = beta_i sum_c k_i[c] k_j[c] e^(G_i[c]-G_j[c])  (j < i)
        o_i = (q_i * e^G_i) S0 + sum_{j<=i} (sum_c q_i[c] k_j[c] e^(G_i[c]-G_j[c])) u_j
        S' = e^G_last * S0 + sum_j (k_j * e^(G_last-G_j)) u_j^T
    Only differences of G are exponentiated (never 1/e^G), so nothing overflows."""
    T = q.shape[0]
    out = []
    for c0 in range(0, T, C):
        qc, kc, vc, bc = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C], beta[c0:c0 + C]
        G = g[c0:c0 + C].cumsum(0)                                    # [n,H,dk]
        n = qc.shape[0]
        D = torch.exp(G[:, None] - G[None, :])                        # [i,j,H,dk]; only j<=i used
        tri = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
        A = torch.einsum("ihc,jhc,ijhc->hij", kc, kc, D.masked_fill(~tri[..., None, None], 0.0))
        A = A * bc.t()[:, :, None]                                    # beta_i
        rhs = bc.t()[..., None] * (vc.transpose(0, 1) - torch.einsum("ihc,hcv->hiv", kc * torch.exp(G), S))
        eye = torch.eye(n).expand_as(A)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)   # [H,n,dv]
        incl = torch.tril(torch.ones(n, n, dtype=torch.bool))
        Aqk = torch.einsum("ihc,jhc,ijhc->hij", qc, kc, D.masked_fill(~incl[..., None, None], 0.0))
        o = torch.einsum("ihc,hcv->ihv", qc * torch.exp(G), S) + torch.einsum("hij,hjv->ihv", Aqk, u)
        out.append(o)
        GL = G[-1]                                                    # [H,dk]
        S = torch.exp(GL)[..., None] * S + torch.einsum("jhc,hjv->hcv", kc * torch.exp(GL[None] - G), u)
    return torch.cat(out, 0), S


def kda_layer(x, W, p, c, st):
    """x [T,D] (AttnRes output after input_layernorm). st: dict with 'conv' [K-1, 3HD] and 'S' [H,dk,dv] or empty."""
    T = x.shape[0]
    H, d, K = c.kda_h, c.kda_d, c.conv_k
    HD = H * d
    qkv = torch.cat([x @ W[p + "q_proj.weight"].t(), x @ W[p + "k_proj.weight"].t(), x @ W[p + "v_proj.weight"].t()], -1)
    prev = st.get("conv", torch.zeros(K - 1, 3 * HD))
    seq = torch.cat([prev, qkv], 0)                                   # seq[j] = input at time j-(K-1)
    wconv = torch.cat([W[p + f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"], 0)   # [3HD, K]
    conv = sum(wconv[:, j] * seq[j:j + T] for j in range(K))
    conv = F.silu(conv)
    st["conv"] = seq[-(K - 1):].clone()
    q, k, v = conv.split(HD, -1)
    q = l2norm(q.reshape(T, H, d)) * d ** -0.5
    k = l2norm(k.reshape(T, H, d))
    v = v.reshape(T, H, d)
    f = (x @ W[p + "f_a_proj.weight"].t()) @ W[p + "f_b_proj.weight"].t()
    gk = kda_gate(f, W[p + "A_log"], W[p + "dt_bias"], H, c.lower_bound)
    beta = torch.sigmoid(x @ W[p + "b_proj.weight"].t())
    S = st.get("S", torch.zeros(H, d, d))
    if T == 1 and "S" in st:
        o, S = kda_recurrent(q, k, v, gk, beta, S)
    else:
        o, S = kda_chunked(q, k, v, gk, beta, S)
    st["S"] = S
    gate = torch.sigmoid(x @ W[p + "g_proj.weight"].t()).reshape(T, H, d)
    y = rmsnorm(o, W[p + "o_norm.weight"], c.eps) * gate
    return y.reshape(T, HD) @ W[p + "o_proj.weight"].t()


# ------------------------------------------------------------------------------------------------------------------
# DSA indexer (SPEC 1.1) and gated MLA (k3_spec 5)


def indexer_qkw(x, cq, W, p, c):
    """Per-token index queries (rotated, before quantisation) [T,nh,d], key [T,d], head weights [T,nh]."""
    nh, d = c.idx_h, c.idx_d
    iq = (cq @ W[p + "indexer.wq_b.weight"].t()).reshape(-1, nh, d)
    ik = layernorm(x @ W[p + "indexer.wk.weight"].t(), W[p + "indexer.k_norm.weight"], W[p + "indexer.k_norm.bias"], 1e-6)
    w = (x @ W[p + "indexer.weights_proj.weight"].t()) * nh ** -0.5 * d ** -0.5
    return hadamard(iq), hadamard(ik), w


def index_scores(iq, w, k8, ks, pos0, fp8=True):
    """I(t,s) = sum_h w_h ReLU(iq_h . ik_s) for s <= pos0+t (else -inf); FP8: iq per head, keys given quantised.
    Accumulated in float64 (dots of e4m3 values are exact there, as in src/backend/cpu/indexer.c)."""
    T = iq.shape[0]
    if fp8:
        q8, sq = fp8_quant_pow2(iq)                                   # [T,nh,d], [T,nh,1]
        wq = w.double() * sq[..., 0].double()
    else:
        q8, wq = iq, w.double()
    dots = torch.einsum("thd,sd->ths", q8.double(), k8.double())      # [T,nh,S]
    I = (wq[..., None] * dots.clamp_min(0)).sum(1) * ks.double().reshape(1, -1)   # [T,S]
    n = k8.shape[0]
    vis = torch.arange(n)[None, :] <= (pos0 + torch.arange(T))[:, None]
    return I.float().masked_fill(~vis, float("-inf"))    # fp32 scores, as the C op stores them


def topk_select(I, pos0, topk):
    """Boolean [T,S] mask of S(t): top-k by score, ties to the lower position; all s <= t when t+1 <= topk."""
    T, n = I.shape
    mask = torch.zeros(T, n, dtype=torch.bool)
    for t in range(T):
        m = pos0 + t + 1
        if m <= topk:
            mask[t, :m] = True
            continue
        row = I[t, :m]
        order = sorted(range(m), key=lambda s: (-float(row[s]), s))
        mask[t, order[:topk]] = True
    return mask


def selection_margin(I, pos0, topk):
    """(min over queries with t+1 > topk of (k-th largest score - (k+1)-th largest), number of exact-zero ties).
    A boundary between two scores that are exactly 0 (every ReLU term zero: exact, since the e4m3 dots are exact)
    is not a near-tie: the lower position wins deterministically. It is counted, not included in the minimum."""
    best, zero_ties = float("inf"), 0
    for t in range(I.shape[0]):
        m = pos0 + t + 1
        if m > topk:
            srt = I[t, :m].sort(descending=True)[0]
            a, b = float(srt[topk - 1]), float(srt[topk])
            if a == 0.0 and b == 0.0:
                zero_ties += 1
            else:
                best = min(best, a - b)
    return best, zero_ties


def mla_layer(x, W, p, c, st, sparse=True, probe=None):
    """Gated MLA-NoPE, optionally restricted by the DSA indexer. st: 'lat' [S, kv_lora], 'kpe' [S, rope],
    'k8' [S, d], 'ks' [S] (FP8 index keys and scales)."""
    T = x.shape[0]
    nh, nope, rope, vd, r = c.nh, c.nope, c.rope, c.vd, c.kv_lora
    cq = rmsnorm(x @ W[p + "q_a_proj.weight"].t(), W[p + "q_a_layernorm.weight"], 1e-6)
    q = (cq @ W[p + "q_b_proj.weight"].t()).reshape(T, nh, nope + rope)
    kv = x @ W[p + "kv_a_proj_with_mqa.weight"].t()
    lat = rmsnorm(kv[:, :r], W[p + "kv_a_layernorm.weight"], 1e-6)
    kpe = kv[:, r:]
    pos0 = st["lat"].shape[0] if "lat" in st else 0
    st["lat"] = torch.cat([st["lat"], lat]) if "lat" in st else lat
    st["kpe"] = torch.cat([st["kpe"], kpe]) if "kpe" in st else kpe
    Sn = st["lat"].shape[0]
    allowed = torch.arange(Sn)[None, :] <= (pos0 + torch.arange(T))[:, None]     # causal
    if c.idx_topk:
        iq, ik, w = indexer_qkw(x, cq, W, p, c)
        k8, ks = fp8_quant_pow2(ik)
        st["k8"] = torch.cat([st["k8"], k8]) if "k8" in st else k8
        st["ks"] = torch.cat([st["ks"], ks[:, 0]]) if "ks" in st else ks[:, 0]
        if sparse:
            I = index_scores(iq, w, st["k8"], st["ks"], pos0)
            sel = topk_select(I, pos0, c.idx_topk)
            if probe is not None:
                probe.index(iq, ik, w, st, I, sel, pos0, c.idx_topk)
            allowed = allowed & sel
    wkvb = W[p + "kv_b_proj.weight"].reshape(nh, nope + vd, r)
    scale = (nope + rope) ** -0.5
    if T == 1 and pos0 > 0:
        # absorbed (latent) form over the cache (k3_spec 5, "Absorbed decode form")
        qlat = torch.einsum("thn,hnr->thr", q[..., :nope], wkvb[:, :nope])
        s = (torch.einsum("thr,sr->ths", qlat, st["lat"]) + torch.einsum("thp,sp->ths", q[..., nope:], st["kpe"])) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        olat = torch.einsum("ths,sr->thr", torch.softmax(s, -1), st["lat"])
        a = torch.einsum("thr,hvr->thv", olat, wkvb[:, nope:])
    else:
        kvx = torch.einsum("sr,hnr->shn", st["lat"], wkvb)                # [S,nh,nope+vd]
        kn, vv = kvx[..., :nope], kvx[..., nope:]
        s = (torch.einsum("thn,shn->ths", q[..., :nope], kn) + torch.einsum("thp,sp->ths", q[..., nope:], st["kpe"])) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        a = torch.einsum("ths,shv->thv", torch.softmax(s, -1), vv)
    a = a.reshape(T, nh * vd)
    if p + "g_proj.weight" in W:                                          # K3 output gate (absent only in pin tests)
        a = a * torch.sigmoid(x @ W[p + "g_proj.weight"].t())
    return a @ W[p + "o_proj.weight"].t()


# ------------------------------------------------------------------------------------------------------------------
# FFN: router, latent MoE (k3_spec 6)


def router(x, wr, bias, topk, renorm, scaling):
    """sigmoid scores; selection by scores + e_score_correction_bias; weights from the unbiased scores."""
    s = torch.sigmoid(x @ wr.t())
    choice = s + bias
    idx = torch.topk(choice, topk, dim=-1).indices
    wts = s.gather(-1, idx)
    if renorm:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return idx, wts * scaling, choice


def moe(x, W, p, c, probe=None):
    idx, wts, choice = router(x, W[p + "gate.weight"], W[p + "gate.e_score_correction_bias"], c.topk, c.renorm, c.scaling)
    if probe is not None:
        probe.route(choice, c.topk)
    z = x @ W[p + "routed_expert_down_proj.weight"].t()                 # [T, lat]
    y = torch.zeros_like(z)
    for t in range(x.shape[0]):
        for j in range(c.topk):
            e = int(idx[t, j])
            q = f"{p}experts.{e}."
            y[t] += wts[t, j] * mlp(z[t], W[q + "w1.weight"], W[q + "w3.weight"], W[q + "w2.weight"], c.beta, c.beta_l)
    if c.lat_norm:
        y = rmsnorm(y, W[p + "routed_expert_norm.weight"], c.eps)
    routed = y @ W[p + "routed_expert_up_proj.weight"].t()
    sh = 0.0
    if c.n_shared:
        s = p + "shared_experts."
        sh = mlp(x, W[s + "gate_proj.weight"], W[s + "up_proj.weight"], W[s + "down_proj.weight"], c.beta, c.beta_l)
    return routed + sh


# ------------------------------------------------------------------------------------------------------------------
# Model (k3_spec 3)


def new_cache(c):
    return [dict() for _ in range(c.L)]


def forward(W, c, ids, cache=None, sparse=True, probe=None):
    """ids: LongTensor [T]. cache: list of per-layer dicts (None = fresh sequence, not kept). Returns logits [T, V].
    With a cache from a previous call, T == 1 runs the decode path (KDA recurrence, absorbed MLA)."""
    if cache is None:
        cache = new_cache(c)
    h0 = W[PFX + "embed_tokens.weight"][ids]
    blocks, P = [], h0
    S = c.attn_res
    for n in range(c.L):
        p = f"{PFX}layers.{n}."
        a = attnres_mix(blocks + [P], W[p + "self_attention_res_proj.weight"], W[p + "self_attention_res_norm.weight"],
                        W[p + "input_layernorm.weight"], c.eps)
        if n % S == 0:
            blocks.append(P)
            P = None
        if c.is_mla(n):
            o = mla_layer(a, W, p + "self_attn.", c, cache[n], sparse=sparse, probe=probe)
        else:
            o = kda_layer(a, W, p + "self_attn.", c, cache[n])
        P = o if P is None else P + o
        m = attnres_mix(blocks + [P], W[p + "mlp_res_proj.weight"], W[p + "mlp_res_norm.weight"],
                        W[p + "post_attention_layernorm.weight"], c.eps)
        if c.is_dense(n):
            f = mlp(m, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"],
                    c.beta, c.beta_l)
        else:
            f = moe(m, W, p + "block_sparse_moe.", c, probe=probe)
        P = P + f
    y = attnres_mix(blocks + [P], W[PFX + "output_attn_res_proj.weight"], W[PFX + "output_attn_res_norm.weight"],
                    W[PFX + "norm.weight"], c.eps)
    return y @ W["language_model.lm_head.weight"].t()


def widen(state_dict):
    """Checkpoint tensors -> fp32 weights; MXFP4 experts (weight_packed + weight_scale) dequantised to .weight."""
    W = {}
    for k, t in state_dict.items():
        if k.endswith(".weight_packed"):
            base = k[: -len(".weight_packed")]
            W[base + ".weight"] = mxfp4_dequant(t, state_dict[base + ".weight_scale"])
        elif k.endswith(".weight_scale"):
            continue
        else:
            W[k] = t.float()
    return W


def load_dir(path):
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        c = Cfg(json.load(f))
    return widen(load_file(os.path.join(path, "model.safetensors"))), c


def run_golden(W, c, prompt, dec, sparse=True, probe=None):
    """Prefill (chunked KDA) + teacher-forced decode (recurrent KDA, one token at a time)."""
    with torch.no_grad():
        cache = new_cache(c)
        prefill = forward(W, c, prompt, cache, sparse=sparse, probe=probe)
        dl = [forward(W, c, dec[i:i + 1], cache, sparse=sparse, probe=probe)[0] for i in range(len(dec))]
        return prefill, torch.stack(dl)


if __name__ == "__main__":
    import sys
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    d = sys.argv[1]
    W, c = load_dir(d)
    g = load_file(os.path.join(d, "golden.safetensors"))
    pre, dec = run_golden(W, c, g["prompt_ids"].long(), g["decode_ids"].long())
    print("prefill max diff", float((pre - g["prefill_logits"]).abs().max()),
          "decode max diff", float((dec - g["decode_logits"]).abs().max()))
