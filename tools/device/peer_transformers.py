#!/usr/bin/env python3
"""The transformers peer of `lunar bench` (issue 9): transformers' own KimiLinearForCausalLM, random
BF16 weights made directly on the device (no checkpoint), measured on the quantities lunar bench
measures, with the same floors, printed in lunar bench's table format, plus JSON.

  tools/device/peer_transformers.py CONFIG [--input-lens 1024,8192] [--batch-sizes 1,8] [--contexts 1024]
      [--steps 8] [--repeats 3] [--device cuda|cpu] [--attn sdpa] [--experts grouped_mm] [--kda fla|torch]
      [--num-layers L] [--bandwidth-gbs X] [--peak-tflops Y] [--json FILE] [--lunar-json FILE]

Method (src/cli/bench.c, with the differences said):
- Prefill of n: one sequence of n random ids from an empty cache (use_cache=True, so the MLA latents
  and KDA states are written as lunar's caches are; logits of the last token only, logits_to_keep=1),
  timed end to end with the device synchronized, logits copied to the host. Unlike lunar (no JIT),
  every length is run once untimed first (triton compiles and autotunes fla's kernels per shape) and
  the figure is the mean of --repeats runs: the peer's steady state.
- Decode at (B, ctx): the cache is made by a real prefill of B x ctx random ids (lunar fills its
  caches with values instead: the cost of a step does not depend on them), then one untimed warm-up
  step and --steps timed steps of one token per sequence, logits to the host every step (as lunar's
  bench and engine do). TPOT = mean step time.
- Floors exactly as lunar's (src/cli/bench_floor.c): prefill FLOPs = 2 x active weights per token (the
  lm_head for the last token only) + causal MLA 2 nh (qk + v) per (query, key) pair + chunked KDA
  2 H (3 dk^2 + 64 dk) per token; decode bytes = every non-expert weight + E(1 - (1 - k/E)^B) experts
  per MoE layer + B x (latent rows read and written in bf16 + KDA and conv states read and written in
  fp32). Weights count as transformers stores them (bf16; the router and dt_bias in fp32).
  Bandwidth = best of five 1 GiB device-to-device copies (read + write); peak = the dense
  BF16 GEMM rate measured on the device (the best of 3 x 5 bf16 8192^3 products), as lunar bench.

Fastest setting of transformers' implementation: fla's chunk_kda / fused_recurrent_kda for KDA (the
model's own kernel hook imports them from the `fla` package when it is importable; --kda torch hides it
and uses transformers' PyTorch fallback, as on a machine without fla), SDPA for MLA (flash-attention 2
is used with --attn flash_attention_2 where flash_attn is installed), grouped_mm for the routed experts
(transformers' default where torch._grouped_mm runs; "eager" is its per-expert loop). The short conv
runs through transformers' PyTorch fallback unless the causal_conv1d package is installed.
"""
import argparse
import json
import os
import socket
import sys
import time


def parse_ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def args_of(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="a Kimi-Linear config.json (e.g. configs/kimi-linear-48b-a3b.json)")
    p.add_argument("--input-lens", default="1024,8192")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--contexts", default="1024")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps (lunar bench's default: 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills of each length, after one untimed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="sdpa", help="transformers attn_implementation for the MLA layers")
    p.add_argument("--experts", default="grouped_mm", help="transformers experts_implementation (grouped_mm, eager, ...)")
    p.add_argument("--kda", choices=["fla", "torch"], default=None,
                   help="fla kernels (default on cuda) or transformers' PyTorch fallback (default on cpu)")
    p.add_argument("--num-layers", type=int, default=0, help="keep the first L layers (0: all)")
    p.add_argument("--bandwidth-gbs", type=float, default=0)
    p.add_argument("--peak-tflops", type=float, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--lunar-json", help="lunar bench --json output of the same config: print both side by side")
    p.add_argument("--from-json", help="measure nothing: print the tables of an earlier run's --json (with --lunar-json)")
    a = p.parse_args(argv)
    if not a.config and not a.from_json:
        p.error("give CONFIG (or --from-json FILE)")
    a.input_lens, a.batch_sizes, a.contexts = parse_ints(a.input_lens), parse_ints(a.batch_sizes), parse_ints(a.contexts)
    if a.kda is None:
        a.kda = "fla" if a.device.startswith("cuda") else "torch"
    if a.steps < 1 or a.repeats < 1:
        p.error("--steps and --repeats must be positive")
    return a


def load_config(path, num_layers):
    """The checkpoint's config.json as transformers reads it (KimiLinearConfig maps linear_attn_config
    and first_k_dense_replace to its layer_types / mlp_layer_types), optionally cut to L layers."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    with open(path) as f:
        d = json.load(f)
    for k in ("architectures", "auto_map"):  # the hub's remote-code pointers: the native class is used
        d.pop(k, None)
    if num_layers and num_layers < d["num_hidden_layers"]:
        d["num_hidden_layers"] = num_layers
        lac = d.get("linear_attn_config", {})
        for k in ("full_attn_layers", "kda_layers"):  # 1-based layer numbers in the checkpoint's config
            if k in lac:
                lac[k] = [x for x in lac[k] if x <= num_layers]
    return KimiLinearConfig(**d)


# ---- the floors: lunar's formulas (src/cli/bench_floor.c), counts taken from the model itself ----

def model_counts(model, cfg):
    """Parameter and byte counts in lunar's categories (src/model/weights.c: lunar_config_count_params):
    total counts every weight and the routers' score-correction biases (a buffer here)."""
    total = embed = routed = lm_head = 0
    dense_bytes = embed_bytes = routed_bytes = 0
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                      if n.endswith("e_score_correction_bias")]:
        n, by = t.numel(), t.numel() * t.element_size()
        total += n
        if ".experts." in name:
            routed += n
            routed_bytes += by
        elif "embed_tokens" in name:
            embed += n
            embed_bytes += by
        else:
            dense_bytes += by
            if name.startswith("lm_head"):
                lm_head += n
    n_moe = sum(1 for t in cfg.mlp_layer_types if t == "sparse")
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    active = total - embed - routed + n_moe * k * per_expert
    return {
        "total": total, "active": active, "lm_head": lm_head, "n_moe": n_moe,
        "dense_bytes": dense_bytes, "embed_row_bytes": embed_bytes / cfg.vocab_size,
        "per_expert_bytes": routed_bytes / (n_moe * E) if n_moe else 0,
    }


def layer_kinds(cfg):
    n_mla = sum(1 for t in cfg.layer_types if t == "full_attention")
    return n_mla, cfg.num_hidden_layers - n_mla


def prefill_flops(cfg, c, n):
    n_mla, n_kda = layer_kinds(cfg)
    N = float(n)
    f = 2 * N * (c["active"] - c["lm_head"]) + 2 * c["lm_head"]
    pairs = N * (N + 1) / 2
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    f += n_mla * 2.0 * cfg.num_attention_heads * (qk + cfg.v_head_dim) * pairs
    dk, C = float(cfg.linear_head_dim), 64.0
    f += n_kda * N * cfg.linear_num_heads * 2.0 * (3 * dk * dk + C / 2 * 2 * dk)
    return f


def decode_bytes(cfg, c, B, ctx, kv_elem=2):
    n_mla, n_kda = layer_kinds(cfg)
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    touched = E * (1.0 - (1.0 - k / E) ** B) if E and k else 0
    by = c["dense_bytes"] + B * c["embed_row_bytes"] + c["n_moe"] * touched * c["per_expert_bytes"]
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_elem
    per_seq = n_mla * (ctx + 1) * row + n_mla * row
    HD = cfg.linear_num_heads * cfg.linear_head_dim
    state = cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim * 4
    conv = 3 * HD * (cfg.linear_conv_kernel_dim - 1) * 4
    per_seq += n_kda * 2 * (state + conv)
    return by + B * per_seq


# ---- hardware figures, measured as lunar bench measures them ----

def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_bandwidth(torch, dev):
    nbytes = (1 << 30) if dev.type == "cuda" else (256 << 20)
    a = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(dev)
        best = max(best, 2.0 * nbytes / (time.perf_counter() - t0) / 1e9)
    del a, b
    return best, ("measured: device memcpy" if dev.type == "cuda" else "measured: host memcpy")


def default_peak(torch, dev):
    if dev.type == "cuda":
        # as lunar bench: the best of 3 samples of 5 back-to-back bf16 8192^3 products on random operands
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        a @ b
        best = 0.0
        for _ in range(3):
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(5):
                a @ b
            sync(dev)
            best = max(best, 5 * 2.0 * 8192 ** 3 / (time.perf_counter() - t0) / 1e12)
        del a, b
        return best, "measured: torch bf16 8192^3 on the device"
    x = torch.randn(256, 2048, dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, dtype=torch.bfloat16)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        x @ w
        best = max(best, 2.0 * 256 * 2048 * 2048 / (time.perf_counter() - t0) / 1e12)
    return best, "measured: CPU torch matmul 256x2048x2048 bf16"


# ---- the model ----

def bound_impl(fn):
    """Which function transformers' kernel hook bound behind `fn` (module.name): the wrapper keeps
    it in its closure as `implementation` (transformers/integrations/hub_kernels.py)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is not None:
        for var, cell in zip(code.co_freevars, cells):
            if var == "implementation":
                f = cell.cell_contents
                return f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', '?')}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


def build_model(a, torch, dev):
    if a.kda == "torch":
        # transformers resolves its KDA kernels when the modeling module is imported: a None entry in
        # sys.modules makes `import fla` fail, so the PyTorch fallback is bound (as without fla)
        sys.modules["fla"] = None
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    cfg = load_config(a.config, a.num_layers)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = mk.KimiLinearForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation=a.attn,
                                                      experts_implementation=a.experts)
    model.eval()
    sync(dev)
    impl = {"attn": model.config._attn_implementation, "experts": model.config._experts_implementation}
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn"):
        impl[name] = bound_impl(getattr(mk, name))
    impl["kda_fla"] = impl["chunk_kimi_delta_attention"].startswith("fla")
    return model, cfg, impl, time.perf_counter() - t0


def finite_check(torch, model, dev, V):
    """One short forward must give finite logits: random weights of a bad scale would make the MoE
    routing and so the timings unrepresentative (lunar's dummy weights are checked the same way)."""
    with torch.inference_mode():
        ids = torch.randint(0, V, (1, 16), device=dev)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        ok = bool(torch.isfinite(out.logits).all())
    return ok


def measure_prefill(torch, model, dev, V, n, repeats, gen):
    times = []
    for r in range(repeats + 1):  # run 0: untimed (JIT and autotune of this shape)
        ids = torch.randint(0, V, (1, n), device=dev, generator=gen)
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.logits.float().cpu()
        sync(dev)
        if r:
            times.append(time.perf_counter() - t0)
        del out
    return sum(times) / len(times)


def measure_decode(torch, model, dev, V, B, ctx, steps, gen):
    with torch.inference_mode():
        ids = torch.randint(0, V, (B, ctx), device=dev, generator=gen)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.cache
        nxt = torch.randint(0, V, (B, 1), device=dev, generator=gen)
        t0 = 0.0
        for k in range(steps + 1):  # step 0 is the warm-up
            if k == 1:
                sync(dev)
                t0 = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            last = out.logits[:, -1]
            nxt = last.argmax(-1, keepdim=True)  # greedy on the device: no host work in the step
            last.float().cpu()  # the logits to the host (a synchronizing copy), as lunar's engine and bench
        sync(dev)
        s = (time.perf_counter() - t0) / steps
        del out, cache
    return s


# ---- report ----

def table(res):
    lines = []
    lines.append(f"transformers peer: {res['model']}  device {res['device_name']}  random bf16 weights  layers {res['layers']}")
    lines.append(f"  transformers {res['versions']['transformers']}, torch {res['versions']['torch']}, "
                 f"fla {res['versions']['fla']}; attn {res['impl']['attn']}, experts {res['impl']['experts']}, "
                 f"KDA {'fla' if res['impl']['kda_fla'] else 'transformers torch fallback'}")
    lines.append(f"bandwidth {res['bandwidth_gbs']:.4g} GB/s ({res['bandwidth_source']}); "
                 f"peak {res['peak_tflops']:.4g} TFLOPS ({res['peak_source']})")
    lines.append("")
    lines.append("prefill   input    time_s      tok/s     TFLOP  floor_s    MFU")
    for p in res["prefill"]:
        if "skipped" in p:
            lines.append(f"          {p['input_len']:6d}   skipped: {p['skipped']}")
            continue
        lines.append(f"          {p['input_len']:6d}  {p['seconds']:8.4f}  {p['tok_per_s']:9.1f}  {p['flops'] / 1e12:8.3g}  "
                     f"{p['floor_s']:7.4f}  {100 * p['mfu']:5.1f}%")
    lines.append("")
    lines.append("decode    batch  context   TPOT_ms      tok/s   MB/step  floor_ms  floor/TPOT")
    for d in res["decode"]:
        if "skipped" in d:
            lines.append(f"          {d['batch']:5d}  {d['context']:7d}   skipped: {d['skipped']}")
            continue
        lines.append(f"          {d['batch']:5d}  {d['context']:7d}  {d['tpot_ms']:8.3f}  {d['tok_per_s']:9.1f}  "
                     f"{d['bytes_per_step'] / 1e6:8.1f}  {d['floor_ms']:8.3f}  {100 * d['floor_over_tpot']:9.1f}%")
    return "\n".join(lines)


def side_by_side(res, lunar):
    """lunar's and the peer's figures at the points both measured; lunar/peer speed-up beside each."""
    lines = ["", "side by side (one device call; speed-up = peer time / lunar time)",
             "prefill   input   lunar_s   peer_s  lunar_MFU  peer_MFU  speed-up  FLOP(lunar/peer)"]
    lp = {p["input_len"]: p for p in lunar.get("prefill", []) if "seconds" in p}
    for p in res["prefill"]:
        q = lp.get(p["input_len"])
        if q is None or "seconds" not in p:
            continue
        lines.append(f"          {p['input_len']:6d}  {q['seconds']:8.4f} {p['seconds']:8.4f}  {100 * q['mfu']:8.1f}%"
                     f"  {100 * p['mfu']:7.1f}%  {p['seconds'] / q['seconds']:7.2f}x  {q['flops'] / p['flops']:.4f}")
    lines.append("decode    batch  context  lunar_ms  peer_ms  lunar_floor%  peer_floor%  speed-up")
    ld = {(d["batch"], d["context"]): d for d in lunar.get("decode", []) if "tpot_ms" in d}
    for d in res["decode"]:
        q = ld.get((d["batch"], d["context"]))
        if q is None or "tpot_ms" not in d:
            continue
        lines.append(f"          {d['batch']:5d}  {d['context']:7d}  {q['tpot_ms']:8.3f} {d['tpot_ms']:8.3f}  "
                     f"{100 * q['floor_over_tpot']:11.1f}%  {100 * d['floor_over_tpot']:10.1f}%  "
                     f"{d['tpot_ms'] / q['tpot_ms']:7.2f}x")
    return "\n".join(lines)


def report(res, lunar_json):
    out = table(res)
    if lunar_json and os.path.exists(lunar_json):
        with open(lunar_json) as f:
            out += "\n" + side_by_side(res, json.load(f))
    elif lunar_json:
        out += f"\n\nside by side: no {lunar_json} (lunar bench did not finish)"
    return out


def save(res, path):
    """after every point: a run cut off by its time limit keeps what it measured"""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv):
    a = args_of(argv)
    if a.from_json:
        if not os.path.exists(a.from_json):
            print(f"peer: no {a.from_json}: the peer measured nothing (see its stderr)")
            return 1
        with open(a.from_json) as f:
            print(report(json.load(f), a.lunar_json))
        return 0
    import torch
    import transformers
    dev = torch.device(a.device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda": the current device, named by its index (set_device wants one)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    model, cfg, impl, t_load = build_model(a, torch, dev)
    print(f"peer: built {cfg.num_hidden_layers} layers on {dev} in {t_load:.1f} s; {impl}", file=sys.stderr, flush=True)
    V = cfg.vocab_size
    c = model_counts(model, cfg)
    fla_ver = "-"
    if impl["kda_fla"]:
        try:
            import importlib.metadata as md
            fla_ver = md.version("flash-linear-attention")
        except Exception:
            fla_ver = "?"
    res = {
        "model": a.config, "backend": "transformers", "load_format": "random", "layers": cfg.num_hidden_layers,
        "host": socket.gethostname(), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "fla": fla_ver},
        "impl": impl, "params_total": c["total"], "params_active": c["active"], "decode_steps": a.steps,
        "prefill_repeats": a.repeats, "prefill": [], "decode": [],
    }
    if not finite_check(torch, model, dev, V):
        print("peer: the random model's logits are not finite", file=sys.stderr)
        return 1
    if a.bandwidth_gbs > 0:
        res["bandwidth_gbs"], res["bandwidth_source"] = a.bandwidth_gbs, "--bandwidth-gbs"
    else:
        res["bandwidth_gbs"], res["bandwidth_source"] = measure_bandwidth(torch, dev)
    if a.peak_tflops > 0:
        res["peak_tflops"], res["peak_source"] = a.peak_tflops, "--peak-tflops"
    else:
        res["peak_tflops"], res["peak_source"] = default_peak(torch, dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)
    for n in a.input_lens:
        e = {"input_len": n}
        try:
            s = measure_prefill(torch, model, dev, V, n, a.repeats, gen)
            fl = prefill_flops(cfg, c, n)
            floor = fl / (res["peak_tflops"] * 1e12) if res["peak_tflops"] > 0 else 0.0
            e.update(seconds=s, tok_per_s=n / s, flops=fl, floor_s=floor, mfu=floor / s)
        except Exception as ex:  # out of memory at a long input: the other points still count
            e["skipped"] = f"{type(ex).__name__}: {str(ex)[:120]}"
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        res["prefill"].append(e)
        save(res, a.json)
        print(f"  prefill {n:7d}: {e.get('skipped', 'done')}", file=sys.stderr, flush=True)
    for ctx in a.contexts:
        for B in a.batch_sizes:
            e = {"batch": B, "context": ctx}
            try:
                s = measure_decode(torch, model, dev, V, B, ctx, a.steps, gen)
                by = decode_bytes(cfg, c, B, ctx)
                floor = by / (res["bandwidth_gbs"] * 1e9)
                e.update(tpot_ms=1e3 * s, tok_per_s=B / s, bytes_per_step=by, floor_ms=1e3 * floor,
                         floor_over_tpot=floor / s)
            except Exception as ex:
                e["skipped"] = f"{type(ex).__name__}: {str(ex)[:120]}"
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            res["decode"].append(e)
            save(res, a.json)
            print(f"  decode B={B} ctx={ctx}: {e.get('skipped', 'done')}", file=sys.stderr, flush=True)
    print(report(res, a.lunar_json), flush=True)
    save(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
