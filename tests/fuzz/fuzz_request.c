/* libFuzzer target: request bodies through parsing, validation, rendering and tokenization for both formats
 * (K3 with the sampling guard, K2 without) and both endpoints, then a short recorded event sequence through
 * the response assembler (stream and not). Nothing may crash, leak or read out of bounds; every failure must
 * be a 4xx with a JSON error body. Run from the repository root (it loads the bundled tokenizer). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/assemble.h"
#include "server/request.h"

static lunar_tokenizer *tok_k3, *tok_k2;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    lunar_err err;
    if (lunar_tokenizer_load_files(&tok_k3, "data/kimi-tokenizer/tiktoken.model",
                                   "data/kimi-tokenizer/tokenizer_config.k3.json", &err) ||
        lunar_tokenizer_load(&tok_k2, "models/kimi-linear-tiny", &err)) {
        fprintf(stderr, "fuzz_request: %s (run from the repository root)\n", err.msg);
        abort();
    }
    return 0;
}

static void one(const lunar_srv_policy *pol, const lunar_tokenizer *tok, lunar_srv_kind kind, const uint8_t *d,
                size_t n) {
    lunar_srv_req r;
    lunar_api_error e;
    if (lunar_srv_parse(pol, tok, kind, (const char *)d, n, &r, &e)) {
        if (e.status < 400 || e.status >= 500) abort();
        char *s = lunar_api_error_json(&e);
        if (!s) abort();
        free(s);
        return;
    }
    for (int stream = 0; stream < 2; stream++) {
        r.stream = stream;
        lunar_srv_resp *rs = lunar_srv_resp_new(&r, tok, "x", 0);
        lunar_sbuf out = {0};
        /* replay some of the prompt's own ids as output: control tokens included */
        for (size_t i = 0; i < r.ids.n && i < 64; i++)
            for (int c = 0; c < r.n; c++) {
                lunar_event ev = {.has_token = 1, .token = r.ids.ids[i], .logprob = -1, .n_top = 1,
                                  .top_ids = {r.ids.ids[0]}};
                lunar_srv_resp_event(rs, c, &ev, &out);
            }
        for (int c = 0; c < r.n; c++) {
            lunar_event ev = {.finish = (c & 1) ? LUNAR_FINISH_LENGTH : LUNAR_FINISH_STOP};
            lunar_srv_resp_event(rs, c, &ev, &out);
        }
        if (stream) lunar_srv_resp_stream_end(rs, &out);
        else free(lunar_srv_resp_json(rs));
        lunar_sbuf_free(&out);
        lunar_srv_resp_free(rs);
    }
    lunar_srv_req_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
    static const char *names[] = {"m"};
    lunar_srv_policy k3 = {.arch = LUNAR_ARCH_KIMI_K3, .model_names = names, .n_model_names = 1,
                           .sampling_guard = 1, .max_model_len = 4096, .max_n = 1, .vocab_size = 163840};
    lunar_srv_policy k2 = {.arch = LUNAR_ARCH_KIMI_LINEAR, .max_model_len = 4096, .max_n = 4, .vocab_size = 163840};
    one(&k3, tok_k3, LUNAR_SRV_CHAT, d, n);
    one(&k2, tok_k2, LUNAR_SRV_CHAT, d, n);
    one(&k2, tok_k2, LUNAR_SRV_COMPLETION, d, n);
    return 0;
}
