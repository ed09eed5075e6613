/* Rendered K3 prompts tokenised by the C tokenizer give exactly the ids recorded with Python
 * tiktoken and Moonshot's rendering logic (tests/data/chat/k3_cases.jsonl, made by
 * tools/chat/render_k3_reference.py), including KVV's fixed counts 36, 119 and 99. */
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "text/prompt.h"
#include "test.h"

TEST(prompt_k3_ids_match_tiktoken_goldens) {
    lunar_tokenizer *tok;
    lunar_err err;
    if (lunar_tokenizer_load_files(&tok, "data/kimi-tokenizer/tiktoken.model",
                                   "data/kimi-tokenizer/tokenizer_config.k3.json", &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    char *text;
    size_t len;
    CHECK(lunar_read_file("tests/data/chat/k3_cases.jsonl", 1 << 24, &text, &len, &err) == 0);
    int cases = 0, kvv = 0, images = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *c = json_loads(line, 0, NULL);
        if (!c) continue;
        const char *name = json_string_value(json_object_get(c, "name"));
        json_t *want = json_object_get(c, "ids");
        lunar_chat_prompt p;
        memset(&p, 0, sizeof p);
        if (lunar_chat_render(LUNAR_ARCH_KIMI_K3, json_object_get(c, "request"), &p, &err) != 0) {
            CHECK_MSG(0, "%s: %s", name, err.msg);
        } else if (p.n_images) {
            images++; /* image ids need the vision encoder's sizes: covered by the vision work */
        } else {
            lunar_ids ids = {0};
            if (lunar_prompt_ids(tok, &p, &ids, &err) != 0) {
                CHECK_MSG(0, "%s: %s", name, err.msg);
            } else {
                int same = ids.n == json_array_size(want);
                for (size_t i = 0; same && i < ids.n; i++)
                    same = ids.ids[i] == json_integer_value(json_array_get(want, i));
                CHECK_MSG(same, "%s: ids differ (%zu vs %zu)", name, ids.n, json_array_size(want));
                long pt = (long)(ids.n - p.stub_tokens);
                CHECK_MSG(pt == json_integer_value(json_object_get(c, "prompt_tokens")), "%s: prompt_tokens %ld",
                          name, pt);
                kvv += pt == 36 || pt == 119 || pt == 99;
            }
            lunar_ids_free(&ids);
        }
        lunar_chat_prompt_free(&p);
        json_decref(c);
        cases++;
    }
    CHECK(cases >= 15 && images <= 1);
    CHECK_MSG(kvv >= 3, "KVV's counts 36, 119, 99 reproduced %d times", kvv);
    free(text);
    lunar_tokenizer_free(tok);
}
