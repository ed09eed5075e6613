"""`lunar bench serve` against a live `lunar serve` (the fixture of test_openai.py): 4 prompts, every metric of
`vllm bench serve` present and consistent with the definitions in docs/benchmarks.md; and `lunar serve --load-format
dummy` (random weights from a config alone) serving the same workload."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai import FAKE, K2_MODEL, LUNAR, ROOT, Server  # noqa: E402

METRICS = ["ttft", "tpot", "itl", "e2el"]


def bench_serve(server, tmp_path, *extra):
    out = tmp_path / "result.json"
    args = [LUNAR, "bench", "serve", "--base-url", server.base, "--input-len", "24", "--output-len", "6",
            "--num-prompts", "4", "--max-concurrency", "2", "--seed", "1", "--result-file", str(out), *extra]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Serving Benchmark Result" in p.stdout and "Mean TTFT (ms):" in p.stdout and "P99 E2EL (ms):" in p.stdout
    return json.loads(out.read_text())


def check_result(r):
    assert r["completed"] == 4 and r["failed"] == 0 and r["errors"] == [""] * 4
    assert r["total_input_tokens"] == 4 * 24
    if not FAKE:  # the fake engine's script may end before max_tokens
        assert r["output_lens"] == [6] * 4 and r["total_output_tokens"] == 24
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "duration"):
        assert r[k] > 0, k
    assert abs(r["total_token_throughput"] - (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"]) < 1e-6
    for m in METRICS:
        for s in ("mean", "median", "std", "p99"):
            assert f"{s}_{m}_ms" in r, f"{s}_{m}_ms"
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"] + 1e-9
    # E2EL = TTFT + the rest of the stream, so every mean E2EL exceeds the mean TTFT
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert len(r["ttfts"]) == 4 and 1 <= r["max_concurrent_requests"] <= 2


def test_bench_serve_metrics(tmp_path):
    s = Server(K2_MODEL)
    try:
        check_result(bench_serve(s, tmp_path))
    finally:
        s.stop()


@pytest.mark.skipif(FAKE, reason="the fake engine loads no weights")
def test_serve_load_format_dummy(tmp_path):
    s = Server(os.path.join(K2_MODEL, "config.json"), "--load-format", "dummy", "--tokenizer", K2_MODEL)
    try:
        check_result(bench_serve(s, tmp_path))
    finally:
        s.stop()
