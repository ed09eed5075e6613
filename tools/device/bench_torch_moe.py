"""PyTorch peers for the latent MoE benchmarks (tools/device/check.sh bench-moe), same machine and call:
- the machine's own references: streaming read (torch.sum over 4 GiB), device copy, dense bf16 GEMM (8192^3);
- prefill: torch._grouped_mm over bf16 weights at the K3.1 per-layer shapes, 146 rows per expert;
- decode: the same op at batch 1 (16 experts, one row each) over bf16 weights, i.e. 4x the bytes of MXFP4:
  its GB/s is the comparison point (it has no 4-bit path), not its time."""
import torch
print("torch", torch.__version__)
try:
    import triton
    print("triton", triton.__version__, "(no MXFP4 MoE kernel of it is installed here: not run)")
except Exception as e:
    print("triton: not importable:", repr(e)[:100])


def timed(f, reps=10):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


buf = torch.ones(2 << 30, device="cuda", dtype=torch.bfloat16)  # 4 GiB
ms = timed(lambda: buf.sum(dtype=torch.float32))
print(f"| torch.sum 4 GiB bf16 (read) | {ms:.3f} ms | {buf.numel() * 2 / ms / 1e6:.0f} GB/s |")
dst = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
ms = timed(lambda: dst.copy_(buf[: 1 << 30]))
print(f"| copy 2 GiB (read + write) | {ms:.3f} ms | {2 * dst.numel() * 2 / ms / 1e6:.0f} GB/s (read+write) |")
del buf, dst
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
ms = timed(lambda: a @ a)
print(f"| dense bf16 GEMM 8192^3 (cuBLAS) | {ms:.3f} ms | {2 * 8192**3 / ms / 1e9:.1f} TFLOP/s |")
del a
torch.cuda.empty_cache()

G, M = 128, 146            # experts, rows per expert (8192 tokens x 16 / 896)
for D, I in ((3584, 3072), (3584, 384)):
    for g, m, what in ((G, M, "prefill"), (16, 1, "decode B1")):
        x = torch.randn(g * m, D, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(g, 2 * I, D, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        w2 = torch.randn(g, D, I, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        h = torch.randn(g * m, I, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(m, g * m + 1, m, device="cuda", dtype=torch.int32)
        try:
            f = lambda: (torch._grouped_mm(x, w13, offs=offs), torch._grouped_mm(h, w2, offs=offs))
            if what == "prefill":
                ms = timed(f)
                fl = 2.0 * g * m * 3 * D * I
                print(f"| torch._grouped_mm bf16 {what} D={D} I={I} | rows {g*m} | {ms:.3f} ms | {fl / ms / 1e9:.1f} TFLOP/s |")
            else:
                flush = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
                def fl_f():
                    flush.fill_(1.0)
                    f()
                # L2 flushed before each repeat (the fill is timed too: subtract it)
                ms_fill = timed(lambda: flush.fill_(1.0), 21)
                ms = timed(fl_f, 21) - ms_fill
                by = 3.0 * g * D * I * 2
                print(f"| torch._grouped_mm bf16 {what} D={D} I={I} | {by / 1e6:.0f} MB bf16 | {ms * 1e3:.1f} us | {by / ms / 1e6:.0f} GB/s |")
                del flush
        except Exception as e:
            print("torch._grouped_mm failed:", repr(e)[:300])
        del x, w13, w2, h
        torch.cuda.empty_cache()
