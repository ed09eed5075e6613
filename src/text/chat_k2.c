#include "text/chat_k2.h"

#include <stdio.h>
#include <string.h>

#include "text/json_py.h"

static void header(lunar_chat_prompt *p, const char *tok, const char *name) {
    lunar_chat_special(p, tok);
    lunar_chat_texts(p, name);
    lunar_chat_special(p, "<|im_middle|>");
}

static int render_content(lunar_chat_prompt *p, const json_t *c, size_t mi, lunar_err *err) {
    if (!c || json_is_null(c)) return 0;
    if (json_is_string(c)) {
        lunar_chat_text(p, json_string_value(c), json_string_length(c));
        return 0;
    }
    if (!json_is_array(c)) return lunar_fail(err, "messages[%zu].content: must be a string, an array or null", mi);
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j);
        const char *type = json_string_value(json_object_get(part, "type"));
        const json_t *t = json_object_get(part, "text");
        if (type && (strcmp(type, "image_url") == 0 || strcmp(type, "image") == 0))
            return lunar_fail(err, "messages[%zu].content[%zu]: this model does not accept images", mi, j);
        if (!json_is_string(t)) return lunar_fail(err, "messages[%zu].content[%zu].text: must be a string", mi, j);
        lunar_chat_text(p, json_string_value(t), json_string_length(t));
    }
    return 0;
}

/* transformers renders the template to one string and BPEs each run between special tokens as a whole:
 * adjacent TEXT segments become one */
static void merge_text_runs(lunar_chat_prompt *p) {
    size_t w = 0;
    for (size_t r = 0; r < p->n_segs; r++) {
        if (w > 0 && p->segs[r].kind == LUNAR_SEG_TEXT && p->segs[w - 1].kind == LUNAR_SEG_TEXT &&
            p->segs[w - 1].off + p->segs[w - 1].len == p->segs[r].off)
            p->segs[w - 1].len += p->segs[r].len;
        else
            p->segs[w++] = p->segs[r];
    }
    p->n_segs = w;
}

int lunar_chat_k2_render(const json_t *req, lunar_chat_prompt *p, lunar_err *err) {
    memset(p, 0, sizeof *p);
    p->tools = json_array();
    p->effort = "max";
    if (!json_is_object(req)) return lunar_fail(err, "request: must be a JSON object");
    const json_t *msgs = json_object_get(req, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) return lunar_fail(err, "messages: must be a non-empty array");
    const json_t *tools = json_object_get(req, "tools");
    if (tools && !json_is_null(tools) && lunar_chat_collect_tools(p, tools, "tools", err) != 0) return -1;
    if (lunar_chat_parse_tool_choice(p, req, err) != 0) return -1;
    if (lunar_chat_parse_response_format(p, req, err) != 0) return -1;
    if (json_array_size(p->tools) > 0) {
        header(p, "<|im_system|>", "tool_declare");
        lunar_sbuf b = {0};
        lunar_json_py_dump(p->tools, LUNAR_JSON_PY_COMPACT | LUNAR_JSON_PY_SORT_KEYS, &b);
        lunar_chat_text(p, b.p, b.len);
        lunar_sbuf_free(&b);
        lunar_chat_special(p, "<|im_end|>");
    }
    const char *first = json_string_value(json_object_get(json_array_get(msgs, 0), "role"));
    if (!first || (strcmp(first, "system") != 0 && strcmp(first, "developer") != 0)) {
        header(p, "<|im_system|>", "system");
        lunar_chat_texts(p, "You are Kimi, an AI assistant created by Moonshot AI.");
        lunar_chat_special(p, "<|im_end|>");
    }
    size_t n_calls = 0;
    for (size_t mi = 0; mi < json_array_size(msgs); mi++) {
        const json_t *m = json_array_get(msgs, mi);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!json_is_object(m) || !role) return lunar_fail(err, "messages[%zu].role: must be a string", mi);
        const char *name = json_string_value(json_object_get(m, "name"));
        if (name && !*name) name = NULL;
        if (strcmp(role, "developer") == 0) role = "system";
        if (strcmp(role, "user") == 0) {
            header(p, "<|im_user|>", name ? name : "user");
        } else if (strcmp(role, "assistant") == 0) {
            header(p, "<|im_assistant|>", name ? name : "assistant");
        } else if (strcmp(role, "system") == 0 || strcmp(role, "tool") == 0) {
            header(p, "<|im_system|>", name ? name : role);
        } else {
            return lunar_fail(err, "messages[%zu].role: unknown role \"%s\"", mi, role);
        }
        if (strcmp(role, "tool") == 0) {
            const char *id = json_string_value(json_object_get(m, "tool_call_id"));
            if (!id) return lunar_fail(err, "messages[%zu].tool_call_id: required on a tool message", mi);
            lunar_sbuf b = {0};
            lunar_sbuf_printf(&b, "## Return of %s\n", id);
            const json_t *c = json_object_get(m, "content");
            if (json_is_string(c)) lunar_sbuf_put(&b, json_string_value(c), json_string_length(c));
            lunar_chat_text(p, b.p, b.len);
            lunar_sbuf_free(&b);
            if (!json_is_string(c) && render_content(p, c, mi, err) != 0) return -1;
        } else if (render_content(p, json_object_get(m, "content"), mi, err) != 0) {
            return -1;
        }
        const json_t *calls = json_object_get(m, "tool_calls");
        if (strcmp(role, "assistant") == 0 && json_array_size(calls) > 0) {
            lunar_chat_special(p, "<|tool_calls_section_begin|>");
            for (size_t ci = 0; ci < json_array_size(calls); ci++, n_calls++) {
                const json_t *tc = json_array_get(calls, ci);
                const json_t *fn = json_object_get(tc, "function");
                const char *fname = json_string_value(json_object_get(fn, "name"));
                if (!fname) return lunar_fail(err, "messages[%zu].tool_calls[%zu].function.name: must be a string", mi, ci);
                lunar_chat_special(p, "<|tool_call_begin|>");
                const char *id = json_string_value(json_object_get(tc, "id"));
                char gen[300];
                if (!id || !*id) snprintf(gen, sizeof gen, "functions.%s:%zu", fname, n_calls), id = gen;
                lunar_chat_texts(p, id);
                lunar_chat_special(p, "<|tool_call_argument_begin|>");
                const json_t *a = json_object_get(fn, "arguments");
                if (json_is_string(a)) {
                    lunar_chat_text(p, json_string_value(a), json_string_length(a));
                } else if (a && !json_is_null(a)) {
                    lunar_sbuf b = {0};
                    lunar_json_py_dump(a, 0, &b); /* Jinja tojson: json.dumps defaults (", " ": ") */
                    lunar_chat_text(p, b.p, b.len);
                    lunar_sbuf_free(&b);
                }
                lunar_chat_special(p, "<|tool_call_end|>");
            }
            lunar_chat_special(p, "<|tool_calls_section_end|>");
        }
        lunar_chat_special(p, "<|im_end|>");
    }
    header(p, "<|im_assistant|>", "assistant");
    merge_text_runs(p);
    return 0;
}
