#!/usr/bin/env python3
"""Generates tests/data/tokenizer/corpus.jsonl: tokenizer cases and the ids the Kimi tokenizer gives them.

The oracle is Python tiktoken with Kimi's pattern, ranks and special tokens, driven exactly the way
Kimi's tokenization_kimi.py `TikTokenTokenizer.encode` drives it: the text is cut into 400,000-char
pieces, each piece into runs of at most 25,000 consecutive whitespace / non-whitespace chars
(str.isspace), and every run is encoded on its own, with allowed_special="all" (allow_special) or
disallowed_special=() (ordinary).

    python3 tools/tokenizer/make_expected.py [data/kimi-tokenizer] [tests/data/tokenizer/corpus.jsonl]

Each output line is one JSON object:
  {"kind":"case","name","text","ordinary":[ids],"special_k2":[ids],"special_k3":[ids]}
      (special_kN left out when equal to ordinary)
  {"kind":"hashed","name","gen":{...},"count","fnv":"hex", ...}: a big generated text whose ids are
      stored as count + FNV-1a-64 over the ids as little-endian int32; the C test regenerates the text
      from "gen" (see gen_text below, mirrored in tests/test_tokenizer.c).
"""
import json
import os
import random
import sys

import tiktoken
from tiktoken.load import load_tiktoken_bpe

PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256

# Python's str.isspace(), which Kimi's splitter uses; mirrored in src/text/tokenizer.c.
PY_SPACES = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20, 0x85, 0xA0, 0x1680,
             *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]


def make_encoding(tdir, cfg):
    ranks = load_tiktoken_bpe(os.path.join(tdir, "tiktoken.model"))
    with open(os.path.join(tdir, cfg), encoding="utf-8") as f:
        added = {int(k): v["content"] for k, v in json.load(f)["added_tokens_decoder"].items()}
    n = len(ranks)
    special = {added.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED)}
    return tiktoken.Encoding(name=cfg, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special)


def split_runs(s, limit):
    """Kimi's _split_whitespaces_or_nonwhitespaces."""
    out, start, run = [], 0, 0
    is_space = s[0].isspace() if s else False
    for i, ch in enumerate(s):
        now = ch.isspace()
        if now != is_space:
            run, is_space = 1, now
        else:
            run += 1
            if run > limit:
                out.append(s[start:i])
                start, run = i, 1
    out.append(s[start:])
    return out


def kimi_encode(enc, text, allow_special):
    ids = []
    for i in range(0, len(text), 400_000):
        for sub in split_runs(text[i:i + 400_000], 25_000):
            if allow_special:
                ids.extend(enc.encode(sub, allowed_special="all"))
            else:
                ids.extend(enc.encode(sub, disallowed_special=()))
    return ids


def fnv_ids(ids):
    h = 0xcbf29ce484222325
    for t in ids:
        for b in int(t).to_bytes(4, "little", signed=True):
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


class SplitMix64:
    def __init__(self, seed):
        self.s = seed & 0xFFFFFFFFFFFFFFFF

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)


def gen_text(gen):
    """Deterministic generated texts; tests/test_tokenizer.c has the same generators."""
    if gen["type"] == "fragments":
        rng, frags, parts, size = SplitMix64(gen["seed"]), gen["fragments"], [], 0
        while size < gen["bytes"]:
            f = frags[rng.next() % len(frags)]
            parts.append(f)
            size += len(f.encode("utf-8"))
        return "".join(parts)
    if gen["type"] == "codepoints":
        # code points lo..hi-1 (surrogates skipped), each followed by the separator when there is one
        sep = gen["sep"]
        return "".join(chr(c) + sep for c in range(gen["lo"], gen["hi"]) if not 0xD800 <= c < 0xE000)
    raise ValueError(gen["type"])


FRAGMENTS = [
    "the ", "The ", "quick ", "brown ", "fox ", "jumps ", "over ", "lazy ", "dog", ". ", ", ", "\n", "\n\n",
    "  ", "\t", "\r\n", "I'm ", "DON'T ", "they'll ", "it's", "HTTPServer", "camelCase", "snake_case ",
    "0", "12", "345", "6789", "3.14159", "1,000,000 ", "-42", "2024-06-01", "0x7fff",
    "中文", "分词器", "测试。", "日本語の", "テキスト", "ひらがな", "한국어 ", "텍스트", "العربية ", "مرحبا",
    "Привет ", "мир", "Ελληνικά ", "हिन्दी ", "ไทย", "😀", "👨‍👩‍👧‍👦", "🇯🇵", "👍🏽", "❤️", " 🙂 ",
    "def f(x):\n    return x * 2\n", "int main(void) { return 0; }", "{\"a\": [1, 2, 3]}", "<div>", "</div>",
    "https://example.com/a?b=c", "    ", "\u3000", "\u00a0", "café ", "naïve ", "Ｆｕｌｌ", "１２３",
    "<|im_end|>", "<|im_user|>", "[BOS]", "<think>", "</think>", "<|end_of_msg|>", "<|open|>",
    "<|reserved_token_163700|>", "<|im_end", "|>", "<", "[", "'s", "'S", "'ſ",
]

BASIC = [
    ("empty", ""),
    ("english", "Hello, world! This is a test of the Kimi tokenizer. It's working, isn't it?"),
    ("english_caps", "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG. HTTPServer XMLHttpRequest iPhone McDonald's"),
    ("contractions", "I'm you're we've they'll she'd it's DON'T WE'VE THEY'LL I'D 'S 'T 'Re 'vE 'M 'lL 'D x'ſ 'K"),
    ("chinese", "我们今天来测试一下分词器，看看它能不能正确处理中文文本。繁體中文也要測試！"),
    ("japanese", "日本語のテキストを分割します。ひらがな、カタカナ、漢字が混ざっています。ｶﾀｶﾅ"),
    ("korean", "안녕하세요, 세계! 한국어 텍스트를 토큰화합니다."),
    ("arabic", "مرحبا بالعالم! هذه جملة عربية للاختبار. ١٢٣٤٥٦٧"),
    ("hebrew", "שלום עולם, זה מבחן."),
    ("hindi", "नमस्ते दुनिया! यह एक परीक्षण है।"),
    ("thai", "สวัสดีชาวโลก นี่คือการทดสอบ"),
    ("cyrillic_greek", "Привет, мир! Ελληνικά γράμματα. Ещё раз: ЁЖИК."),
    ("emoji", "I love 🍕 and 🍣! 😀😃😄 👍🏽 ❤️ 🇯🇵🇺🇸 ✨"),
    ("emoji_zwj", "👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🧑‍🤝‍🧑 👁️‍🗨️ a👨‍👩‍👧b"),
    ("combining", "e\u0301 n\u0303 a\u0308\u0304 \u0301\u0302x Z\u0335\u0321a\u0336l\u0334g\u0338o"),
    ("code_c", "#include <stdio.h>\n\nint main(int argc, char **argv) {\n\tprintf(\"%d\\n\", argc);\n\treturn 0;\n}\n"),
    ("code_py", "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])\n"),
    ("code_json", '{"name": "lunar", "version": [1, 2, 3], "nested": {"k": null, "b": true}, "s": "a\\"b"}'),
    ("whitespace_runs", "a b  c   d    e     f      g\t\th\t \ti \n j\n\n\nk   \n   l\r\nm\r\n\r\nn\r\r\ro   "),
    ("whitespace_only", "     \t\t  \n\n   "),
    ("trailing_spaces", "end with spaces     "),
    ("crlf", "line one\r\nline two\r\n\r\nline four\r\n"),
    ("unicode_spaces", "a\u00a0b\u3000c\u2003d\u2028e\u2029f\u0085g\u200bh\u202fi\u205fj\u1680k\x0bl\x0cm\x1cn\x1fo"),
    ("mixed_scripts", "Kimi模型supports中文and English混合text，также русский и 日本語とEnglish混在。"),
    ("han_letters", "漢字ABC漢字abc漢字Abc漢字123漢字"),
    ("numbers_fullwidth", "１２３４５ ٠١٢٣٤٥٦٧٨٩ ²³ ½ Ⅻ ⅷ 𝟘𝟙𝟚"),
    ("punct", "!!! ??? ... --- *** ((( ))) [[[ ]]] {{{ }}} <<< >>> ### @@@ $$$ %%% ^^^ &&& ||| ~~~ ``` '''"),
    ("punct_newlines", "foo.\n\nbar!\r\n\r\n  baz?\n\t\n"),
    ("urls", "See https://github.com/MoonshotAI/Kimi-K2?tab=readme#usage and mailto:someone@example.com."),
    ("math", "∀x∈ℝ: x² ≥ 0, ∑_{i=1}^{n} i = n(n+1)/2, ∫₀^∞ e^{-x} dx = 1"),
    ("long_word", "supercalifragilisticexpialidocious" * 50),
    ("long_mixed_word", "".join("abcXYZ中文ñ"[i % 9] for i in range(3000))),
    ("special_strings", "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"),
    ("special_k3", "<|open|>user<|sep|>hi<|close|><|end_of_msg|>[BOS][EOS][EOT][PAD][UNK]<osagent_mode>"),
    ("special_reserved", "<|reserved_token_163600|><|reserved_token_163839|><|reserved_token_163838|><|reserved_token_163589|>"),
    ("special_tools", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><think>hmm</think>"),
    ("special_partial", "<|im_end <|im_end| <im_end|> [BOS [B0S] <|im_end|><|im_end|>x<|im_end|> <|media_pad|>"),
    ("special_in_words", "abc<|im_end|>def 123[BOS]456 中文<think>中文</think>中文"),
]


def build_cases():
    cases = list(BASIC)
    for n in range(1, 41):
        cases.append((f"digits_{n}", "".join(str((i * 7 + 3) % 10) for i in range(n))))
    cases.append(("numbers_mixed", " ".join(str(10 ** k + k) for k in range(25)) + " 3.14 -0.5 1e10 0x1F 1,234,567"))
    for n in (1, 2, 3, 4, 7, 16, 33):
        cases.append((f"spaces_{n}_word", " " * n + "word" + " " * n + "x"))
        cases.append((f"newlines_{n}", "a" + "\n" * n + "b" + "\r\n" * n + "c"))
        cases.append((f"tabs_{n}", "\t" * n + "x" + " \t" * n))
    # runs around Kimi's 25,000-char split
    cases.append(("run_25000_nonspace", "x" * 25000 + " y"))
    cases.append(("run_25001_nonspace", "ab" * 12500 + "c d"))
    cases.append(("run_30000_spaces", "a" + " " * 30000 + "b"))
    cases.append(("run_60000_han", "中文分词" * 15000))
    cases.append(("run_50000_mixed", "".join("the中1 "[i % 5] if i % 7 else "Q" for i in range(50000))))
    cases.append(("split_inside_special", "a" * 24995 + "<|im_end|>" + "b"))
    rng = random.Random(1234)
    pool = ("abcdefgXYZ 0123456789\t\n\r.,;:'\"!?-_()[]{}<>|/\\@#$%^&*~`+=中文字한글ひらカナ"
            "éüßñøçÅ\u0301\u0308\u200d😀👍🏽🇯🇵\u00a0\u3000\u2028١٢٣ΣσςЖж")
    for i in range(300):
        n = rng.randint(1, 80)
        cases.append((f"random_{i}", "".join(rng.choice(pool) for _ in range(n))))
    for i in range(40):
        n = rng.randint(1, 40)
        frag = FRAGMENTS
        cases.append((f"random_frag_{i}", "".join(rng.choice(frag) for _ in range(n))))
    return cases


def main():
    tdir = sys.argv[1] if len(sys.argv) > 1 else "data/kimi-tokenizer"
    out = sys.argv[2] if len(sys.argv) > 2 else "tests/data/tokenizer/corpus.jsonl"
    k2 = make_encoding(tdir, "tokenizer_config.k2.json")
    k3 = make_encoding(tdir, "tokenizer_config.k3.json")
    assert [c for c in range(0x110000) if chr(c).isspace()] == PY_SPACES
    lines = []
    for name, text in build_cases():
        rec = {"kind": "case", "name": name, "text": text, "ordinary": kimi_encode(k2, text, False)}
        assert rec["ordinary"] == kimi_encode(k3, text, False)
        for tag, enc in (("k2", k2), ("k3", k3)):
            ids = kimi_encode(enc, text, True)
            if ids != rec["ordinary"]:
                rec["special_" + tag] = ids
        lines.append(rec)
    # every code point, alone and between neighbours of each class the pattern cares about
    step = 0x2000
    for lo in range(0, 0x110000, step):
        for sep in ("", "a", "A", " ", "1", "中", "\n", "'s"):
            gen = {"type": "codepoints", "lo": lo, "hi": lo + step, "sep": sep}
            text = gen_text(gen)
            ids = kimi_encode(k2, text, False)
            lines.append({"kind": "hashed", "name": f"codepoints_{lo:06x}_{sep!r}", "gen": gen, "special": False,
                          "count": len(ids), "fnv": fnv_ids(ids)})
    for seed, special in ((20240601, False), (20240601, True), (7, True)):
        gen = {"type": "fragments", "seed": seed, "bytes": 1_000_000, "fragments": FRAGMENTS}
        text = gen_text(gen)
        ids = kimi_encode(k2, text, special)
        lines.append({"kind": "hashed", "name": f"mixed_1mb_seed{seed}_{'special' if special else 'ordinary'}",
                      "gen": gen, "special": special, "count": len(ids), "fnv": fnv_ids(ids)})
    for seed in (1, 2):
        frags = ["a", "b", "c", "ab", "xyz", "é", "ing", "tion", "ñ"] + (["Q", "中", "0"] if seed == 2 else [])
        gen = {"type": "fragments", "seed": seed, "bytes": 1_000_000, "fragments": frags}
        text = gen_text(gen)
        ids = kimi_encode(k2, text, False)
        lines.append({"kind": "hashed", "name": f"one_word_1mb_seed{seed}", "gen": gen, "special": False,
                      "count": len(ids), "fnv": fnv_ids(ids)})
    # decoding: ids -> Python's bytes.decode("utf-8", "replace") of their bytes (what tiktoken's decode gives)
    rng = random.Random(99)
    multibyte = [t for t in range(256, 163584) if any(b >= 0x80 for b in k2.decode_single_token_bytes(t))]
    for i in range(200):
        ids = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            ids.append(rng.randrange(128, 256) if r < 0.3 else rng.choice(multibyte) if r < 0.7 else
                       rng.randrange(163584, 163840) if r < 0.8 else rng.randrange(0, 163584))
        lines.append({"kind": "decode", "name": f"decode_{i}", "ids": ids, "text": k2.decode(ids)})
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for rec in lines:
            f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"{out}: {len(lines)} records")


if __name__ == "__main__":
    main()
