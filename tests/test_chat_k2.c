/* K2 (Kimi-Linear) renderer: the frame of reference/api.md §2, checked on the joined text and segment kinds. */
#include <stdlib.h>
#include <string.h>

#include "chat_cases.h"
#include "test.h"
#include "text/chat_k2.h"

TEST(chat_k2_frame) {
    json_error_t je;
    json_t *req = json_loads(
        "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}],"
        "\"messages\":[{\"role\":\"user\",\"content\":\"Hi <|im_end|>\"},"
        "{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"functions.f:0\",\"type\":\"function\","
        "\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\": 1}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"functions.f:0\",\"content\":\"ok\"}]}",
        0, &je);
    CHECK_MSG(req != NULL, "%s", je.text);
    lunar_chat_prompt p;
    lunar_err err;
    CHECK_MSG(lunar_chat_k2_render(req, &p, &err) == 0, "%s", err.msg);
    const char *want =
        "<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}},"
        "\"type\":\"function\"}]<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi <|im_end|><|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:0\nok<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>";
    CHECK_MSG(strcmp(lunar_chat_prompt_text(&p), want) == 0, "got %s", lunar_chat_prompt_text(&p));
    /* the user's literal "<|im_end|>" is text, the frame's is special */
    int specials = 0, text_im_end = 0;
    for (size_t i = 0; i < p.n_segs; i++) {
        const lunar_chat_seg *s = &p.segs[i];
        specials += s->kind == LUNAR_SEG_SPECIAL;
        if (s->kind == LUNAR_SEG_TEXT && strstr(p.bytes.p + s->off, "<|im_end|>") == p.bytes.p + s->off + 3) text_im_end++;
    }
    CHECK(text_im_end == 1);
    CHECK(specials == 22);
    CHECK(p.thinking == 0 && p.stub_tokens == 0);
    lunar_chat_prompt_free(&p);
    json_decref(req);
}

static void k2_case(const json_t *c, void *ctx) {
    (void)ctx;
    const char *name = json_string_value(json_object_get(c, "name"));
    lunar_chat_prompt p;
    lunar_err err;
    if (lunar_chat_k2_render(json_object_get(c, "request"), &p, &err) != 0) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        lunar_chat_prompt_free(&p); /* the renderer leaves p freeable on failure */
        return;
    }
    const char *want = json_string_value(json_object_get(c, "text"));
    CHECK_MSG(strcmp(lunar_chat_prompt_text(&p), want) == 0, "%s: got\n%s\nwant\n%s", name,
              lunar_chat_prompt_text(&p), want);
    test_same_segments(&p, json_object_get(c, "segments"), name);
    lunar_chat_prompt_free(&p);
}

/* byte-for-byte and segment-for-segment against tools/chat/render_k2_reference.py (api.md §2 semantics) */
TEST(chat_k2_golden) { CHECK(test_jsonl_each("tests/data/chat/k2_cases.jsonl", k2_case, NULL) >= 8); }
