"""PyTorch grouped-GEMM baseline for the latent MoE benchmarks (tools/device/check.sh bench-moe):
torch._grouped_mm over bf16 weights at the K3.1 per-layer shapes, 146 rows per expert."""
import torch
print("torch", torch.__version__)
G, M = 128, 146            # experts, rows per expert (8192 tokens x 16 / 896)
for D, I in ((3584, 3072), (3584, 384)):
    x = torch.randn(G * M, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(G, 2 * I, D, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    w2 = torch.randn(G, D, I, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    h = torch.randn(G * M, I, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(M, G * M + 1, M, device="cuda", dtype=torch.int32)
    try:
        f = lambda: (torch._grouped_mm(x, w13, offs=offs), torch._grouped_mm(h, w2, offs=offs))
        for _ in range(3): f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); f(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort(); ms = ts[len(ts) // 2]
        fl = 2.0 * G * M * 3 * D * I
        print(f"| torch._grouped_mm bf16 D={D} I={I} | rows {G*M} | {ms:.3f} ms | {fl / ms / 1e9:.1f} TFLOP/s |")
    except Exception as e:
        print("torch._grouped_mm failed:", repr(e)[:300])
    del x, w13, w2, h
    torch.cuda.empty_cache()
