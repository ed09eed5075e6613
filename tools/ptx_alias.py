#!/usr/bin/env python3
"""Loads that a store keeps from being hoisted: per PTX .entry, the global loads (ld.global without .nc, and
generic ld.<type>) and ld.param that follow a global store (st.global, generic st.<type>, red / atom.global)
on a forward path. The compiler must assume a store through one pointer may alias a later load through
another, so such a load cannot move above the store; when stores and loads alternate (an unrolled store loop
reading a second input, an epilogue re-reading a per-row weight), each load waits a full memory round trip
after the previous one (session 10: norm_warp_kernel, moe_wg_epilogue, attnres_kernel).
  tools/ptx_alias.py F.ptx [...]                 entries with such loads: trips, loads, param loads, totals
  tools/ptx_alias.py --diff BEFORE AFTER [RE]    the counts of each entry whose counts changed
Compile as tools/ptx_same.py says (nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude
-ptx F.cu -o X.ptx). 'trips' counts the store -> load switches (a run of loads after a run of stores is one
round trip when the stores' data came from earlier loads). What this does not see, read the source for it:
a loop back-edge clears the state (a loop over independent rows, one load and one store an iteration, is
normal; only its unrolled copies count); loads after a barrier are listed although the barrier alone keeps
them there (kda_intra2_kernel's g after the Aq stores: one trip, not a chain); ld.param after a store is a
kernel parameter re-read (a constant-bank operand in SASS, not a memory round trip), listed because it shows
the same assumption on a `const xargs &` (moe_wg_epilogue: 137 param loads before its fix)."""
import re
import sys

sys.path.insert(0, __file__.rsplit('/', 1)[0])
from ptx_same import entries  # noqa: E402

PRED = r'^(@!?%p\d+\s+)?'
LABEL = re.compile(r'^([A-Za-z_$][\w$]*):$')
STORE = re.compile(PRED + r'(st\.global|red\.global|atom\.global|st\.[ufsbv]\d)')
GLOAD = re.compile(PRED + r'ld\.global')
GENLOAD = re.compile(PRED + r'ld\.[ufsbv]\d')  # generic: ld.shared / ld.local / ld.param do not match
PLOAD = re.compile(PRED + r'ld\.param')
BRA = re.compile(PRED + r'bra(\.uni)?\s+([\w$]+);')


def scan(body):
    """(global loads, param loads, stores, global loads after a store, param loads after a store, trips)"""
    lines = [x.strip() for x in body.splitlines()]
    at = {m.group(1): i for i, x in enumerate(lines) for m in [LABEL.match(x)] if m}
    # label -> whether a store is on some forward path to it. Trips are counted in text order (a label
    # reached by falling through keeps the current run, one reached only by a jump starts none), so a
    # guarded load's skip branch (@p bra L; ld; L:) does not count a trip of its own
    incoming = {}
    st = fresh = 0
    fall = True
    g = p = s = ag = ap = trips = 0
    for i, x in enumerate(lines):
        m = LABEL.match(x)
        if m:
            a = incoming.get(m.group(1), 0)
            st, fresh = (st | a, fresh) if fall else (a, 0)
            fall = True
            continue
        if not x or x.startswith('//'):
            continue
        mb = BRA.match(x)
        if mb:
            t = mb.group(3)
            if t in at and at[t] > i:
                incoming[t] = incoming.get(t, 0) | st
            if not x.startswith('@'):
                fall = False  # an unpredicated bra / bra.uni: the next line is reached only by its label
            continue
        if re.match(r'^(ret|exit|trap);', x):
            fall = False
            continue
        if STORE.match(x):
            st = fresh = 1
            s += 1
        elif GLOAD.match(x) or GENLOAD.match(x):
            g += 1
            if st and '.nc' not in x:
                ag += 1
                trips += fresh
                fresh = 0
        elif PLOAD.match(x):
            p += 1
            ap += st
    return g, p, s, ag, ap, trips


def short(name):
    return re.sub(r'^_ZN?\d+|N\d+_GLOBAL__N__\w+?_cu_[0-9a-f]+\d+', '', name)[:80]


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    if args[0] == '--diff':
        pat = re.compile(args[3] if len(args) > 3 else '.')
        a, b = dict(entries(args[1])), dict(entries(args[2]))
        print('entry | global loads | param loads | stores | global loads after a store (trips) | param loads after a store')
        for n in a:
            if n in b and pat.search(n):
                x, y = scan(a[n]), scan(b[n])
                if x != y:
                    print(f'{short(n)} | {x[0]} -> {y[0]} | {x[1]} -> {y[1]} | {x[2]} -> {y[2]} | '
                          f'{x[3]} ({x[5]}) -> {y[3]} ({y[5]}) | {x[4]} -> {y[4]}')
        return 0
    print('trips  loads-after-store  params-after-store  (global loads, param loads, stores)  file  entry')
    for f in args:
        for n, body in entries(f):
            g, p, s, ag, ap, trips = scan(body)
            if ag or ap:
                print(f'{trips:5d} {ag:5d} {ap:5d}  ({g}, {p}, {s})  {f.rsplit("/", 1)[-1]}  {short(n)}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
