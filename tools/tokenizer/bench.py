#!/usr/bin/env python3
"""Tokenizer throughput, Python tiktoken (one thread) vs lunar, on the same deterministic texts.

    make bench-tokenizer && python3 tools/tokenizer/bench.py

Texts: the 1 MB mixed-script corpus text of the tests (seed 20240601), and 1 MB of plain English-like
prose (a subset of its fragments). tiktoken is timed on Encoding.encode_ordinary (plain tiktoken,
without Kimi's 25,000-char run splitting, which only makes Python slower); lunar on lunar_tokenize.
"""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_expected as m  # noqa: E402

PROSE = ["the ", "The ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dog", ". ", ", ", "\n", "I'm ",
         "they'll ", "it's", "running ", "tokenizer ", "benchmark ", "throughput ", "2024 ", "(a) ", "\"quoted\" "]


def main():
    reps = 5
    enc = m.make_encoding("data/kimi-tokenizer", "tokenizer_config.k2.json")
    texts = {
        "mixed 1 MB (corpus seed 20240601)": m.gen_text({"type": "fragments", "seed": 20240601, "bytes": 1_000_000,
                                                          "fragments": m.FRAGMENTS}),
        "english prose 1 MB": m.gen_text({"type": "fragments", "seed": 3, "bytes": 1_000_000, "fragments": PROSE}),
    }
    for name, text in texts.items():
        path = "/tmp/lunar_tok_bench.txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        nbytes = len(text.encode())
        best = 1e30
        for _ in range(reps):
            t0 = time.perf_counter()
            ids = enc.encode_ordinary(text)
            best = min(best, time.perf_counter() - t0)
        assert ids == m.kimi_encode(enc, text, False)
        print(f"{name}:")
        print(f"  tiktoken {m.tiktoken.__version__}: {nbytes} bytes -> {len(ids)} ids (fnv {m.fnv_ids(ids)}), "
              f"best of {reps}: {best:.3f} s, {nbytes / best / 1e6:.2f} MB/s")
        out = subprocess.run(["build/bench_tokenizer", path, str(reps)], capture_output=True, text=True, check=True)
        print("  " + out.stdout.strip())


if __name__ == "__main__":
    main()
