#!/usr/bin/env python3
"""Are two PTX files the same kernels? For refactors of device code that cannot be run here: compile the file
before and after (nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -ptx F.cu -o X.ptx)
and compare each .entry's instructions as a multiset, with register numbers, labels and mangled names
normalised (so reordered independent instructions and renamed kernels still compare equal; a changed
operand order, e.g. setp.le a, b against setp.ge b, a, does not).
Labels are normalised too: $L__ block labels, and labels defined in the entry (inline asm's WAIT_%=, numbered
file-wide, so their numbers shift when another kernel is removed), and __local_depot<n> (numbered per function);
and the .reg declarations' counts. nvcc's PTX is not always the same for the same source (CUDA 13.0, session 9:
kda_intra_kernel / kda_intra2_kernel's shared loads and used_bytes_mask pragmas differ between two compiles of
one file): compile BEFORE twice; an entry that differs between those is noise, not the refactor.
  tools/ptx_same.py BEFORE.ptx AFTER.ptx [NAME_REGEX]     exit 0 when every paired entry matches
Entries are paired by name; where a refactor renamed them (a kernel made a template), name the old and new
ones by regex: each old entry is paired with a new one of the same instructions where there is one, else (as
many old as new left) the next unused one. Entries left without a pair are listed as removed / added (a refactor
that deletes a kernel: check the list is what was meant)."""
import collections
import re
import sys


def entries(path):
    """(name, whole text) of each .entry: from its name to the brace that closes its body. Session 9 found the
    first version ended an entry at its first line holding only '}', which inline asm's blocks also end with, so
    it compared only the first 17-48 % of the wgmma kernels; braces are now counted (// comments skipped)."""
    text = open(path).read()
    out = []
    for m in re.finditer(r'\.entry\s+(\S+?)\s*\(', text):
        i = text.index(')', m.end())  # the parameter list holds no parentheses
        i = text.index('{', i)
        depth, j = 0, i
        while True:
            c = text[j]
            if c == '/' and text.startswith('//', j):
                j = text.index('\n', j)
                continue
            if c == '{':
                depth += 1
            elif c == '}':
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append((m.group(1), text[m.start():j + 1]))
    return out


def shape(body):
    out = collections.Counter()
    # labels this entry defines (the compiler's $L__..., and inline asm's, e.g. mbar_wait's WAIT_<n>)
    labels = set(re.findall(r'^\s*([A-Za-z_$][\w$]*):\s*$', body, re.M))
    lab = re.compile(r'(?<![\w$])(' + '|'.join(re.escape(x) for x in sorted(labels, key=len, reverse=True)) +
                     r')(?![\w$])') if labels else None
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith('//'):
            continue
        if lab:
            line = lab.sub('LABEL', line)
        line = re.sub(r'_Z\w+', 'NAME', line)
        line = re.sub(r'\$L__\w+', 'LABEL', line)
        line = re.sub(r'__local_depot\d+', '__local_depotN', line)
        line = re.sub(r'^(\.reg\s.*)<\d+>;$', r'\1<N>;', line)  # virtual register counts
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
    # by name first; then each unpaired before-entry takes an unpaired after-entry of the same instructions
    # if there is one; then (renamed and changed) the next unused one while as many are left on both sides
    bn = dict(b)
    pairs, rest = [], []
    for n, body in a:
        (pairs.append((n, body, bn.pop(n))) if n in bn else rest.append((n, body)))
    left, removed = [(n, body) for n, body in b if n in bn], []
    for n, body in rest:
        same = [e for e in left if shape(e[1]) == shape(body)]
        if same:
            left.remove(same[0])
            pairs.append((f'{n} -> {same[0][0]}', body, same[0][1]))
        else:
            removed.append((n, body))
    if len(removed) == len(left):
        pairs += [(f'{n} -> {m}', x, y) for (n, x), (m, y) in zip(removed, left)]
        removed, left = [], []
    for n, _ in removed:
        print(f'removed (no entry after): {n}')
    for n, _ in left:
        print(f'added (no entry before): {n}')
    bad = 0
    for name, x, y in pairs:
        sx, sy = shape(x), shape(y)
        if sx != sy:
            bad += 1
            print(f'DIFF {name}: only before {dict(sx - sy)}; only after {dict(sy - sx)}'[:600])
    print(f'{len(pairs) - bad} of {len(pairs)} paired entries the same instructions; {len(removed)} removed, '
          f'{len(left)} added')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
