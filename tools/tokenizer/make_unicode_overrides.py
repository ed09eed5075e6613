#!/usr/bin/env python3
"""Generates src/text/unicode_overrides.h: code points whose class differs between tiktoken's regex
engine (Rust regex-syntax, a newer Unicode) and the system PCRE2 (10.42: Unicode 14), with a stand-in
code point of the same UTF-8 length that PCRE2 classifies the way tiktoken classifies the original.

The pattern only looks at five properties of a non-space character: Han (script), L, N,
UPPER = (Lu|Lt|Lm|Lo|M) - Han, LOWER = (Ll|Lm|Lo|M) - Han. What it can observe of them: Han, N, UPPER,
LOWER and X = "UPPER or LOWER or neither L nor N" (whether a mark in UPPER|LOWER is a letter changes
no match). Both sides are measured, not assumed:
- tiktoken: probes through tiktoken itself, with a made-up vocabulary in which a two-character probe
  is a single token exactly when the pattern keeps it in one piece:
    "a"+c one piece <=> c in LOWER;  "A"+c <=> c in UPPER or LOWER;  then c+"Aa" <=> c in UPPER;
    "中"+c <=> c Han;  "1"+c <=> c in N;  "!"+c <=> X.
- PCRE2: the translated classes of src/text/pretokenize.c, matched through ctypes.

    python3 tools/tokenizer/make_unicode_overrides.py > src/text/unicode_overrides.h
"""
import ctypes
import sys

import tiktoken

HAN, L, N, UP, LOW, X = 1, 2, 4, 8, 16, 32
WS = set([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
          0x205F, 0x3000])
sys.path.insert(0, "tools/tokenizer")
from make_expected import PAT_STR  # noqa: E402

CPS = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and c not in WS and c not in (0x0A, 0x0D)]


def tiktoken_classes():
    out = {}
    base = {bytes([by]): by for by in range(256)}
    # prefix/suffix probes; a probe in one piece becomes one token
    probes = (("a", "", LOW), ("A", "", 64), ("", "Aa", 128), ("中", "", HAN), ("1", "", N), ("!", "", X))
    step = 50000
    for lo in range(0, len(CPS), step):
        chunk = CPS[lo:lo + step]
        ranks = dict(base)
        for c in chunk:
            for p, q, _ in probes:
                ranks.setdefault((p + chr(c) + q).encode(), len(ranks))
        enc = tiktoken.Encoding("probe", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
        for c in chunk:
            bits = 0
            for p, q, bit in probes:
                if len(enc.encode_ordinary(p + chr(c) + q)) == 1:
                    bits |= bit
            # "A"+c: c in UPPER or LOWER; c+"Aa" (given that): c in UPPER
            if bits & 64 and bits & 128:
                bits |= UP
            out[c] = bits & (HAN | N | UP | LOW | X)
    return out


def pcre2_classes():
    lib = ctypes.CDLL("libpcre2-8.so.0")
    lib.pcre2_compile_8.restype = ctypes.c_void_p
    lib.pcre2_compile_8.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int),
                                    ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
    lib.pcre2_match_data_create_8.restype = ctypes.c_void_p
    lib.pcre2_match_data_create_8.argtypes = [ctypes.c_uint32, ctypes.c_void_p]
    lib.pcre2_match_8.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint32,
                                  ctypes.c_void_p, ctypes.c_void_p]
    UTF, UCP = 0x00080000, 0x00020000
    src = open("src/text/pretokenize.c", encoding="utf-8").read()

    def define(name):
        line = next(l for l in src.splitlines() if l.startswith("#define " + name + " "))
        return line.split(" ", 2)[2].strip().strip('"').encode().decode("unicode_escape")

    classes = {HAN: r"\p{sc:Han}", L: r"\p{L}", N: r"\p{N}", UP: define("UPPER"), LOW: define("LOWER")}
    md = lib.pcre2_match_data_create_8(1, None)
    res = {c: 0 for c in CPS}
    for bit, cls in classes.items():
        err, off = ctypes.c_int(), ctypes.c_size_t()
        pat = ("^" + cls + "$").encode()
        re = lib.pcre2_compile_8(pat, len(pat), UTF | UCP, ctypes.byref(err), ctypes.byref(off), None)
        assert re, (cls, err.value, off.value)
        for c in CPS:
            s = chr(c).encode()
            if lib.pcre2_match_8(re, s, len(s), 0, 0, md, None) >= 0:
                res[c] |= bit
    # observable bits only: X = in UPPER or LOWER, or neither letter nor number (the L of a mark vs a letter
    # inside UPPER|LOWER changes no match)
    for c in CPS:
        b = res[c]
        if b & (UP | LOW) or not b & (L | N):
            b |= X
        res[c] = b & (HAN | N | UP | LOW | X)
    return res


def main():
    tk = tiktoken_classes()
    pc = pcre2_classes()
    diff = sorted(c for c in CPS if tk[c] != pc[c])
    # stand-ins: a code point of the same UTF-8 length that PCRE2 classes as tiktoken classes c
    by_class = {}
    for c in CPS:
        if tk[c] == pc[c] and c > 0x7F:
            by_class.setdefault((pc[c], len(chr(c).encode())), c)
    rows = []
    for c in diff:
        key = (tk[c], len(chr(c).encode()))
        assert key in by_class, (hex(c), key)
        rows.append((c, by_class[key], pc[c], tk[c]))
    ranges = []  # [first, last, stand-in, pcre2 bits, tiktoken bits]
    for c, st, a, b in rows:
        if ranges and ranges[-1][1] == c - 1 and ranges[-1][2:] == [st, a, b]:
            ranges[-1][1] = c
        else:
            ranges.append([c, c, st, a, b])
    print("/* Generated by tools/tokenizer/make_unicode_overrides.py: do not edit. */")
    print("/* Code points that tiktoken's regex classifies differently from the system PCRE2 (older Unicode")
    print(" * tables), as ranges {first, last, stand-in}: the stand-in has the same UTF-8 length and PCRE2")
    print(" * classifies it as tiktoken classifies the range. Class bits (pcre2 -> tiktoken): 1 Han, 4 N,")
    print(" * 8 UPPER, 16 LOWER, 32 X (see the generator). */")
    print(f"#define LUNAR_UNICODE_OVERRIDE_RANGES {max(len(ranges), 1)}")
    print(f"#define LUNAR_UNICODE_OVERRIDE_MIN 0x{ranges[0][0] if ranges else 0x110000:X}")
    print("static const uint32_t lunar_unicode_override[][3] = {")
    for c0, c1, st, a, b in ranges:
        print(f"    {{0x{c0:05X}, 0x{c1:05X}, 0x{st:05X}}}, /* {a} -> {b} */")
    if not ranges:
        print("    {0x110000, 0x110000, 0},")
    print("};")
    print(f"{len(rows)} code points in {len(ranges)} ranges", file=sys.stderr)


if __name__ == "__main__":
    main()
