#!/usr/bin/env python3
"""Where a graphed step's time goes, from tools/device/kernel_trace.c's CSV (kernels as they ran).

A step is one replay of a CUDA graph: its kernels share the launch's correlation id. The last
--steps replays of the largest graph replayed that often are read (the decode steps of `lunar bench`;
--graph picks another). For each kernel of a step:
  dur    its own span (a PDL successor's span starts when its first block does, so it includes the
         wait for its predecessor: not the kernel's cost);
  owned  the time from the previous kernel end (any kernel) to its own end: the step's span split
         into consecutive pieces, each owned by the kernel that ends it. On a single chain this is
         what the kernel adds to the step; a side-stream kernel that ends inside a main-stream one
         takes that piece from it (the side rows say so by their name);
  idle   the part of owned during which no kernel ran (launch gaps the graph did not hide).
Prints a table of kernels, one row a name and grid (means a step, sorted by owned), and one step's
sequence (the median step).

  python3 tools/device/timeline.py trace.csv[.gz] [--steps 16] [--graph ID] [--seq] [--top 40]
"""
import argparse
import collections
import gzip
import shutil
import statistics
import subprocess


def load(path):
    op = gzip.open if path.endswith('.gz') else open
    rows = []
    with op(path, 'rt') as f:
        for line in f:
            p = line.rstrip('\n').split(',', 8)
            if len(p) < 9:
                continue
            rows.append(dict(start=int(p[0]), end=int(p[1]), stream=int(p[2]), graph=int(p[3]),
                             node=int(p[4]), corr=int(p[5]), grid=p[6], block=p[7], name=p[8]))
    return rows


def demangle(names):
    """c++filt where it exists; template arguments kept, argument lists dropped"""
    names = sorted(set(names))
    out = dict((n, n) for n in names)
    if shutil.which('c++filt'):
        r = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True)
        for n, d in zip(names, r.stdout.split('\n')):
            out[n] = d
    for n, d in out.items():
        # drop the parameter list: the last top-level '(' .. ')'
        depth = 0
        for i in range(len(d) - 1, -1, -1):
            c = d[i]
            if c == ')':
                depth += 1
            elif c == '(':
                depth -= 1
                if depth == 0:
                    d = d[:i]
                    break
        if d.startswith('void '):
            d = d[5:]
        out[n] = d
    return out


def step_rows(ks):
    """ks: one step's kernels. Adds t0/t1 (us from the step's first start), dur, owned, idle."""
    ks.sort(key=lambda k: (k['end'], k['start']))
    s0 = min(k['start'] for k in ks)
    prev_end = s0
    # busy intervals for the idle measure: the union of [start, end)
    iv = sorted((k['start'], k['end']) for k in ks)
    union = []
    for a, b in iv:
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])

    def busy(a, b):
        return sum(max(0, min(b, y) - max(a, x)) for x, y in union if y > a and x < b)

    for k in ks:
        k['t0'] = (k['start'] - s0) / 1e3
        k['t1'] = (k['end'] - s0) / 1e3
        k['dur'] = (k['end'] - k['start']) / 1e3
        lo = prev_end
        k['owned'] = max(0, k['end'] - lo) / 1e3
        k['idle'] = max(0, (k['end'] - lo) - busy(lo, k['end'])) / 1e3 if k['end'] > lo else 0.0
        prev_end = max(prev_end, k['end'])
    span = (max(k['end'] for k in ks) - s0) / 1e3
    busy_us = sum(b - a for a, b in union) / 1e3
    return span, busy_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('csv')
    ap.add_argument('--steps', type=int, default=16)
    ap.add_argument('--graph', type=int, default=None)
    ap.add_argument('--seq', action='store_true', help="print the median step's kernels in order")
    ap.add_argument('--top', type=int, default=40)
    a = ap.parse_args()
    rows = load(a.csv)
    if not rows:
        raise SystemExit('no kernels in %s' % a.csv)
    names = demangle([r['name'] for r in rows])
    for r in rows:
        r['name'] = names[r['name']]
    graphed = [r for r in rows if r['graph']]
    if not graphed:
        raise SystemExit('no graphed kernels (an eager run?)')
    by_graph = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in graphed:
        by_graph[r['graph']][r['corr']].append(r)
    if a.graph is not None:
        gid = a.graph
    else:  # the graph of the most kernels a replay among those replayed --steps times (`lunar bench
        # --project-layers` replays a shorter model's graph after the full one)
        def size(g):
            ls = by_graph[g]
            return (len(ls) >= a.steps, max(len(v) for v in ls.values()))
        gid = max(by_graph, key=size)
    launches = by_graph[gid]
    order = sorted(launches, key=lambda c: min(k['start'] for k in launches[c]))
    order = order[-a.steps:]
    steps = []
    for c in order:
        ks = launches[c]
        span, busy_us = step_rows(ks)
        steps.append((span, busy_us, c, ks))
    starts = [min(k['start'] for k in s[3]) for s in steps]
    periods = [(b - a_) / 1e3 for a_, b in zip(starts, starts[1:])]
    spans = [s[0] for s in steps]
    print('graph %d: %d replays read (of %d), %d kernels a step' % (gid, len(steps), len(launches),
                                                                   len(steps[-1][3])))
    print('step span (first start to last end) us: median %.1f, min %.1f, max %.1f' %
          (statistics.median(spans), min(spans), max(spans)))
    if periods:
        print('replay period (start to next start) us: median %.1f' % statistics.median(periods))
    print('busy (some kernel running) us: median %.1f; idle %.1f' %
          (statistics.median(s[1] for s in steps), statistics.median(s[0] - s[1] for s in steps)))
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for _, _, _, ks in steps:
        for k in ks:
            g = agg[k['name'] + ' [' + k['grid'] + ']']  # one row a shape: the grid tells the launches apart
            g[0] += 1
            g[1] += k['dur']
            g[2] += k['owned']
            g[3] += k['idle']
    n = len(steps)
    tot_owned = sum(g[2] for g in agg.values()) / n
    print('\n| kernel | launches | dur us | owned us | of step | owned us / launch | idle us |')
    print('|---|---|---|---|---|---|---|')
    for name, g in sorted(agg.items(), key=lambda kv: -kv[1][2])[:a.top]:
        print('| %s | %d | %.1f | %.1f | %.1f %% | %.2f | %.1f |' % (
            name[:100], g[0] // n, g[1] / n, g[2] / n, 100 * g[2] / n / tot_owned, g[2] / g[0], g[3] / n))
    print('| all | %d | %.1f | %.1f | 100 %% | | %.1f |' % (
        sum(g[0] for g in agg.values()) // n, sum(g[1] for g in agg.values()) / n, tot_owned,
        sum(g[3] for g in agg.values()) / n))
    if a.seq:
        med = sorted(steps, key=lambda s: s[0])[len(steps) // 2]
        print('\nthe median step (span %.1f us), kernels by end:' % med[0])
        print('| # | start | end | dur | owned | idle | grid | block | kernel |')
        print('|---|---|---|---|---|---|---|---|---|')
        for i, k in enumerate(med[3]):
            print('| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %s | %s |' % (
                i, k['t0'], k['t1'], k['dur'], k['owned'], k['idle'], k['grid'], k['block'], k['name'][:80]))


if __name__ == '__main__':
    main()
