#!/usr/bin/env python3
"""Are two PTX files the same kernels? For refactors of device code that cannot be run here: compile the file
before and after (nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -ptx F.cu -o X.ptx)
and compare each .entry's instructions as a multiset, with register numbers, labels and mangled names
normalised (so reordered independent instructions and renamed kernels still compare equal; a changed
operand order, e.g. setp.le a, b against setp.ge b, a, does not).
  tools/ptx_same.py BEFORE.ptx AFTER.ptx [NAME_REGEX]     exit 0 when every entry matches
Entries are paired by name; where a refactor renamed them (a kernel made a template), name the old and new
ones by regex: each old entry is paired with a new one of the same instructions where there is one."""
import collections
import re
import sys


def entries(path):
    text = open(path).read()
    return [(m.group(1), m.group(0)) for m in re.finditer(r'\.entry\s+(\S+)\s*\((.*?)\n\}\n', text, re.S)]


def shape(body):
    out = collections.Counter()
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith('//'):
            continue
        line = re.sub(r'_Z\w+', 'NAME', line)
        line = re.sub(r'\$L__\w+', 'LABEL', line)
        line = re.sub(r'%(r|rd|f|fd|p|rs|h|hh)\d+', r'%\1N', line)
        out[line] += 1
    return out


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    pat = re.compile(sys.argv[3] if len(sys.argv) > 3 else '.')
    a = [e for e in entries(sys.argv[1]) if pat.search(e[0])]
    b = [e for e in entries(sys.argv[2]) if pat.search(e[0])]
    if len(a) != len(b):
        print(f'different entry counts: {len(a)} before, {len(b)} after')
        return 1
    # by name where every name is kept; else (renamed) each before-entry takes an unused after-entry of
    # the same instructions if there is one, the next unused one otherwise
    bn = dict(b)
    if all(n in bn for n, _ in a):
        pairs = [(n, body, bn[n]) for n, body in a]
    else:
        left, pairs = list(b), []
        for n, body in a:
            same = [e for e in left if shape(e[1]) == shape(body)]
            pick = same[0] if same else left[0]
            left.remove(pick)
            pairs.append((f'{n} -> {pick[0]}', body, pick[1]))
    bad = 0
    for name, x, y in pairs:
        sx, sy = shape(x), shape(y)
        if sx != sy:
            bad += 1
            print(f'DIFF {name}: only before {dict(sx - sy)}; only after {dict(sy - sx)}'[:600])
    print(f'{len(pairs) - bad} of {len(pairs)} entries the same instructions')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
