#!/usr/bin/env python3
"""Count the SASS instructions of each loop that holds tensor-core instructions (HMMA), per kernel:
the instructions between a backward branch's target and the branch itself, with a few opcode counts.
Used for the per-chunk counts of the MoE decode kernels (docs/benchmarks.md), e.g.

  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -cubin -Xptxas -v \\
      src/backend/cuda/cuda_moe_f16.cu -o /tmp/k.cubin
  cuobjdump -sass /tmp/k.cubin > /tmp/k.sass && tools/sass_loops.py /tmp/k.sass

Nested loops are listed each (an outer loop's count includes its inner loops)."""
import re
import sys

OPS = ["HMMA", "LDG", "LDS", "LDSM", "LDGSTS", "PRMT", "LOP3", "SHF", "IMAD", "FFMA", "F2FP", "STL", "LDL"]


def main(path):
    text = open(path).read()
    for func in re.split(r"\n\s*Function : ", text)[1:]:
        name = func.split("\n", 1)[0].strip()
        ins = {}
        for line in func.split("\n"):
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                ins[int(m.group(1), 16)] = m.group(2)
        addrs = sorted(ins)
        for a in addrs:
            b = re.search(r"BRA\s.*?(0x[0-9a-f]+)", ins[a])
            if not b or int(b.group(1), 16) > a:
                continue
            t = int(b.group(1), 16)
            body = [ins[x] for x in addrs if t <= x <= a]
            if not any("HMMA" in s for s in body):
                continue
            ops = [s.split()[1] if s.startswith("@") else s.split()[0] for s in body]
            counts = ", ".join(f"{o} {sum(1 for x in ops if x.split('.')[0] == o)}" for o in OPS)
            print(f"{name}\n  loop {t:#x}-{a:#x}: {len(body)} instructions ({counts})")


if __name__ == "__main__":
    main(sys.argv[1])
