/* The server without the engine: request validation (every 400 case of reference/kvv.md §3 and §5, the
 * OpenAI type checks), exact usage.prompt_tokens through the whole parse path, SSE framing and chunk
 * assembly from recorded engine-event sequences (K3 reasoning / content / tool calls, stop strings, errors,
 * split UTF-8), the metrics text, and the HTTP layer end to end over a socket with the fake backend
 * (auth, 404/405/413, streaming, n > 1, a client that disconnects mid-stream). */
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/file.h"
#include "server/assemble.h"
#include "server/metrics.h"
#include "server/request.h"
#include "server/server.h"
#include "test.h"

static lunar_tokenizer *k3_tok(void) {
    static lunar_tokenizer *tok;
    lunar_err err;
    if (!tok && lunar_tokenizer_load_files(&tok, "data/kimi-tokenizer/tiktoken.model",
                                           "data/kimi-tokenizer/tokenizer_config.k3.json", &err))
        fprintf(stderr, "%s\n", err.msg);
    return tok;
}

static lunar_tokenizer *k2_tok(void) {
    static lunar_tokenizer *tok;
    lunar_err err;
    if (!tok && lunar_tokenizer_load(&tok, "models/kimi-linear-tiny", &err)) fprintf(stderr, "%s\n", err.msg);
    return tok;
}

static const char *NAMES[] = {"kimi-k3", "alias"};

static lunar_srv_policy k3_policy(void) {
    lunar_srv_policy p = {.arch = LUNAR_ARCH_KIMI_K3, .model_names = NAMES, .n_model_names = 2, .sampling_guard = 1,
                          .max_model_len = 4096, .max_n = 1, .vocab_size = 163840};
    return p;
}

/* status of parsing body as a chat request (0 = accepted); param copied out */
static int chat_status(const lunar_srv_policy *pol, const char *body, char *param) {
    lunar_srv_req r;
    lunar_api_error e;
    int rc = lunar_srv_parse(pol, k3_tok(), LUNAR_SRV_CHAT, body, strlen(body), &r, &e);
    if (rc == 0) {
        lunar_srv_req_free(&r);
        return 0;
    }
    if (param) strcpy(param, e.param);
    return e.status;
}

#define USER "\"messages\":[{\"role\":\"user\",\"content\":\"Say 'OK' and nothing else.\"}]"

TEST(server_k3_sampling_guard) {
    lunar_srv_policy p = k3_policy();
    const char *ok[] = {"{" USER "}", "{" USER ",\"temperature\":0.6}", "{" USER ",\"temperature\":0.0}",
                        "{" USER ",\"temperature\":1.0}", "{" USER ",\"top_p\":0.95}",
                        "{" USER ",\"presence_penalty\":0}", "{" USER ",\"frequency_penalty\":0}", "{" USER ",\"n\":1}",
                        "{" USER ",\"thinking\":{\"type\":\"disabled\"},\"temperature\":0.6}",
                        "{" USER ",\"chat_template_kwargs\":{\"thinking\":false}}"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) CHECK_MSG(chat_status(&p, ok[i], NULL) == 0, "%s", ok[i]);
    struct {
        const char *body, *param;
    } bad[] = {{"{" USER ",\"temperature\":1.1}", "temperature"},  {"{" USER ",\"temperature\":2.0}", "temperature"},
               {"{" USER ",\"temperature\":-0.1}", "temperature"}, {"{" USER ",\"top_p\":0.8}", "top_p"},
               {"{" USER ",\"presence_penalty\":0.5}", "presence_penalty"},
               {"{" USER ",\"frequency_penalty\":0.5}", "frequency_penalty"}, {"{" USER ",\"n\":2}", "n"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char param[128] = "";
        CHECK_MSG(chat_status(&p, bad[i].body, param) == 400, "%s", bad[i].body);
        CHECK_MSG(strcmp(param, bad[i].param) == 0, "%s: param %s", bad[i].body, param);
    }
    /* the guard is a policy: off, the same values are fine */
    p.sampling_guard = 0;
    p.max_n = 4;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (!strstr(bad[i].body, "2.0") && !strstr(bad[i].body, "-0.1"))
            CHECK_MSG(chat_status(&p, bad[i].body, NULL) == 0, "guard off: %s", bad[i].body);
}

TEST(server_kvv_400_cases) {
    lunar_srv_policy p = k3_policy();
#define T1 "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}"
#define T2 "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}"
#define SYS_TOOLS(t) "{\"role\":\"system\",\"content\":\"\",\"tools\":[" t "]}"
#define U "{\"role\":\"user\",\"content\":\"hi\"}"
    char long_name[400];
    snprintf(long_name, sizeof long_name,
             "{\"messages\":[" U "],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"%0257d\"}}]}", 0);
    long_name[strlen("{\"messages\":[" U "],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"")] = 'a';
    const char *bad[] = {
        /* dynamic tools (kvv.md §5 test_dynamic_tools) */
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"tools\":[" T1 "]}]}",
        "{\"messages\":[" U ",{\"role\":\"assistant\",\"content\":\"x\",\"tools\":[" T1 "]}," U "]}",
        "{\"messages\":[{\"role\":\"system\",\"content\":\"be nice\",\"tools\":[" T1 "]}," U "]}",
        "{\"messages\":[" SYS_TOOLS("{\"function\":{\"name\":\"f\"}}") "," U "]}",
        "{\"messages\":[" SYS_TOOLS("{\"type\":\"function\"}") "," U "]}",
        "{\"messages\":[" SYS_TOOLS("{\"type\":\"function\",\"function\":{}}") "," U "]}",
        "{\"messages\":[" U "],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"1bad_name\"}}]}",
        "{\"messages\":[" U "],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"bad@name\"}}]}",
        "{\"messages\":[" U "],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]}",
        long_name,
        "{\"messages\":[" U "],\"tools\":[{\"type\":\"bogus\",\"function\":{\"name\":\"f\"}}]}",
        "{\"messages\":[" U "],\"tools\":[" T1 ",{\"type\":\"bogus\",\"function\":{\"name\":\"f\"}}]}",
        "{\"messages\":[" U "],\"tools\":" T1 "}",
        "{\"messages\":[" U "],\"tools\":[null]}",
        "{\"messages\":[" SYS_TOOLS(T1 "," T1) "," U "]}",
        "{\"messages\":[" SYS_TOOLS(T1) "," SYS_TOOLS(T1) "," U "]}",
        "{\"messages\":[" SYS_TOOLS(T1) "," U "],\"tools\":[" T1 "]}",
        "{\"messages\":[" U ",{\"role\":\"tool\",\"content\":\"42\"}]}",
        /* response_format (test_response_format) */
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"bogus\"}}",
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":\"object\"}}}}",
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}}",
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"json_schema\"}}",
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{},\"strict\":\"yes\"}}}",
        "{\"messages\":[" U "],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":\"x\"}}}",
        /* tool_choice (test_tool_choice) */
        "{\"messages\":[" U "],\"tool_choice\":\"required\"}",
        "{\"messages\":[" U "],\"tools\":[],\"tool_choice\":\"required\"}",
        "{\"messages\":[" U "],\"tools\":[" T1 "],\"tool_choice\":\"bogus\"}",
        /* OpenAI types, malformed bodies */
        "", "[]", "{", "{\"messages\":\"hi\"}", "{\"messages\":[]}", "{\"messages\":[" U "],\"max_tokens\":\"x\"}",
        "{\"messages\":[" U "],\"max_tokens\":0}", "{\"messages\":[" U "],\"max_tokens\":100000}",
        "{\"messages\":[" U "],\"stream\":\"yes\"}", "{\"messages\":[" U "],\"top_logprobs\":3}",
        "{\"messages\":[" U "],\"logprobs\":true,\"top_logprobs\":21}", "{\"messages\":[" U "],\"stop\":[1]}",
        "{\"messages\":[" U "],\"stop\":\"a\",\"seed\":1.5}", "{\"messages\":[" U "],\"stream_options\":1}",
        "{\"messages\":[" U "],\"logit_bias\":{\"x\":1}}", "{\"messages\":[" U "],\"logit_bias\":{\"5\":101}}",
        "{\"messages\":[" U "],\"model\":7}", "{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}",
        "{\"messages\":[" U "],\"a\":1,\"a\":2}", "{\"messages\":[" U "],\"thinking\":{\"type\":\"sometimes\"}}",
        "{\"messages\":[" U "],\"reasoning_effort\":\"extreme\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(chat_status(&p, bad[i], NULL) == 400, "case %zu should be 400: %.160s", i, bad[i]);
    /* accepted: dynamic tools placed right, tool_choice none/auto without tools, named, keep:"all", model alias */
    const char *ok[] = {
        "{\"messages\":[" SYS_TOOLS(T1) "," U "],\"tool_choice\":\"required\"}",
        "{\"messages\":[" U "," SYS_TOOLS(T1 "," T2) "],\"tool_choice\":\"required\"}",
        "{\"messages\":[" U "],\"tool_choice\":\"none\"}", "{\"messages\":[" U "],\"tool_choice\":\"auto\"}",
        "{\"messages\":[" U "],\"tools\":[" T1 "],\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}}",
        "{\"messages\":[" U "],\"thinking\":{\"keep\":\"all\"}}", "{\"model\":\"alias\",\"messages\":[" U "]}",
        "{\"messages\":[" U "],\"max_completion_tokens\":10,\"stop\":[\"a\",\"b\"],\"seed\":7,\"user\":\"u\"}",
        "{\"messages\":[" U "],\"stream\":true,\"stream_options\":{\"include_usage\":false}}",
        "{\"messages\":[" U "],\"reasoning_effort\":\"none\"}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        CHECK_MSG(chat_status(&p, ok[i], NULL) == 0, "case %zu should pass: %.160s", i, ok[i]);
    CHECK(chat_status(&p, "{\"model\":\"gpt-4\",\"messages\":[" U "]}", NULL) == 404);
}

TEST(server_prompt_tokens_exact) {
    /* usage.prompt_tokens through the whole parse path equals the goldens (KVV's 36, 119, 99 among them) */
    lunar_srv_policy p = k3_policy();
    p.sampling_guard = 0;
    p.max_model_len = 1 << 20;
    char *text;
    size_t len;
    lunar_err err;
    CHECK(lunar_read_file("tests/data/chat/k3_cases.jsonl", 1 << 24, &text, &len, &err) == 0);
    int checked = 0, kvv = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *c = json_loads(line, 0, NULL);
        if (!c) continue;
        json_t *req = json_object_get(c, "request");
        char *body = json_dumps(req, JSON_COMPACT);
        lunar_srv_req r;
        lunar_api_error e;
        if (lunar_srv_parse(&p, k3_tok(), LUNAR_SRV_CHAT, body, strlen(body), &r, &e) == 0) {
            long want = (long)json_integer_value(json_object_get(c, "prompt_tokens"));
            CHECK_MSG((long)r.prompt_tokens == want, "%s: %zu vs %ld", json_string_value(json_object_get(c, "name")),
                      r.prompt_tokens, want);
            kvv += want == 36 || want == 119 || want == 99;
            checked++;
            lunar_srv_req_free(&r);
        } else {
            CHECK_MSG(strstr(e.message, "image") != NULL, "%s", e.message); /* images need the vision encoder */
        }
        free(body);
        json_decref(c);
    }
    free(text);
    CHECK(checked >= 10);
    CHECK(kvv == 3);
}

/* ---- assembly from recorded event sequences ---- */

typedef struct sse_result {
    int frames, done_last, bad_frame, role_chunks, usage_chunks, error_frames;
    lunar_sbuf content, reasoning, args;
    char name[128], id[128], finish[32];
    int name_sends, prompt_tokens, completion_tokens;
} sse_result;

/* Parses SSE bytes as KVV's conftest does (data: lines, up to [DONE], each JSON). */
static void parse_sse(const char *s, sse_result *r) {
    memset(r, 0, sizeof *r);
    const char *p = s;
    while (*p) {
        const char *end = strstr(p, "\n\n");
        if (!end || strncmp(p, "data: ", 6) != 0) {
            r->bad_frame++;
            return;
        }
        r->frames++;
        char *line = strndup(p + 6, (size_t)(end - p - 6));
        p = end + 2;
        r->done_last = strcmp(line, "[DONE]") == 0;
        if (r->done_last) {
            free(line);
            CHECK(*p == '\0');
            return;
        }
        json_t *c = json_loads(line, 0, NULL);
        free(line);
        if (!c) {
            r->bad_frame++;
            continue;
        }
        if (json_object_get(c, "error")) r->error_frames++;
        json_t *u = json_object_get(c, "usage");
        json_t *ch = json_array_get(json_object_get(c, "choices"), 0);
        if (u && json_array_size(json_object_get(c, "choices")) == 0) {
            r->usage_chunks++;
            r->prompt_tokens = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
            r->completion_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
        }
        json_t *d = json_object_get(ch, "delta");
        if (json_object_get(d, "role")) r->role_chunks++;
        const char *t;
        if ((t = json_string_value(json_object_get(d, "content")))) lunar_sbuf_puts(&r->content, t);
        if ((t = json_string_value(json_object_get(ch, "text")))) lunar_sbuf_puts(&r->content, t);
        if ((t = json_string_value(json_object_get(d, "reasoning_content")))) lunar_sbuf_puts(&r->reasoning, t);
        json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
        if (tc) {
            json_t *fn = json_object_get(tc, "function");
            if ((t = json_string_value(json_object_get(fn, "name"))) && *t) {
                r->name_sends++;
                snprintf(r->name, sizeof r->name, "%s", t);
            }
            if ((t = json_string_value(json_object_get(tc, "id")))) snprintf(r->id, sizeof r->id, "%s", t);
            if ((t = json_string_value(json_object_get(fn, "arguments")))) lunar_sbuf_puts(&r->args, t);
        }
        if ((t = json_string_value(json_object_get(ch, "finish_reason")))) snprintf(r->finish, sizeof r->finish, "%s", t);
        json_decref(c);
    }
}

static void sse_free(sse_result *r) {
    lunar_sbuf_free(&r->content);
    lunar_sbuf_free(&r->reasoning);
    lunar_sbuf_free(&r->args);
}

/* Runs the ids of `script` (special tokens recognised) through a response as engine events. */
static lunar_srv_resp *replay(lunar_srv_req *rq, const lunar_tokenizer *tok, const char *script,
                              lunar_finish_reason last, lunar_sbuf *out, int *cancel_at) {
    lunar_ids ids = {0};
    lunar_err err;
    CHECK(lunar_tokenize(tok, script, strlen(script), true, &ids, &err) == 0);
    lunar_srv_resp *rs = lunar_srv_resp_new(rq, tok, "chatcmpl-test", 1700000000);
    if (cancel_at) *cancel_at = -1;
    for (size_t i = 0; i < ids.n; i++) {
        lunar_event ev = {.request_id = 1, .has_token = 1, .token = ids.ids[i]};
        if (i + 1 == ids.n) ev.finish = last;
        int fin = lunar_srv_resp_event(rs, 0, &ev, out);
        if (fin && ev.finish == LUNAR_FINISH_NONE && cancel_at && *cancel_at < 0) *cancel_at = (int)i;
    }
    lunar_ids_free(&ids);
    if (rq->stream && lunar_srv_resp_done(rs)) lunar_srv_resp_stream_end(rs, out);
    return rs;
}

static int parse_ok(lunar_srv_req *r, const lunar_srv_policy *p, const lunar_tokenizer *tok, lunar_srv_kind k,
                    const char *body) {
    lunar_api_error e;
    int rc = lunar_srv_parse(p, tok, k, body, strlen(body), r, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    return rc == 0;
}

#define K3_ANSWER                                                                                           \
    "Let me think: 2+2=4.<|close|>think<|sep|><|open|>response<|sep|>It is \xe4\xb8\x96 4.<|close|>response<|sep|>" \
    "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"0\"<|sep|><|open|>argument key=\"city\" "   \
    "type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3"   \
    "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"

TEST(server_stream_k3_reasoning_content_tool_call) {
    lunar_srv_policy p = k3_policy();
    lunar_srv_req rq;
    if (!parse_ok(&rq, &p, k3_tok(), LUNAR_SRV_CHAT,
                  "{\"messages\":[" U "],\"stream\":true,\"tools\":[" T1 "]}"))
        return;
    lunar_sbuf out = {0};
    lunar_srv_resp *rs = replay(&rq, k3_tok(), K3_ANSWER, LUNAR_FINISH_STOP, &out, NULL);
    sse_result r;
    parse_sse(out.p, &r);
    CHECK(r.bad_frame == 0 && r.done_last);
    CHECK(r.role_chunks == 1);
    CHECK_MSG(r.reasoning.p && strcmp(r.reasoning.p, "Let me think: 2+2=4.") == 0, "reasoning %s", r.reasoning.p);
    CHECK_MSG(r.content.p && strcmp(r.content.p, "It is \xe4\xb8\x96 4.") == 0, "content %s", r.content.p);
    CHECK(strcmp(r.name, "get_weather") == 0 && r.name_sends == 1);
    CHECK(strncmp(r.id, "call_", 5) == 0);
    CHECK_MSG(r.args.p && strcmp(r.args.p, "{\"city\": \"Paris\", \"days\": 3}") == 0, "args %s", r.args.p);
    CHECK(strcmp(r.finish, "tool_calls") == 0);
    CHECK(r.usage_chunks == 1 && r.prompt_tokens == (int)rq.prompt_tokens && r.completion_tokens > 20);
    sse_free(&r);
    lunar_sbuf_free(&out);
    lunar_srv_resp_free(rs);
    /* the same events, not streamed */
    rq.stream = 0;
    rs = replay(&rq, k3_tok(), K3_ANSWER, LUNAR_FINISH_STOP, NULL, NULL);
    char *body = lunar_srv_resp_json(rs);
    json_t *j = json_loads(body, 0, NULL);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    CHECK(strcmp(json_string_value(json_object_get(msg, "reasoning_content")), "Let me think: 2+2=4.") == 0);
    CHECK(strcmp(json_string_value(json_object_get(msg, "content")), "It is \xe4\xb8\x96 4.") == 0);
    json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0);
    CHECK(strcmp(json_string_value(json_object_get(call, "type")), "function") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_object_get(call, "function"), "arguments")),
                 "{\"city\": \"Paris\", \"days\": 3}") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason")),
                 "tool_calls") == 0);
    json_t *u = json_object_get(j, "usage");
    CHECK(json_integer_value(json_object_get(u, "total_tokens")) ==
          json_integer_value(json_object_get(u, "prompt_tokens")) +
              json_integer_value(json_object_get(u, "completion_tokens")));
    json_decref(j);
    free(body);
    lunar_srv_resp_free(rs);
    lunar_srv_req_free(&rq);
}

TEST(server_stream_length_and_thinking_off) {
    lunar_srv_policy p = k3_policy();
    lunar_srv_req rq;
    if (!parse_ok(&rq, &p, k3_tok(), LUNAR_SRV_CHAT,
                  "{\"messages\":[" U "],\"stream\":true,\"thinking\":{\"type\":\"disabled\"},\"max_tokens\":3}"))
        return;
    lunar_sbuf out = {0};
    lunar_srv_resp *rs = replay(&rq, k3_tok(), "one two three", LUNAR_FINISH_LENGTH, &out, NULL);
    sse_result r;
    parse_sse(out.p, &r);
    CHECK(r.done_last && r.bad_frame == 0 && r.reasoning.len == 0);
    CHECK(r.content.p && strcmp(r.content.p, "one two three") == 0);
    CHECK(strcmp(r.finish, "length") == 0);
    sse_free(&r);
    lunar_sbuf_free(&out);
    lunar_srv_resp_free(rs);
    lunar_srv_req_free(&rq);
}

TEST(server_stop_strings_trim_and_cancel) {
    lunar_srv_policy p = k3_policy();
    p.arch = LUNAR_ARCH_KIMI_LINEAR;
    p.sampling_guard = 0;
    lunar_srv_req rq;
    if (!parse_ok(&rq, &p, k2_tok(), LUNAR_SRV_COMPLETION,
                  "{\"prompt\":\"x\",\"stream\":true,\"stop\":[\"STOP\",\"never\"]}"))
        return;
    lunar_sbuf out = {0};
    int cancel_at;
    lunar_srv_resp *rs = replay(&rq, k2_tok(), "abc def STOP and more text", LUNAR_FINISH_LENGTH, &out, &cancel_at);
    sse_result r;
    parse_sse(out.p, &r);
    CHECK_MSG(r.content.p && strcmp(r.content.p, "abc def ") == 0, "%s", r.content.p);
    CHECK(strcmp(r.finish, "stop") == 0 && r.done_last);
    CHECK(cancel_at >= 0); /* the caller is told to cancel the engine request */
    sse_free(&r);
    lunar_sbuf_free(&out);
    lunar_srv_resp_free(rs);
    /* a held-back prefix ("nev") that never completes is released at the end */
    rs = replay(&rq, k2_tok(), "it was nev", LUNAR_FINISH_LENGTH, &out, NULL);
    parse_sse(out.p, &r);
    CHECK_MSG(r.content.p && strcmp(r.content.p, "it was nev") == 0, "%s", r.content.p);
    CHECK(strcmp(r.finish, "length") == 0);
    sse_free(&r);
    lunar_sbuf_free(&out);
    lunar_srv_resp_free(rs);
    lunar_srv_req_free(&rq);
}

TEST(server_engine_error_mid_stream) {
    lunar_srv_policy p = k3_policy();
    lunar_srv_req rq;
    if (!parse_ok(&rq, &p, k3_tok(), LUNAR_SRV_CHAT, "{\"messages\":[" U "],\"stream\":true}")) return;
    lunar_srv_resp *rs = lunar_srv_resp_new(&rq, k3_tok(), "chatcmpl-x", 1);
    lunar_sbuf out = {0};
    lunar_event ev = {.has_token = 1, .token = 15339};
    lunar_srv_resp_event(rs, 0, &ev, &out);
    lunar_event bad = {.finish = LUNAR_FINISH_ERROR, .message = "device lost"};
    CHECK(lunar_srv_resp_event(rs, 0, &bad, &out) == 1);
    CHECK(lunar_srv_resp_done(rs));
    lunar_srv_resp_stream_end(rs, &out);
    sse_result r;
    parse_sse(out.p, &r);
    CHECK(r.error_frames == 1 && r.done_last && r.usage_chunks == 0);
    lunar_api_error e;
    CHECK(lunar_srv_resp_error(rs, &e) == 1 && e.status == 500 && strstr(e.message, "device lost"));
    sse_free(&r);
    lunar_sbuf_free(&out);
    lunar_srv_resp_free(rs);
    lunar_srv_req_free(&rq);
}

TEST(server_sse_framing_and_error_json) {
    lunar_sbuf o = {0};
    lunar_sse_json(&o, json_pack("{s:s}", "a", "x\ny"));
    lunar_sse_done(&o);
    CHECK(strcmp(o.p, "data: {\"a\":\"x\\ny\"}\n\ndata: [DONE]\n\n") == 0);
    lunar_sbuf_free(&o);
    lunar_api_error e;
    lunar_api_fail(&e, 400, "top_p", "top_p: bad");
    char *s = lunar_api_error_json(&e);
    CHECK(strcmp(s, "{\"error\":{\"message\":\"top_p: bad\",\"type\":\"invalid_request_error\",\"param\":\"top_p\","
                    "\"code\":\"invalid_request\"}}") == 0);
    free(s);
}

TEST(server_metrics_text) {
    lunar_srv_metrics *m = lunar_srv_metrics_new("my\"model");
    lunar_srv_metrics_request(m, "stop", 10, 5, 0.05, 0.25);
    lunar_srv_metrics_request(m, "length", 20, 1, 0.5, 0.5);
    lunar_srv_metrics_itl(m, 0.01);
    lunar_srv_metrics_http(m, 400);
    lunar_engine_metrics em = {.running = 3, .waiting = 2, .kv_blocks_total = 10, .kv_blocks_used = 5,
                               .preemptions = 7, .prefix_cache_hits = 4, .prefix_cache_queries = 8};
    lunar_sbuf o = {0};
    lunar_srv_metrics_render(m, &em, &o);
    const char *want[] = {
        "lunar:num_requests_running{model_name=\"my\\\"model\"} 3\n",
        "lunar:num_requests_waiting{model_name=\"my\\\"model\"} 2\n",
        "lunar:kv_cache_usage_perc{model_name=\"my\\\"model\"} 0.5\n",
        "lunar:num_preemptions_total{model_name=\"my\\\"model\"} 7\n",
        "lunar:prefix_cache_hits_total{model_name=\"my\\\"model\"} 4\n",
        "lunar:prompt_tokens_total{model_name=\"my\\\"model\"} 30\n",
        "lunar:generation_tokens_total{model_name=\"my\\\"model\"} 6\n",
        "lunar:request_success_total{model_name=\"my\\\"model\",finished_reason=\"length\"} 1\n",
        "lunar:http_requests_total{model_name=\"my\\\"model\",status=\"4xx\"} 1\n",
        "# TYPE lunar:time_to_first_token_seconds histogram\n",
        "lunar:time_to_first_token_seconds_bucket{model_name=\"my\\\"model\",le=\"0.1\"} 1\n",
        "lunar:time_to_first_token_seconds_bucket{model_name=\"my\\\"model\",le=\"+Inf\"} 2\n",
        "lunar:time_to_first_token_seconds_count{model_name=\"my\\\"model\"} 2\n",
        "lunar:time_per_output_token_seconds_count{model_name=\"my\\\"model\"} 1\n",
        "lunar:inter_token_latency_seconds_count{model_name=\"my\\\"model\"} 1\n",
        "lunar:e2e_request_latency_seconds_sum{model_name=\"my\\\"model\"} 0.75\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) CHECK_MSG(strstr(o.p, want[i]), "missing %s", want[i]);
    lunar_sbuf_free(&o);
    lunar_srv_metrics_free(m);
}

/* ---- HTTP over a socket, fake backend ---- */

static lunar_server *start_fake(const char *script, int delay_us, const char *api_key, int max_pending) {
    lunar_server_options o;
    lunar_server_options_default(&o);
    o.host = "127.0.0.1";
    o.port = 0;
    o.quiet = 1;
    o.api_key = api_key;
    o.max_body_bytes = 1 << 16;
    if (max_pending) o.max_pending = max_pending;
    o.tok = k2_tok();
    static const char *names[] = {"tiny"};
    o.policy = (lunar_srv_policy){.arch = LUNAR_ARCH_KIMI_LINEAR, .model_names = names, .n_model_names = 1,
                                  .max_model_len = 16384, .max_n = 4, .vocab_size = 163840};
    lunar_ids ids = {0};
    lunar_err err;
    lunar_tokenize(k2_tok(), script, strlen(script), true, &ids, &err);
    lunar_srv_fake_options fo = {.script = ids.ids, .n_script = (int)ids.n, .stop_at_end = 1,
                                 .token_delay_us = delay_us};
    CHECK(lunar_srv_backend_fake(&o.backend, &fo, &err) == 0);
    lunar_ids_free(&ids);
    lunar_server *s = NULL;
    CHECK_MSG(lunar_server_start(&s, &o, &err) == 0, "%s", err.msg);
    return s;
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One request with Connection: close; returns the whole response (malloc'd), status in *status. */
static char *http(int port, const char *method, const char *path, const char *headers, const char *body, int *status) {
    int fd = connect_to(port);
    if (fd < 0) return NULL;
    lunar_sbuf rq = {0};
    lunar_sbuf_printf(&rq, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%sContent-Length: %zu\r\n\r\n", method,
                      path, headers ? headers : "", body ? strlen(body) : 0);
    if (body) lunar_sbuf_puts(&rq, body);
    ssize_t w = write(fd, rq.p, rq.len);
    (void)w;
    lunar_sbuf_free(&rq);
    lunar_sbuf resp = {0};
    char buf[4096];
    ssize_t k;
    while ((k = read(fd, buf, sizeof buf)) > 0) lunar_sbuf_put(&resp, buf, (size_t)k);
    close(fd);
    *status = resp.p ? atoi(resp.p + 9) : 0;
    return lunar_sbuf_take(&resp);
}

/* The body of a chunked response, de-chunked. */
static char *dechunk(const char *resp) {
    const char *p = strstr(resp, "\r\n\r\n");
    lunar_sbuf b = {0};
    if (!p) return lunar_sbuf_take(&b);
    p += 4;
    for (;;) {
        char *end;
        unsigned long n = strtoul(p, &end, 16);
        if (end == p || n == 0) break;
        p = strstr(end, "\r\n") + 2;
        lunar_sbuf_put(&b, p, n);
        p += n + 2;
    }
    return lunar_sbuf_take(&b);
}

TEST(server_http_endpoints_and_errors) {
    lunar_server *s = start_fake("Hello world.<|im_end|>", 0, "sekret", 0);
    if (!s) return;
    int port = lunar_server_port(s), st;
    char *r;
    r = http(port, "GET", "/health", NULL, NULL, &st);
    CHECK(st == 200);
    free(r);
    r = http(port, "GET", "/v1/models", NULL, NULL, &st);
    CHECK(st == 401 && strstr(r, "\"invalid_api_key\""));
    free(r);
    r = http(port, "GET", "/v1/models", "Authorization: Bearer wrong\r\n", NULL, &st);
    CHECK(st == 401);
    free(r);
    const char *auth = "Authorization: Bearer sekret\r\n";
    r = http(port, "GET", "/v1/models", auth, NULL, &st);
    CHECK(st == 200 && strstr(r, "\"id\":\"tiny\""));
    free(r);
    r = http(port, "GET", "/v1/chat/completions", auth, NULL, &st);
    CHECK(st == 405);
    free(r);
    r = http(port, "GET", "/nope", auth, NULL, &st);
    CHECK(st == 404);
    free(r);
    r = http(port, "POST", "/v1/chat/completions", auth, "{\"model\":\"other\",\"messages\":[" U "]}", &st);
    CHECK(st == 404 && strstr(r, "model_not_found"));
    free(r);
    r = http(port, "POST", "/v1/chat/completions", auth, "{not json", &st);
    CHECK(st == 400 && strstr(r, "\"invalid_request_error\""));
    free(r);
    /* a stream request that fails validation gets a plain 400, no SSE */
    r = http(port, "POST", "/v1/chat/completions", auth, "{\"stream\":true,\"messages\":[],\"model\":\"tiny\"}", &st);
    CHECK(st == 400 && !strstr(r, "data:"));
    free(r);
    char *big = malloc(70000);
    memset(big, 'a', 69999);
    big[69999] = 0;
    r = http(port, "POST", "/v1/chat/completions", auth, big, &st);
    CHECK_MSG(st == 413, "status %d", st);
    free(r);
    free(big);
    r = http(port, "POST", "/v1/chat/completions", auth, "{\"messages\":[" U "]}", &st);
    CHECK(st == 200 && strstr(r, "\"content\":\"Hello world.\"") && strstr(r, "\"finish_reason\":\"stop\""));
    free(r);
    r = http(port, "POST", "/v1/completions", auth, "{\"prompt\":[1,2,3],\"max_tokens\":2,\"n\":2}", &st);
    CHECK(st == 200 && strstr(r, "\"text\":\"Hello world\"") && strstr(r, "\"index\":1") &&
          strstr(r, "\"completion_tokens\":4"));
    free(r);
    r = http(port, "POST", "/v1/completions", auth, "{\"prompt\":\"x\",\"max_tokens\":7777}", &st);
    CHECK(st == 500 && strstr(r, "scripted failure"));
    free(r);
    r = http(port, "POST", "/tokenize", auth, "{\"prompt\":\"hello world\"}", &st);
    CHECK(st == 200 && strstr(r, "\"count\":2") && strstr(r, "\"tokens\":[22931,2695]"));
    free(r);
    r = http(port, "POST", "/detokenize", auth, "{\"tokens\":[22931,2695]}", &st);
    CHECK(st == 200 && strstr(r, "\"prompt\":\"hello world\""));
    free(r);
    r = http(port, "GET", "/metrics", NULL, NULL, &st);
    CHECK(st == 200 && strstr(r, "lunar:request_success_total{model_name=\"tiny\",finished_reason=\"stop\"} 1"));
    free(r);
    lunar_server_stop(s);
}

TEST(server_http_stream_and_disconnect) {
    lunar_server *s = start_fake("a b c d e f g h i j", 2000, NULL, 0);
    if (!s) return;
    int port = lunar_server_port(s), st;
    char *r = http(port, "POST", "/v1/chat/completions", NULL,
                   "{\"messages\":[" U "],\"stream\":true,\"max_tokens\":5,\"n\":2}", &st);
    CHECK(st == 200 && strstr(r, "text/event-stream"));
    char *body = dechunk(r);
    sse_result sr;
    parse_sse(body, &sr);
    CHECK(sr.done_last && sr.bad_frame == 0 && sr.role_chunks == 2 && sr.usage_chunks == 1);
    CHECK(sr.completion_tokens == 10);
    sse_free(&sr);
    free(body);
    free(r);
    /* a client that reads a little of an endless stream and disconnects: the request is cancelled */
    for (int k = 0; k < 3; k++) {
        int fd = connect_to(port);
        const char *b = "{\"messages\":[" U "],\"stream\":true,\"max_tokens\":100000}";
        lunar_sbuf rq = {0};
        lunar_sbuf_printf(&rq, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                          strlen(b), b);
        CHECK(write(fd, rq.p, rq.len) == (ssize_t)rq.len);
        lunar_sbuf_free(&rq);
        char buf[512];
        CHECK(read(fd, buf, sizeof buf) > 0);
        close(fd);
    }
    /* the server stays healthy, and the cancelled requests leave the engine */
    int finished = 0;
    for (int t = 0; t < 100 && !finished; t++) {
        usleep(50000);
        r = http(port, "GET", "/metrics", NULL, NULL, &st);
        finished = strstr(r, "lunar:num_requests_running{model_name=\"tiny\"} 0\n") != NULL;
        free(r);
    }
    CHECK_MSG(finished, "cancelled streams still running");
    r = http(port, "POST", "/v1/chat/completions", NULL, "{\"messages\":[" U "],\"max_tokens\":3}", &st);
    CHECK(st == 200 && strstr(r, "\"finish_reason\":\"length\""));
    free(r);
    lunar_server_stop(s);
}

TEST(server_http_overload_503) {
    lunar_server *s = start_fake("a b c", 20000, NULL, 1);
    if (!s) return;
    int port = lunar_server_port(s), st;
    int fd = connect_to(port);
    const char *b = "{\"messages\":[" U "],\"stream\":true,\"max_tokens\":1000}";
    lunar_sbuf rq = {0};
    lunar_sbuf_printf(&rq, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                      strlen(b), b);
    CHECK(write(fd, rq.p, rq.len) == (ssize_t)rq.len);
    lunar_sbuf_free(&rq);
    char buf[256];
    CHECK(read(fd, buf, sizeof buf) > 0);
    char *r = http(port, "POST", "/v1/chat/completions", NULL, "{\"messages\":[" U "],\"max_tokens\":2}", &st);
    CHECK_MSG(st == 503, "status %d", st);
    free(r);
    close(fd);
    lunar_server_stop(s);
}
