"""fla (flash-linear-attention) side of the CUDA benchmarks: chunk_kda prefill and
fused_recurrent_kda decode at the shapes bench_cuda uses. bf16 q/k/v/beta (fla's usual inputs),
fp32 g and state. Median of triton.testing.do_bench. Prints markdown rows."""
import sys

import torch
import torch.nn.functional as F
import triton

from fla.ops.kda import chunk_kda, fused_recurrent_kda

BW = 4.3e12
dev = "cuda"
torch.manual_seed(0)


def inputs(B, T, H, d=128):
    q = F.normalize(torch.randn(B, T, H, d, device=dev), dim=-1).to(torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, d, device=dev), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, d, device=dev).to(torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H, d, device=dev) * 2 - 2).float()
    beta = torch.rand(B, T, H, device=dev).to(torch.bfloat16)
    return q, k, v, g, beta


def prefill(T, H):
    q, k, v, g, beta = inputs(1, T, H)
    h0 = torch.randn(1, H, 128, 128, device=dev) * 0.1

    def run():
        return chunk_kda(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0, output_final_state=True)

    with torch.inference_mode():
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
    print(f"| fla chunk_kda (bf16 qkv) | T={T} H={H} | {ms:.3f} ms |", flush=True)


def decode(B, H=32):
    q, k, v, g, beta = inputs(B, 1, H)
    h0 = torch.randn(B, H, 128, 128, device=dev) * 0.1

    def run():
        return fused_recurrent_kda(q, k, v, g, beta, scale=128 ** -0.5, initial_state=h0, output_final_state=True)

    with torch.inference_mode():
        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    by = B * H * 128 * 128 * 4 * 2
    print(f"| fla fused_recurrent_kda | B={B} H={H} | {ms*1e3:.2f} us | {100*by/BW/(ms*1e-3):.0f}% of 4.3 TB/s |", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    # decode first (cheap to compile), then prefill shapes in order of cost; triton autotunes per shape
    if what in ("all", "decode"):
        for B in (1, 8, 32, 64, 128, 256):
            decode(B)
    if what in ("all", "prefill"):
        for T, H in ((8192, 32), (8192, 96), (65536, 32), (65536, 96)):
            prefill(T, H)
