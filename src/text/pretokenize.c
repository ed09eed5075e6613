/* Kimi's pre-tokenisation regex, translated for PCRE2.
 *
 * The original (tokenization_kimi.py pat_str, run by tiktoken's Rust fancy-regex), alternatives joined by |:
 *   [\p{Han}]+
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *   \p{N}{1,3}
 *    ?[^\s\p{L}\p{N}]+[\r\n]*
 *   \s*[\r\n]+
 *   \s+(?!\S)
 *   \s+
 *
 * Translation:
 * - PCRE2 has no class intersection (&&). The general categories partition the code points
 *   (L{u,l,t,m,o} M N P S Z C, where C includes unassigned Cn), so a union of categories minus Han
 *   is the negated class of the other categories plus Han:
 *     [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]  =  [^\p{Ll}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}]      (UPPER)
 *     [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]        =  [^\p{Lu}\p{Lt}\p{N}\p{P}\p{S}\p{Z}\p{C}\p{Han}] (LOWER)
 *   One class each, no lookahead, so matching stays as fast as a plain class.
 * - \p{Han} in Rust is the Script property. PCRE2 (>= 10.40) reads a bare \p{Han} as Script_Extensions,
 *   which adds shared CJK punctuation (U+3001 、 U+3002 。 ...), so it is written \p{sc:Han}.
 * - \s in the Rust regex crate is the Unicode White_Space property; PCRE2's UCP \s leaves out U+0085,
 *   so the whitespace set is spelled out (WS below) and \S becomes [^WS].
 * - (?i:...) is kept: with PCRE2_UTF caseless matching uses Unicode case folding, so 's also matches
 *   'S and 'ſ (U+017F) as in Rust.
 * - Both engines are backtracking with leftmost-first alternation, so the same alternative wins and
 *   \s+(?!\S) gives back the last space before a word exactly as in fancy-regex.
 * Unicode data comes from PCRE2's tables (Unicode 14 in PCRE2 10.42), tiktoken's from a newer Unicode.
 * The code points on which they disagree (9,485, mostly CJK extensions H-J) are listed in
 * unicode_overrides.h, measured from both engines by tools/tokenizer/make_unicode_overrides.py; the
 * regex then runs over a copy of the text in which each is replaced by a same-length stand-in that
 * PCRE2 classes as tiktoken classes the original (tokenizer.c), and BPE reads the original bytes.
 * tests/test_tokenizer.c checks every code point against tiktoken in several contexts (the corpus
 * "codepoints_*" records). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <string.h>

#include "text/tokenizer_internal.h"

#define WS "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define UPPER "[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]"
#define LOWER "[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}\\p{sc:Han}]"
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

static const char kimi_pattern[] =
    "\\p{sc:Han}+"
    "|[^\\r\\n\\p{L}\\p{N}]?" UPPER "*" LOWER "+" CONTRACTION
    "|[^\\r\\n\\p{L}\\p{N}]?" UPPER "+" LOWER "*" CONTRACTION
    "|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"
    "|[" WS "]*[\\r\\n]+"
    "|[" WS "]+(?![^" WS "])"
    "|[" WS "]+";

int lunar_pretok_compile(lunar_tokenizer *tok, lunar_err *err) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)kimi_pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec,
                                   &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return lunar_fail(err, "compiling the pre-tokenisation regex at offset %zu: %s", (size_t)eo, (char *)msg);
    }
    /* JIT is an optimisation: without it (unsupported platform) pcre2_match interprets the same pattern */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    tok->re = re;
    return 0;
}

void lunar_pretok_free(lunar_tokenizer *tok) {
    pcre2_code_free(tok->re);
    tok->re = NULL;
}

int lunar_pretok_encode(const lunar_tokenizer *tok, const char *match, const char *text, size_t len, lunar_ids *out,
                        lunar_err *err) {
    if (len == 0) return 0;
    pcre2_code *re = tok->re;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    LUNAR_ASSERT(md);
    const PCRE2_SPTR s = (PCRE2_SPTR)match;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t off = 0;
    int rc = 0;
    while (off < len) {
        rc = pcre2_match(re, s, len, off, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc < 0) break;
        size_t a = ov[0], b = ov[1];
        lunar_bpe_piece(tok, (const uint8_t *)text + a, b - a, out);
        if (b == a) { /* cannot happen (no alternative matches empty); step over one character */
            b++;
            while (b < len && ((unsigned char)text[b] & 0xC0) == 0x80) b++;
        }
        off = b;
    }
    pcre2_match_data_free(md);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return lunar_fail(err, "pre-tokenisation regex failed at byte %zu: %s", off, (char *)msg);
    }
    return 0;
}
