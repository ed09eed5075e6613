#!/usr/bin/env python3
"""Golden-file generator for lunar (Kimi Linear), using Hugging Face transformers' KimiLinearForCausalLM.

Builds tiny random Kimi Linear models, saves each as a model directory with the REAL hub checkpoint tensor names
(moonshotai/Kimi-Linear-48B-A3B-Instruct naming, not transformers' internal module names), proves the directory
round-trips through `KimiLinearForCausalLM.from_pretrained` (which applies transformers' conversion mapping), and
records float32 reference logits (chunked prefill + recurrent cached decode) in a golden safetensors file.

    python3 tools/golden/make_golden.py --out tests/golden          # tiny-a, tiny-b, tiny-c
    python3 tools/golden/make_golden.py --bundled                   # models/kimi-linear-tiny + its golden

Everything is seeded; reruns produce byte-identical files (same transformers/torch versions).
"""
import argparse
import hashlib
import json
import math
import os
import sys

import torch

torch.set_num_threads(1)

import safetensors
import transformers
from safetensors.torch import load_file, save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.kimi_linear import modeling_kimi_linear as mkl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from st_writer import save_st  # noqa: E402

CMD_GOLDEN = "python3 tools/golden/make_golden.py --out tests/golden"
CMD_BUNDLED = "python3 tools/golden/make_golden.py --bundled"

# ----------------------------------------------------------------------------------------------------------------
# Model specs. Layer lists are 1-based, as in the published config.json.
# probe_kv_latent / probe_v: scale the MLA latent / KDA values down so the RMSNorm eps of kv_a_layernorm (1e-6) and
# o_norm (rms_norm_eps) visibly affect the logits (a wrong eps in the C engine then fails the test).
SPECS = {
    "tiny-a": dict(
        seed=1001, vocab=311, hidden=48, layers=4, kda_heads=3, kda_dk=16, conv_k=4,
        mla_heads=3, nope=8, rope=4, v_dim=8, kv_lora=12,
        experts=8, topk=2, shared=1, moe_inter=20, dense_inter=40, first_k_dense=1,
        kda_layers=[1, 2, 4], full_layers=[3], n_group=1, topk_group=1, renorm=True, scaling=2.446,
        eps=1e-5, dtype="float32", prompt_len=83, n_decode=5, probe_kv_latent=True, probe_v=False),
    "tiny-b": dict(
        seed=2002, vocab=257, hidden=40, layers=5, kda_heads=2, kda_dk=24, conv_k=4,
        mla_heads=5, nope=6, rope=2, v_dim=10, kv_lora=14,
        experts=12, topk=3, shared=2, moe_inter=12, dense_inter=56, first_k_dense=2,
        kda_layers=[2, 3, 4], full_layers=[1, 5], n_group=1, topk_group=1, renorm=True, scaling=2.446,
        eps=1e-5, dtype="bfloat16", prompt_len=97, n_decode=5, probe_kv_latent=False, probe_v=True),
    "tiny-c": dict(
        seed=3003, vocab=300, hidden=36, layers=3, kda_heads=1, kda_dk=12, conv_k=3,
        mla_heads=2, nope=10, rope=6, v_dim=6, kv_lora=9,
        experts=6, topk=1, shared=0, moe_inter=10, dense_inter=24, first_k_dense=0,
        kda_layers=[1, 3], full_layers=[2], n_group=3, topk_group=2, renorm=False, scaling=1.5,
        eps=1e-6, dtype="float32", prompt_len=71, n_decode=5, probe_kv_latent=False, probe_v=False),
}
BUNDLED = dict(
    seed=4004, vocab=163840, hidden=32, layers=4, kda_heads=2, kda_dk=16, conv_k=4,
    mla_heads=2, nope=16, rope=8, v_dim=16, kv_lora=16,
    experts=8, topk=2, shared=1, moe_inter=32, dense_inter=128, first_k_dense=1,
    kda_layers=[1, 2, 3], full_layers=[4], n_group=1, topk_group=1, renorm=True, scaling=2.446,
    eps=1e-5, dtype="bfloat16", prompt_len=6, n_decode=2, probe_kv_latent=False, probe_v=False,
    real_special_ids=True)

# In BF16 checkpoints these stay float32 (transformers' _keep_in_fp32_modules_strict = e_score_correction_bias,
# gate.weight (router), dt_bias; plus A_log, which vLLM also keeps in fp32). Everything else is BF16.
MIN_MARGIN = 1e-4
FP32_KEEP_SUFFIXES = (".dt_bias", ".A_log", ".gate.e_score_correction_bias", "block_sparse_moe.gate.weight")


def hub_config(s):
    """config.json with the same key set as the published Kimi-Linear-48B-A3B-Instruct config (kda.md section 4)."""
    V = s["vocab"]
    if s.get("real_special_ids"):
        bos, eos, pad = 163584, 163586, 163839
    else:
        bos, eos, pad = V - 4, V - 3, V - 1
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": bos,
        "dtype": s["dtype"],
        "eos_token_id": eos,
        "first_k_dense_replace": s["first_k_dense"],
        "head_dim": s["hidden"] // s["mla_heads"],  # legacy, unused (real: 2304/32 = 72)
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["dense_inter"],
        "kv_lora_rank": s["kv_lora"],
        "linear_attn_config": {"full_attn_layers": s["full_layers"], "head_dim": s["kda_dk"],
                               "kda_layers": s["kda_layers"], "num_heads": s["kda_heads"],
                               "short_conv_kernel_size": s["conv_k"]},
        "mla_use_nope": True,
        "model_max_length": 1048576,
        "model_type": "kimi_linear",
        "moe_intermediate_size": s["moe_inter"],
        "moe_layer_freq": 1,
        "moe_renormalize": s["renorm"],
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": s["mla_heads"],
        "num_expert_group": s["n_group"],
        "num_experts": s["experts"],
        "num_experts_per_token": s["topk"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["mla_heads"],
        "num_nextn_predict_layers": 0,
        "num_shared_experts": s["shared"],
        "pad_token_id": pad,
        "q_lora_rank": None,
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "rms_norm_eps": s["eps"],
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": s["scaling"],
        "tie_word_embeddings": False,  # transformers' KimiLinear has _tied_weights_keys = {}: tying is unsupported
        "topk_group": s["topk_group"],
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": s["v_dim"],
        "vocab_size": V,
    }


def expected_hub_tensors(s):
    """Names and shapes the checkpoint must have, written independently from the hub naming list (not derived
    from transformers' module names)."""
    D, V, H, dk, K = s["hidden"], s["vocab"], s["kda_heads"], s["kda_dk"], s["conv_k"]
    nh, nope, rope, vd, r = s["mla_heads"], s["nope"], s["rope"], s["v_dim"], s["kv_lora"]
    E, I = s["experts"], s["moe_inter"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for n in range(s["layers"]):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        a = p + "self_attn."
        if (n + 1) in s["kda_layers"]:
            for x in "qkv":
                out[a + f"{x}_proj.weight"] = (H * dk, D)
                out[a + f"{x}_conv1d.weight"] = (H * dk, 1, K)
            out.update({a + "f_a_proj.weight": (dk, D), a + "f_b_proj.weight": (H * dk, dk), a + "dt_bias": (H * dk,),
                        a + "A_log": (1, 1, H, 1), a + "b_proj.weight": (H, D), a + "g_a_proj.weight": (dk, D),
                        a + "g_b_proj.weight": (H * dk, dk), a + "o_norm.weight": (dk,),
                        a + "o_proj.weight": (D, H * dk)})
        else:
            assert (n + 1) in s["full_layers"]
            out.update({a + "q_proj.weight": (nh * (nope + rope), D), a + "kv_a_proj_with_mqa.weight": (r + rope, D),
                        a + "kv_a_layernorm.weight": (r,), a + "kv_b_proj.weight": (nh * (nope + vd), r),
                        a + "o_proj.weight": (D, nh * vd)})
        if n < s["first_k_dense"]:
            Id = s["dense_inter"]
            out.update({p + "mlp.gate_proj.weight": (Id, D), p + "mlp.up_proj.weight": (Id, D),
                        p + "mlp.down_proj.weight": (D, Id)})
        else:
            m = p + "block_sparse_moe."
            out[m + "gate.weight"] = (E, D)
            out[m + "gate.e_score_correction_bias"] = (E,)
            for e in range(E):
                out[m + f"experts.{e}.w1.weight"] = (I, D)
                out[m + f"experts.{e}.w3.weight"] = (I, D)
                out[m + f"experts.{e}.w2.weight"] = (D, I)
            if s["shared"] > 0:
                Is = I * s["shared"]
                out.update({m + "shared_experts.gate_proj.weight": (Is, D), m + "shared_experts.up_proj.weight": (Is, D),
                            m + "shared_experts.down_proj.weight": (D, Is)})
    return out


def to_hub_state_dict(model, s):
    """transformers internal state_dict -> hub checkpoint names (inverse of conversion_mapping['kimi_linear'])."""
    sd = model.state_dict()
    out, used = {}, set()
    qkv = s["kda_heads"] * s["kda_dk"]
    for name, t in sd.items():
        t = t.detach().clone().contiguous()
        if ".self_attn.conv1d.weight" in name:
            base = name.replace("conv1d.weight", "")
            for i, x in enumerate("qkv"):
                out[base + f"{x}_conv1d.weight"] = t[i * qkv:(i + 1) * qkv].clone()
        elif ".self_attn.forget_gate." in name:
            out[name.replace(".forget_gate.", ".")] = t
        elif ".mlp.experts.gate_up_proj" in name:
            I = s["moe_inter"]
            base = name.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts.")
            for e in range(t.shape[0]):
                out[base + f"{e}.w1.weight"] = t[e, :I].clone()   # gate
                out[base + f"{e}.w3.weight"] = t[e, I:].clone()   # up
        elif ".mlp.experts.down_proj" in name:
            base = name.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts.")
            for e in range(t.shape[0]):
                out[base + f"{e}.w2.weight"] = t[e].clone()
        elif ".mlp.gate." in name or ".mlp.shared_experts." in name:
            if t.numel() == 0:
                continue  # num_shared_experts == 0: transformers builds a zero-size MLP; a real checkpoint has none
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[name] = t
    return out


def realistic_init(model, s, gen):
    """Seeded init with scales chosen so activations neither vanish nor explode and routing/gates vary."""
    D = s["hidden"]

    def normal(t, std):
        t.copy_(torch.randn(t.shape, generator=gen) * std)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue
            if name.endswith("embed_tokens.weight"):
                normal(p, 1.0)
            elif name == "lm_head.weight":
                normal(p, 1.0 / math.sqrt(D))               # logits std ~1 after the final RMSNorm
            elif "layernorm.weight" in name or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())  # FLA init
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus (FLA init)
            elif name.endswith("conv1d.weight"):
                normal(p, 0.5)
            elif name.endswith("experts.gate_up_proj"):
                normal(p, 1.0 / math.sqrt(p.shape[-1]))
            elif name.endswith("experts.down_proj"):
                normal(p, 0.7 / math.sqrt(p.shape[-1]))
            elif name.endswith("mlp.gate.weight"):
                normal(p, 1.0 / math.sqrt(D))
            elif p.dim() == 2:
                gain = 0.5 if (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")) else 1.0
                normal(p, gain / math.sqrt(p.shape[1]))
            else:
                raise RuntimeError(f"no init rule for {name}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.empty(b.shape).uniform_(-0.1, 0.1, generator=gen))
        for n, layer in enumerate(model.model.layers):
            att = layer.self_attn
            if s.get("probe_kv_latent") and isinstance(att, mkl.KimiLinearAttention):
                att.kv_a_proj_with_mqa.weight[: s["kv_lora"]] *= 0.003     # latent rms ~3e-3: eps 1e-6 matters
            if s.get("probe_v") and isinstance(att, mkl.KimiLinearDeltaAttention):
                att.v_proj.weight *= 0.004                                 # KDA output small: o_norm eps matters


def round_to_storage(model, s):
    """For BF16 checkpoints: round the in-memory fp32 weights to what the file holds, so torch computes in fp32 from
    exactly the stored (widened) values."""
    if s["dtype"] != "bfloat16":
        return
    hub = to_hub_state_dict(model, s)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.numel() == 0 or not t.is_floating_point():
                continue
            keep = any(name.replace(".forget_gate.", ".").replace(".mlp.gate.", ".block_sparse_moe.gate.")
                       .endswith(suf) for suf in FP32_KEEP_SUFFIXES)
            if not keep:
                t.copy_(t.to(torch.bfloat16).to(torch.float32))
    del hub


def storage_dtype(name, s):
    if s["dtype"] == "bfloat16" and not name.endswith(FP32_KEEP_SUFFIXES):
        return torch.bfloat16
    return torch.float32


class RouterProbe:
    """Records expert usage and the selection margins (distance of the k-th choice from the (k+1)-th, and of the
    last kept group from the first dropped one) so near-ties that would make the golden fragile are visible."""

    def __init__(self, model):
        self.handles, self.counts, self.min_margin, self.min_group_margin = [], {}, float("inf"), float("inf")
        self.active = True
        for n, layer in enumerate(model.model.layers):
            if isinstance(layer.mlp, mkl.KimiLinearMoE):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(n)))

    def _hook(self, n):
        def f(mod, inp, out):
            if not self.active:
                return
            x = inp[0].reshape(-1, mod.hidden_dim).float()
            scores = torch.sigmoid(x @ mod.weight.float().t())
            sc = scores + mod.e_score_correction_bias
            G = mod.num_group
            gs = sc.view(-1, G, mod.num_experts // G).topk(2, dim=-1)[0].sum(-1)
            if G > mod.topk_group:
                gsort = gs.sort(dim=-1, descending=True)[0]
                self.min_group_margin = min(self.min_group_margin,
                                            float((gsort[:, mod.topk_group - 1] - gsort[:, mod.topk_group]).min()))
            gidx = gs.topk(mod.topk_group, dim=-1)[1]
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
            emask = gmask.unsqueeze(-1).expand(-1, G, mod.num_experts // G).reshape(-1, mod.num_experts)
            sc = sc.masked_fill(~emask, float("-inf"))
            srt = sc.sort(dim=-1, descending=True)[0]
            k = mod.top_k
            if k < int(emask.sum(-1).min()):
                self.min_margin = min(self.min_margin, float((srt[:, k - 1] - srt[:, k]).min()))
            idx = out[2]
            c = self.counts.setdefault(n, torch.zeros(mod.num_experts, dtype=torch.long))
            c += torch.bincount(idx.reshape(-1), minlength=mod.num_experts)
        return f

    def close(self):
        for h in self.handles:
            h.remove()


def mem_sd_dtypes(model):
    return [t for t in model.state_dict().values()]


def run_reference(model, prompt, dec, probe=None):
    """prefill (chunk path, fills the cache) + teacher-forced single-token decode (recurrent path), and a full
    recompute over prompt+decode without a cache."""
    with torch.no_grad():
        out = model(input_ids=prompt[None], use_cache=True)
        prefill = out.logits[0].float().clone()
        cache = out.cache
        dl = []
        for t in dec.tolist():
            o = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = o.cache
            dl.append(o.logits[0, -1].float().clone())
        decode = torch.stack(dl)
        if probe is not None:
            probe.active = False
        full = model(input_ids=torch.cat([prompt, dec])[None], use_cache=False).logits[0].float()
    return prefill, decode, full


def build(name, s, model_dir, golden_path, command, extra_meta=None):
    print(f"=== {name} ===", flush=True)
    os.makedirs(model_dir, exist_ok=True)
    os.makedirs(os.path.dirname(golden_path), exist_ok=True)
    cfg_bytes = (json.dumps(hub_config(s), indent=2) + "\n").encode()
    with open(os.path.join(model_dir, "config.json"), "wb") as f:
        f.write(cfg_bytes)
    config = KimiLinearConfig.from_pretrained(model_dir)
    # layer schedule sanity: 1-based lists -> transformers' 0-based layer_types
    assert config.layer_types == ["full_attention" if (i + 1) in s["full_layers"] else "linear_attention"
                                  for i in range(s["layers"])], config.layer_types
    assert config.mlp_layer_types == ["dense" if i < s["first_k_dense"] else "sparse" for i in range(s["layers"])]

    torch.manual_seed(s["seed"])
    gen = torch.Generator().manual_seed(s["seed"])
    model = KimiLinearForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    realistic_init(model, s, gen)
    round_to_storage(model, s)

    hub = to_hub_state_dict(model, s)
    exp = expected_hub_tensors(s)
    got = {k: tuple(v.shape) for k, v in hub.items()}
    if got != exp:
        missing = sorted(set(exp) - set(got)); extra = sorted(set(got) - set(exp))
        bad = sorted(k for k in set(exp) & set(got) if exp[k] != got[k])
        raise SystemExit(f"hub naming mismatch: missing {missing[:8]} extra {extra[:8]} shape {bad[:8]}")
    hub = {k: v.to(storage_dtype(k, s)).contiguous() for k, v in sorted(hub.items())}
    st_path = os.path.join(model_dir, "model.safetensors")
    save_st(hub, st_path, {"format": "pt"})

    # Draw prompt/decode ids; redraw (deterministically) until no routing decision is a near-tie (top-k margin and
    # group margin >= MIN_MARGIN), so fp32 rounding differences in the C engine cannot flip an expert choice.
    hi = min(s["vocab"], 163584)  # bundled: stay below the special-token range
    for attempt in range(100):
        gen_p = torch.Generator().manual_seed(s["seed"] + 7 + 1000 * attempt)
        prompt = torch.randint(0, hi, (s["prompt_len"],), generator=gen_p)
        dec = torch.randint(0, hi, (s["n_decode"],), generator=gen_p)
        probe = RouterProbe(model)
        prefill, decode, full = run_reference(model, prompt, dec, probe)
        probe.close()
        if min(probe.min_margin, probe.min_group_margin) >= MIN_MARGIN:
            break
    else:
        raise SystemExit("no prompt without routing near-ties found")
    T = s["prompt_len"]
    d_pre = float((full[:T] - prefill).abs().max())
    d_dec = float((full[T:] - decode).abs().max())
    with torch.no_grad():
        nocache = model(input_ids=prompt[None], use_cache=False).logits[0].float()
    d_nc = float((nocache - prefill).abs().max())

    # round trip: load the saved directory with transformers (conversion mapping applied) and compare
    rt, info = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                     experts_implementation="eager", output_loading_info=True)
    rt.eval()
    assert all(t.dtype == torch.float32 for t in list(rt.state_dict().values()) + list(mem_sd_dtypes(model)))
    nonempty_missing = [k for k in info["missing_keys"] if rt.get_parameter_or_buffer(k).numel() > 0]
    if nonempty_missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise SystemExit(f"round-trip load problems: missing {nonempty_missing} unexpected {info['unexpected_keys']} "
                         f"mismatched {info.get('mismatched_keys')}")
    rt_sd, mem_sd = rt.state_dict(), model.state_dict()
    w_diff = max(float((rt_sd[k].float() - mem_sd[k].float()).abs().max()) if mem_sd[k].numel() else 0.0
                 for k in mem_sd)
    rt_pre, rt_dec, rt_full = run_reference(rt, prompt, dec)
    d_rt = max(float((rt_pre - prefill).abs().max()), float((rt_dec - decode).abs().max()),
               float((rt_full - full).abs().max()))

    meta = {"magic": "lunar-golden", "version": "1", "config_sha256": hashlib.sha256(cfg_bytes).hexdigest(),
            "command": command, "transformers": transformers.__version__, "torch": torch.__version__}
    meta.update(extra_meta or {})
    save_st({"prompt_ids": prompt.to(torch.int32), "prefill_logits": prefill.contiguous(),
             "decode_ids": dec.to(torch.int32), "decode_logits": decode.contiguous()}, golden_path, meta)
    chk = load_file(golden_path)
    assert torch.equal(chk["prefill_logits"], prefill) and torch.equal(chk["decode_ids"].long(), dec)

    n_params = sum(v.numel() for v in hub.values())
    print(f"  params {n_params}  ({s['dtype']} storage)  model.safetensors {os.path.getsize(st_path)} B  "
          f"golden {os.path.getsize(golden_path)} B")
    print(f"  logits: max|.| {float(prefill.abs().max()):.3f}  std {float(prefill.std()):.3f}  "
          f"argmax distinct over prompt {len(set(prefill.argmax(-1).tolist()))}")
    for n, c in sorted(probe.counts.items()):
        print(f"  layer {n} routing counts per expert: {c.tolist()}")
    print(f"  prompt draw attempt {attempt}; routing counts cover the prefill + decode tokens")
    print(f"  min top-k selection margin {probe.min_margin:.3e}"
          + (f"  min group margin {probe.min_group_margin:.3e}" if probe.min_group_margin < float('inf') else ""))
    print(f"  consistency: full-vs-prefill {d_pre:.3e}  full-vs-decode {d_dec:.3e}  prefill(cache)-vs-nocache {d_nc:.3e}")
    print(f"  round trip: max weight diff {w_diff:.3e}  max logit diff {d_rt:.3e}", flush=True)
    assert d_pre < 1e-4 and d_dec < 1e-4, "transformers prefill/decode inconsistent"
    assert w_diff == 0.0 and d_rt < 1e-5, "round trip mismatch"
    return dict(d_pre=d_pre, d_dec=d_dec, d_rt=d_rt, margin=probe.min_margin)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/golden", help="golden root (tests/golden)")
    ap.add_argument("--bundled", action="store_true", help="build models/kimi-linear-tiny and its golden instead")
    ap.add_argument("--models-dir", default="models")
    ap.add_argument("--only", default=None, help="build only this tiny model (debugging)")
    a = ap.parse_args()
    if a.bundled:
        md = os.path.join(a.models_dir, "kimi-linear-tiny")
        build("kimi-linear-tiny", BUNDLED, md, os.path.join(a.out, "kimi-linear-tiny", "golden.safetensors"),
              CMD_BUNDLED, {"model_dir": "models/kimi-linear-tiny"})
        return
    for name, s in SPECS.items():
        if a.only and name != a.only:
            continue
        d = os.path.join(a.out, name)
        build(name, s, d, os.path.join(d, "golden.safetensors"), CMD_GOLDEN, {"model_dir": f"tests/golden/{name}"})


if __name__ == "__main__":
    main()
