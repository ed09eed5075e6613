#include "text/chat_k3.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/json_py.h"

/* ---- tags ---- */

static void attr(lunar_chat_prompt *p, const char *key, const char *value) {
    char k[64];
    snprintf(k, sizeof k, " %s", key);
    lunar_chat_texts(p, k);
    lunar_chat_texts(p, "=\"");
    lunar_sbuf v = {0};
    for (const char *s = value; *s; s++) {
        if (*s == '&') lunar_sbuf_puts(&v, "&amp;");
        else if (*s == '"') lunar_sbuf_puts(&v, "&quot;");
        else lunar_sbuf_putc(&v, *s);
    }
    lunar_chat_text(p, v.p, v.len);
    lunar_sbuf_free(&v);
    lunar_chat_texts(p, "\"");
}

/* open_tag(p, tag, key1, value1, ..., NULL) */
static void open_tag(lunar_chat_prompt *p, const char *tag, ...) {
    va_list ap;
    lunar_chat_special(p, LUNAR_K3_OPEN);
    lunar_chat_texts(p, tag);
    va_start(ap, tag);
    for (const char *k; (k = va_arg(ap, const char *));) attr(p, k, va_arg(ap, const char *));
    va_end(ap);
    lunar_chat_special(p, LUNAR_K3_SEP);
}

static void close_tag(lunar_chat_prompt *p, const char *tag) {
    lunar_chat_special(p, LUNAR_K3_CLOSE);
    lunar_chat_texts(p, tag);
    lunar_chat_special(p, LUNAR_K3_SEP);
}

static void end_message(lunar_chat_prompt *p) {
    close_tag(p, "message");
    lunar_chat_special(p, LUNAR_K3_END_OF_MSG);
}

static void internal_message(lunar_chat_prompt *p, const char *type, const char *body, size_t n) {
    open_tag(p, "message", "role", "system", "type", type, NULL);
    lunar_chat_text(p, body, n);
    end_message(p);
}

static void tool_declare(lunar_chat_prompt *p, const json_t *tools, int dynamic) {
    lunar_sbuf b = {0};
    lunar_sbuf_puts(&b, dynamic ? "## New Tools Available\n"
                                  "The system dynamically extends the toolset via lazy-loading.\n"
                                  "You have access to all existing and extended tools.\n"
                                  "Here are the specs for the extended tools.\n\n```json\n"
                                : "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
    lunar_json_py_dump(tools, LUNAR_JSON_PY_COMPACT | LUNAR_JSON_PY_SORT_KEYS, &b);
    lunar_sbuf_puts(&b, "\n```");
    open_tag(p, "message", "role", "system", "type", "tool-declare", NULL);
    lunar_chat_text(p, b.p, b.len);
    end_message(p);
    lunar_sbuf_free(&b);
}

/* ---- validation helpers ---- */

static int content_ok(const json_t *c, size_t mi, lunar_err *err) {
    if (!c || json_is_null(c) || json_is_string(c)) return 0;
    if (!json_is_array(c)) return lunar_fail(err, "messages[%zu].content: must be a string, an array or null", mi);
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (!json_is_object(part) || !type)
            return lunar_fail(err, "messages[%zu].content[%zu]: must be an object with a string type", mi, j);
        if (strcmp(type, "image_url") == 0 || strcmp(type, "image") == 0) {
            const json_t *u = json_object_get(part, type);
            if (json_is_object(u)) u = json_object_get(u, "url");
            if (!json_is_string(u))
                return lunar_fail(err, "messages[%zu].content[%zu].%s: must hold a url string", mi, j, type);
        } else if (!json_is_string(json_object_get(part, "text"))) {
            return lunar_fail(err, "messages[%zu].content[%zu].text: must be a string", mi, j);
        }
    }
    return 0;
}

static int content_is_empty(const json_t *c) {
    return !c || json_is_null(c) || (json_is_string(c) && json_string_length(c) == 0) ||
           (json_is_array(c) && json_array_size(c) == 0);
}

static void render_content(lunar_chat_prompt *p, const json_t *c) {
    if (json_is_string(c)) {
        lunar_chat_text(p, json_string_value(c), json_string_length(c));
        return;
    }
    for (size_t j = 0; j < json_array_size(c); j++) {
        const json_t *part = json_array_get(c, j);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (strcmp(type, "image_url") == 0 || strcmp(type, "image") == 0) {
            const json_t *u = json_object_get(part, type);
            if (json_is_object(u)) u = json_object_get(u, "url");
            p->image_urls = realloc(p->image_urls, (p->n_images + 1) * sizeof *p->image_urls);
            LUNAR_ASSERT(p->image_urls != NULL);
            p->image_urls[p->n_images] = strdup(json_string_value(u));
            lunar_chat_seg_add(p, LUNAR_SEG_IMAGE, LUNAR_K3_IMAGE_PLACEHOLDER,
                               strlen(LUNAR_K3_IMAGE_PLACEHOLDER), (int)p->n_images);
            p->n_images++;
        } else {
            const json_t *t = json_object_get(part, "text");
            lunar_chat_text(p, json_string_value(t), json_string_length(t));
        }
    }
}

static const char *role_of(const json_t *m) {
    const char *r = json_string_value(json_object_get(m, "role"));
    return r && strcmp(r, "developer") == 0 ? "system" : r;
}

/* Parsed arguments of one history call: an object (new ref), or raw text for a json block. */
typedef struct {
    json_t *obj;
    const char *raw;
    size_t raw_len;
} call_args;

static int parse_arguments(const json_t *a, call_args *out, size_t mi, size_t ci, lunar_err *err) {
    out->obj = NULL, out->raw = NULL;
    if (!a || json_is_null(a)) return 0;
    if (json_is_object(a)) {
        out->obj = json_incref((json_t *)a);
        return 0;
    }
    if (!json_is_string(a))
        return lunar_fail(err, "messages[%zu].tool_calls[%zu].function.arguments: must be a JSON object string", mi, ci);
    const char *s = json_string_value(a);
    if (lunar_py_is_blank(s, json_string_length(a))) return 0;
    json_error_t je;
    json_t *v = json_loadb(s, json_string_length(a), JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!v) {
        if (strstr(je.text, "too big") || strstr(je.text, "overflow"))
            return lunar_fail(err, "messages[%zu].tool_calls[%zu].function.arguments: number out of range (%s)",
                              mi, ci, je.text);
        out->raw = s, out->raw_len = json_string_length(a); /* not JSON: rendered verbatim in a json block */
        return 0;
    }
    if (!json_is_object(v)) {
        json_decref(v);
        return lunar_fail(err, "messages[%zu].tool_calls[%zu].function.arguments: must be a JSON object", mi, ci);
    }
    out->obj = v;
    return 0;
}

static const char *xtml_type(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    case JSON_INTEGER:
    case JSON_REAL: return "number";
    case JSON_STRING: return "string";
    case JSON_OBJECT: return "object";
    default: return "array";
    }
}

static int render_assistant(lunar_chat_prompt *p, const json_t *m, size_t mi, lunar_err *err) {
    const char *name = json_string_value(json_object_get(m, "name"));
    if (name && *name) open_tag(p, "message", "role", "assistant", "name", name, NULL);
    else open_tag(p, "message", "role", "assistant", NULL);
    if (p->thinking) {
        const json_t *r = json_object_get(m, "reasoning_content");
        if (!json_is_string(r) || json_string_length(r) == 0) r = json_object_get(m, "reasoning");
        open_tag(p, "think", NULL);
        if (json_is_string(r) && !lunar_py_is_blank(json_string_value(r), json_string_length(r)))
            lunar_chat_text(p, json_string_value(r), json_string_length(r));
        close_tag(p, "think");
    }
    open_tag(p, "response", NULL);
    render_content(p, json_object_get(m, "content"));
    close_tag(p, "response");
    const json_t *calls = json_object_get(m, "tool_calls");
    if (json_array_size(calls) > 0) {
        open_tag(p, "tools", NULL);
        for (size_t ci = 0; ci < json_array_size(calls); ci++) {
            const json_t *fn = json_object_get(json_array_get(calls, ci), "function");
            char idx[24];
            snprintf(idx, sizeof idx, "%zu", ci + 1);
            call_args a;
            if (parse_arguments(json_object_get(fn, "arguments"), &a, mi, ci, err) != 0) return -1;
            open_tag(p, "call", "tool", json_string_value(json_object_get(fn, "name")), "index", idx, NULL);
            if (a.raw) {
                open_tag(p, "json", "type", "object", NULL);
                lunar_chat_text(p, a.raw, a.raw_len);
                close_tag(p, "json");
            } else if (a.obj) {
                const char *key;
                json_t *val;
                json_object_foreach(a.obj, key, val) {
                    open_tag(p, "argument", "key", key, "type", xtml_type(val), NULL);
                    if (json_is_string(val)) {
                        lunar_chat_text(p, json_string_value(val), json_string_length(val));
                    } else {
                        lunar_sbuf b = {0};
                        lunar_json_py_dump(val, 0, &b);
                        lunar_chat_text(p, b.p, b.len);
                        lunar_sbuf_free(&b);
                    }
                    close_tag(p, "argument");
                }
                json_decref(a.obj);
            }
            close_tag(p, "call");
        }
        close_tag(p, "tools");
    }
    end_message(p);
    return 0;
}

static int validate_message(lunar_chat_prompt *p, const json_t *m, size_t mi, lunar_err *err) {
    if (!json_is_object(m)) return lunar_fail(err, "messages[%zu]: must be an object", mi);
    const char *role = json_string_value(json_object_get(m, "role"));
    if (!role) return lunar_fail(err, "messages[%zu].role: must be a string", mi);
    int sys = strcmp(role, "system") == 0 || strcmp(role, "developer") == 0;
    if (!sys && strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0 && strcmp(role, "tool") != 0)
        return lunar_fail(err, "messages[%zu].role: unknown role \"%s\"", mi, role);
    const json_t *name = json_object_get(m, "name");
    if (name && !json_is_null(name) && !json_is_string(name))
        return lunar_fail(err, "messages[%zu].name: must be a string", mi);
    if (content_ok(json_object_get(m, "content"), mi, err) != 0) return -1;
    const json_t *tools = json_object_get(m, "tools");
    if (tools && !json_is_null(tools)) {
        if (strcmp(role, "system") != 0)
            return lunar_fail(err, "messages[%zu].tools: only system messages may declare tools", mi);
        if (!json_is_array(tools)) return lunar_fail(err, "messages[%zu].tools: must be an array", mi);
        if (json_array_size(tools) > 0) {
            if (!content_is_empty(json_object_get(m, "content")))
                return lunar_fail(err, "messages[%zu].content: must be empty on a system message with tools", mi);
            char path[64];
            snprintf(path, sizeof path, "messages[%zu].tools", mi);
            if (lunar_chat_collect_tools(p, tools, path, err) != 0) return -1;
        }
    }
    if (strcmp(role, "tool") == 0 && !json_is_string(json_object_get(m, "tool_call_id")))
        return lunar_fail(err, "messages[%zu].tool_call_id: required on a tool message", mi);
    if (strcmp(role, "assistant") == 0) {
        const json_t *r = json_object_get(m, "reasoning_content");
        if (r && !json_is_null(r) && !json_is_string(r))
            return lunar_fail(err, "messages[%zu].reasoning_content: must be a string", mi);
        const json_t *calls = json_object_get(m, "tool_calls");
        if (calls && !json_is_null(calls)) {
            if (!json_is_array(calls)) return lunar_fail(err, "messages[%zu].tool_calls: must be an array", mi);
            for (size_t ci = 0; ci < json_array_size(calls); ci++) {
                const json_t *tc = json_array_get(calls, ci);
                const json_t *fn = json_object_get(tc, "function");
                if (!json_is_object(tc) || !json_is_object(fn))
                    return lunar_fail(err, "messages[%zu].tool_calls[%zu].function: must be an object", mi, ci);
                if (!json_is_string(json_object_get(fn, "name")))
                    return lunar_fail(err, "messages[%zu].tool_calls[%zu].function.name: must be a string", mi, ci);
                const json_t *id = json_object_get(tc, "id");
                if (id && !json_is_null(id) && !json_is_string(id))
                    return lunar_fail(err, "messages[%zu].tool_calls[%zu].id: must be a string", mi, ci);
                call_args a; /* validate now so a bad call fails before any rendering */
                if (parse_arguments(json_object_get(fn, "arguments"), &a, mi, ci, err) != 0) return -1;
                json_decref(a.obj);
            }
        }
    }
    return 0;
}

/* Position (1-based) of the call with this id in the assistant's tool_calls, or 0. */
static size_t call_position(const json_t *calls, const char *id) {
    for (size_t ci = 0; ci < json_array_size(calls); ci++) {
        const char *cid = json_string_value(json_object_get(json_array_get(calls, ci), "id"));
        if (cid && strcmp(cid, id) == 0) return ci + 1;
    }
    return 0;
}

typedef struct {
    size_t mi;        /* message index */
    const char *tool; /* resolved tool name for tool messages (NULL: resolve at render time) */
    size_t pos;
} order_item;

static int cmp_pos(const void *a, const void *b) {
    const order_item *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return x->mi < y->mi ? -1 : (x->mi > y->mi);
}

int lunar_chat_k3_render(const json_t *req, lunar_chat_prompt *p, lunar_err *err) {
    memset(p, 0, sizeof *p);
    p->stub_tokens = 3;
    p->tools = json_array();
    if (!json_is_object(req)) return lunar_fail(err, "request: must be a JSON object");
    const json_t *msgs = json_object_get(req, "messages");
    if (!json_is_array(msgs)) return lunar_fail(err, "messages: must be an array");
    size_t n = json_array_size(msgs);
    if (n == 0) return lunar_fail(err, "messages: must not be empty");
    const json_t *tools = json_object_get(req, "tools");
    if (tools && !json_is_null(tools) && lunar_chat_collect_tools(p, tools, "tools", err) != 0) return -1;
    for (size_t i = 0; i < n; i++)
        if (validate_message(p, json_array_get(msgs, i), i, err) != 0) return -1;
    if (lunar_chat_parse_thinking(p, req, err) != 0) return -1;
    if (lunar_chat_parse_tool_choice(p, req, err) != 0) return -1;
    if (lunar_chat_parse_response_format(p, req, err) != 0) return -1;

    /* tool results: each run is reordered to the preceding assistant's call order when every id matches */
    order_item *order = lunar_xcalloc(n, sizeof *order);
    const json_t *calls = NULL;
    for (size_t i = 0; i < n;) {
        const json_t *m = json_array_get(msgs, i);
        const char *role = role_of(m);
        if (strcmp(role, "tool") != 0) {
            if (strcmp(role, "assistant") == 0) calls = json_object_get(m, "tool_calls");
            order[i] = (order_item){i, NULL, 0};
            i++;
            continue;
        }
        size_t start = i, all = 1;
        for (; i < n && strcmp(role_of(json_array_get(msgs, i)), "tool") == 0; i++) {
            const char *id = json_string_value(json_object_get(json_array_get(msgs, i), "tool_call_id"));
            size_t pos = call_position(calls, id);
            const char *nm = pos ? json_string_value(json_object_get(
                                       json_object_get(json_array_get(calls, pos - 1), "function"), "name"))
                                 : NULL;
            order[i] = (order_item){i, nm, pos};
            if (!pos) all = 0;
        }
        if (all) qsort(order + start, i - start, sizeof *order, cmp_pos);
        else
            for (size_t k = start; k < i; k++) order[k].tool = NULL;
    }

    if (json_array_size(tools) > 0) tool_declare(p, tools, 0);
    if (p->thinking) {
        char body[320];
        int len = snprintf(body, sizeof body,
                           "`thinking_effort` guides on how much to think in your thinking channel (not including the "
                           "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                           "Now the system is invoked with `thinking_effort=%s`.",
                           p->effort);
        internal_message(p, "thinking-effort", body, (size_t)len);
    }
    size_t tool_index = 0;
    calls = NULL;
    int rc = 0;
    for (size_t k = 0; k < n && rc == 0; k++) {
        size_t mi = order[k].mi;
        const json_t *m = json_array_get(msgs, mi);
        const char *role = role_of(m);
        const char *name = json_string_value(json_object_get(m, "name"));
        if (name && !*name) name = NULL;
        if (strcmp(role, "system") == 0 && json_array_size(json_object_get(m, "tools")) > 0) {
            tool_declare(p, json_object_get(m, "tools"), 1);
        } else if (strcmp(role, "system") == 0 || strcmp(role, "user") == 0) {
            if (name) open_tag(p, "message", "role", role, "name", name, NULL);
            else open_tag(p, "message", "role", role, NULL);
            render_content(p, json_object_get(m, "content"));
            end_message(p);
        } else if (strcmp(role, "tool") == 0) {
            tool_index++;
            const char *tool = order[k].tool;
            if (!tool) tool = json_string_value(json_object_get(m, "tool"));
            if (!tool) tool = name;
            if (!tool && tool_index <= json_array_size(calls))
                tool = json_string_value(
                    json_object_get(json_object_get(json_array_get(calls, tool_index - 1), "function"), "name"));
            if (!tool) {
                rc = lunar_fail(err, "messages[%zu].tool_call_id: matches no call of the preceding assistant message",
                                mi);
                break;
            }
            char idx[24];
            snprintf(idx, sizeof idx, "%zu", tool_index);
            open_tag(p, "message", "role", "tool", "tool", tool, "index", idx, NULL);
            render_content(p, json_object_get(m, "content"));
            end_message(p);
        } else { /* assistant */
            calls = json_object_get(m, "tool_calls");
            tool_index = 0;
            rc = render_assistant(p, m, mi, err);
        }
    }
    free(order);
    if (rc != 0) return -1;

    if (p->tool_choice == LUNAR_TOOL_CHOICE_REQUIRED) {
        static const char b[] = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.";
        internal_message(p, "tool-choice", b, sizeof b - 1);
    } else if (p->tool_choice == LUNAR_TOOL_CHOICE_NONE) {
        static const char b[] =
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.";
        internal_message(p, "tool-choice", b, sizeof b - 1);
    }
    static const char raw[] = "Your response must be raw JSON data without markdown code blocks (```json) or any "
                              "additional formatting.";
    if (p->response_format == LUNAR_RESPONSE_JSON_OBJECT) {
        lunar_sbuf b = {0};
        lunar_sbuf_puts(&b, "The system is invoked with `response_format=json_object`.\n");
        lunar_sbuf_puts(&b, raw);
        internal_message(p, "response-format", b.p, b.len);
        lunar_sbuf_free(&b);
    } else if (p->response_format == LUNAR_RESPONSE_JSON_SCHEMA) {
        lunar_sbuf b = {0};
        lunar_sbuf_puts(&b, "The system is invoked with `response_format=json_schema`.\n");
        lunar_sbuf_puts(&b, raw);
        lunar_sbuf_puts(&b, "\nThe JSON data must match the following schema:\n```json\n");
        lunar_json_py_dump(p->response_schema, LUNAR_JSON_PY_COMPACT | LUNAR_JSON_PY_SORT_KEYS, &b);
        lunar_sbuf_puts(&b, "\n```");
        internal_message(p, "response-format", b.p, b.len);
        lunar_sbuf_free(&b);
    }
    open_tag(p, "message", "role", "assistant", NULL);
    open_tag(p, p->thinking ? "think" : "response", NULL);
    return 0;
}
