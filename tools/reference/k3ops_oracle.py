#!/usr/bin/env python3
"""External oracles for the K3 CPU ops: writes tests/data/k3ops_oracle.safetensors (read by
tests/test_ops_oracle.c).

  attnres.*  fla's fla/ops/attnres/naive.py::naive_attnres (flash-linear-attention 0.6.0), fp32,
             scale 1, rms_eps 1e-5, with output_rms_weight (K3's fused out-norm).
  idx.*      transformers' DeepseekV32Indexer.forward (transformers 5.x): raw wq_b output, wk output
             (before k_norm), k_norm weight/bias, weights_proj output, the NeoX cos/sin inputs and the
             returned top-k indices. The C test re-derives the indices with op_layernorm,
             op_rope_neox and op_dsa_indexer (fp32 mode, no Hadamard/FP8: transformers skips both).

Usage: pip install flash-linear-attention fla-core; python3 tools/reference/k3ops_oracle.py
Deterministic (torch.manual_seed); rerun only when the oracles change.
"""
import importlib.util
import os
import sys

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden", "k3ops_oracle.safetensors")


def load_fla_naive():
    # Import the one file, not the fla package (whose __init__ pulls in triton kernels).
    spec = importlib.util.find_spec("fla")
    path = os.path.join(os.path.dirname(spec.origin), "ops", "attnres", "naive.py")
    s = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    return m.naive_attnres


def attnres(t):
    naive_attnres = load_fla_naive()
    S, n, D = 5, 3, 67
    v = [torch.randn(n, D) * (0.3 + 0.8 * i) for i in range(S)]
    p = torch.randn(D)
    r = torch.rand(D) + 0.5
    on = torch.rand(D) + 0.5
    o = naive_attnres(p, v, r, output_rms_weight=on, rms_eps=1e-5)
    m = naive_attnres(p, v, r, output_rms_weight=None, rms_eps=1e-5)
    t["attnres.src"] = torch.stack(v).contiguous()
    t["attnres.proj"], t["attnres.norm"], t["attnres.out_norm"] = p, r, on
    t["attnres.out"], t["attnres.mix"] = o.contiguous(), m.contiguous()


def indexer(t):
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as M
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

    H, nh, d, rot, qr, topk, T = 48, 4, 32, 16, 24, 6, 13
    cfg = DeepseekV32Config(hidden_size=H, index_n_heads=nh, index_head_dim=d, qk_rope_head_dim=rot,
                            index_topk=topk, q_lora_rank=qr)
    ix = M.DeepseekV32Indexer(cfg, 0).float().eval()
    with torch.no_grad():
        ix.k_norm.weight.uniform_(0.5, 1.5)
        ix.k_norm.bias.uniform_(-0.5, 0.5)
        x = torch.randn(1, T, H)
        q_resid = torch.randn(1, T, qr)
        inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        pos = torch.arange(T, dtype=torch.float64)
        ang = torch.outer(pos, inv)
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().float()[None], emb.sin().float()[None]
        mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        idx = ix(x, q_resid, (cos, sin), mask, None, cache=None)
        t["idx.q"] = ix.wq_b(q_resid)[0].contiguous()               # [T, nh*d]
        t["idx.k_pre"] = ix.wk(x)[0].contiguous()                   # [T, d]
        t["idx.k_norm.weight"], t["idx.k_norm.bias"] = ix.k_norm.weight.clone(), ix.k_norm.bias.clone()
        t["idx.w"] = (ix.weights_proj(x)[0] * nh ** -0.5 * d ** -0.5).contiguous()  # [T, nh]
        t["idx.inv_freq"] = inv.float()
        t["idx.topk"] = idx[0].to(torch.int32).contiguous()         # [T, min(topk, T)]


def main():
    torch.manual_seed(1234)
    t = {}
    attnres(t)
    indexer(t)
    save_file({k: v.contiguous() for k, v in t.items()}, OUT,
              metadata={"generator": "tools/reference/k3ops_oracle.py",
                        "fla": "flash-linear-attention naive_attnres", "transformers": __import__("transformers").__version__})
    print("wrote", os.path.normpath(OUT), file=sys.stderr)


if __name__ == "__main__":
    main()
