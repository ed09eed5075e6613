#include "text/chat.h"

#include <stdlib.h>
#include <string.h>

void lunar_chat_prompt_free(lunar_chat_prompt *p) {
    lunar_sbuf_free(&p->bytes);
    free(p->segs);
    free(p->tool_choice_name);
    json_decref(p->response_schema);
    json_decref(p->tools);
    for (size_t i = 0; i < p->n_images; i++) free(p->image_urls[i]);
    free(p->image_urls);
    memset(p, 0, sizeof *p);
}

void lunar_chat_seg_add(lunar_chat_prompt *p, lunar_seg_kind kind, const char *s, size_t n, int image) {
    if (n == 0) return;
    if (p->n_segs == p->cap_segs) {
        p->cap_segs = p->cap_segs ? 2 * p->cap_segs : 64;
        p->segs = realloc(p->segs, p->cap_segs * sizeof *p->segs);
        LUNAR_ASSERT(p->segs != NULL);
    }
    p->segs[p->n_segs++] = (lunar_chat_seg){p->bytes.len, n, kind, image};
    lunar_sbuf_put(&p->bytes, s, n);
}

void lunar_chat_texts(lunar_chat_prompt *p, const char *s) { lunar_chat_text(p, s, strlen(s)); }

void lunar_chat_special(lunar_chat_prompt *p, const char *token) {
    lunar_chat_seg_add(p, LUNAR_SEG_SPECIAL, token, strlen(token), -1);
}

/* Python str.isspace for one code point */
static int py_space(unsigned cp) {
    return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

int lunar_py_is_blank(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned cp = u[i];
        size_t k = 1;
        if (cp >= 0xc0 && cp < 0xe0 && i + 1 < n) cp = ((cp & 0x1f) << 6) | (u[i + 1] & 0x3f), k = 2;
        else if (cp >= 0xe0 && cp < 0xf0 && i + 2 < n)
            cp = ((cp & 0x0f) << 12) | ((u[i + 1] & 0x3f) << 6) | (u[i + 2] & 0x3f), k = 3;
        else if (cp >= 0xf0) k = 4;
        if (!py_space(cp)) return 0;
        i += k;
    }
    return 1;
}

static int valid_tool_name(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 256) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
        int more = (c >= '0' && c <= '9') || c == '-';
        if (!(alpha || (i > 0 && more))) return 0;
    }
    return 1;
}

static const char *tool_name(const json_t *tool) {
    return json_string_value(json_object_get(json_object_get(tool, "function"), "name"));
}

int lunar_chat_collect_tools(lunar_chat_prompt *p, const json_t *tools, const char *path, lunar_err *err) {
    if (!p->tools) p->tools = json_array();
    if (!json_is_array(tools)) return lunar_fail(err, "%s: must be an array", path);
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const json_t *t = json_array_get(tools, i);
        if (!json_is_object(t)) return lunar_fail(err, "%s[%zu]: must be an object", path, i);
        const json_t *type = json_object_get(t, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)
            return lunar_fail(err, "%s[%zu].type: must be \"function\"", path, i);
        const json_t *fn = json_object_get(t, "function");
        if (!json_is_object(fn)) return lunar_fail(err, "%s[%zu].function: must be an object", path, i);
        const json_t *name = json_object_get(fn, "name");
        if (!json_is_string(name)) return lunar_fail(err, "%s[%zu].function.name: must be a string", path, i);
        if (!valid_tool_name(json_string_value(name)))
            return lunar_fail(err, "%s[%zu].function.name: must match ^[A-Za-z_][A-Za-z0-9_-]{0,255}$", path, i);
        const json_t *params = json_object_get(fn, "parameters");
        if (params && !json_is_object(params) && !json_is_null(params))
            return lunar_fail(err, "%s[%zu].function.parameters: must be an object", path, i);
        const json_t *strict = json_object_get(fn, "strict");
        if (strict && !json_is_boolean(strict) && !json_is_null(strict))
            return lunar_fail(err, "%s[%zu].function.strict: must be a boolean", path, i);
        for (size_t j = 0; j < json_array_size(p->tools); j++)
            if (strcmp(tool_name(json_array_get(p->tools, j)), json_string_value(name)) == 0)
                return lunar_fail(err, "%s[%zu].function.name: duplicate tool name \"%s\"", path, i,
                                  json_string_value(name));
        json_array_append(p->tools, (json_t *)t);
    }
    return 0;
}

int lunar_chat_parse_tool_choice(lunar_chat_prompt *p, const json_t *req, lunar_err *err) {
    const json_t *tc = json_object_get(req, "tool_choice");
    size_t n_tools = p->tools ? json_array_size(p->tools) : 0;
    p->tool_choice = LUNAR_TOOL_CHOICE_AUTO;
    if (!tc || json_is_null(tc)) return 0;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "auto") == 0) return 0;
        if (strcmp(s, "none") == 0) {
            p->tool_choice = LUNAR_TOOL_CHOICE_NONE;
            return 0;
        }
        if (strcmp(s, "required") == 0) {
            if (n_tools == 0) return lunar_fail(err, "tool_choice: \"required\" needs at least one tool");
            p->tool_choice = LUNAR_TOOL_CHOICE_REQUIRED;
            return 0;
        }
        return lunar_fail(err, "tool_choice: must be \"auto\", \"none\", \"required\" or a named function");
    }
    const json_t *name = json_object_get(json_object_get(tc, "function"), "name");
    if (!json_is_object(tc) || !json_is_string(name))
        return lunar_fail(err, "tool_choice: must be \"auto\", \"none\", \"required\" or "
                               "{\"type\":\"function\",\"function\":{\"name\":...}}");
    for (size_t j = 0; j < n_tools; j++)
        if (strcmp(tool_name(json_array_get(p->tools, j)), json_string_value(name)) == 0) {
            p->tool_choice = LUNAR_TOOL_CHOICE_NAMED;
            p->tool_choice_name = strdup(json_string_value(name));
            return 0;
        }
    return lunar_fail(err, "tool_choice.function.name: no tool named \"%s\"", json_string_value(name));
}

int lunar_chat_parse_response_format(lunar_chat_prompt *p, const json_t *req, lunar_err *err) {
    const json_t *rf = json_object_get(req, "response_format");
    p->response_format = LUNAR_RESPONSE_TEXT;
    if (!rf || json_is_null(rf)) return 0;
    if (!json_is_object(rf)) return lunar_fail(err, "response_format: must be an object");
    const char *type = json_string_value(json_object_get(rf, "type"));
    if (!type) return lunar_fail(err, "response_format.type: must be a string");
    if (strcmp(type, "text") == 0) return 0;
    if (strcmp(type, "json_object") == 0) {
        p->response_format = LUNAR_RESPONSE_JSON_OBJECT;
        return 0;
    }
    if (strcmp(type, "json_schema") != 0)
        return lunar_fail(err, "response_format.type: must be \"text\", \"json_object\" or \"json_schema\"");
    const json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) return lunar_fail(err, "response_format.json_schema: must be an object");
    if (!json_is_string(json_object_get(js, "name")))
        return lunar_fail(err, "response_format.json_schema.name: must be a string");
    const json_t *schema = json_object_get(js, "schema");
    if (!json_is_object(schema)) return lunar_fail(err, "response_format.json_schema.schema: must be an object");
    const json_t *strict = json_object_get(js, "strict");
    if (strict && !json_is_boolean(strict) && !json_is_null(strict))
        return lunar_fail(err, "response_format.json_schema.strict: must be a boolean");
    p->response_format = LUNAR_RESPONSE_JSON_SCHEMA;
    p->response_schema = json_incref((json_t *)schema);
    p->response_strict = json_is_true(strict);
    return 0;
}

static const char *effort_name(const char *s) {
    static const char *const names[] = {"low", "high", "max"};
    for (int i = 0; i < 3; i++)
        if (strcmp(s, names[i]) == 0) return names[i];
    return NULL;
}

int lunar_chat_parse_thinking(lunar_chat_prompt *p, const json_t *req, lunar_err *err) {
    const json_t *kw = json_object_get(req, "chat_template_kwargs");
    const json_t *th = json_object_get(req, "thinking");
    const json_t *re = json_object_get(req, "reasoning_effort");
    const char *effort = NULL, *effort_field = NULL;
    int thinking = 1;
    if (kw && !json_is_null(kw)) {
        if (!json_is_object(kw)) return lunar_fail(err, "chat_template_kwargs: must be an object");
        const json_t *t = json_object_get(kw, "thinking");
        if (t && !json_is_null(t)) {
            if (!json_is_boolean(t)) return lunar_fail(err, "chat_template_kwargs.thinking: must be a boolean");
            thinking = json_is_true(t);
        }
        const json_t *e = json_object_get(kw, "thinking_effort");
        if (e && !json_is_null(e)) {
            if (!json_is_string(e)) return lunar_fail(err, "chat_template_kwargs.thinking_effort: must be a string");
            effort = json_string_value(e), effort_field = "chat_template_kwargs.thinking_effort";
        }
    }
    if (th && !json_is_null(th)) {
        if (json_is_boolean(th)) {
            thinking = json_is_true(th);
        } else if (json_is_object(th)) {
            const json_t *t = json_object_get(th, "type");
            if (t && !json_is_null(t)) {
                const char *ts = json_string_value(t);
                if (!ts || (strcmp(ts, "enabled") != 0 && strcmp(ts, "disabled") != 0))
                    return lunar_fail(err, "thinking.type: must be \"enabled\" or \"disabled\"");
                thinking = strcmp(ts, "enabled") == 0;
            }
            const json_t *e = json_object_get(th, "effort");
            if (e && !json_is_null(e)) {
                if (!json_is_string(e)) return lunar_fail(err, "thinking.effort: must be \"low\", \"high\" or \"max\"");
                effort = json_string_value(e), effort_field = "thinking.effort";
            }
        } else {
            return lunar_fail(err, "thinking: must be an object");
        }
    }
    if (re && !json_is_null(re)) {
        const char *rs = json_string_value(re);
        if (!rs || (strcmp(rs, "none") != 0 && !effort_name(rs)))
            return lunar_fail(err, "reasoning_effort: must be \"low\", \"high\", \"max\" or \"none\"");
        if (strcmp(rs, "none") == 0) thinking = 0;
        else if (!effort) effort = rs, effort_field = "reasoning_effort";
    }
    if (!effort) effort = "max";
    p->effort = effort_name(effort);
    if (!p->effort) return lunar_fail(err, "%s: must be \"low\", \"high\" or \"max\"", effort_field);
    p->thinking = thinking;
    return 0;
}
