#include "server/constrain.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "text/sbuf.h"

/* K2 control ids (text/chat_k2.h) and K3 (text/chat_k3.h), as EBNF terminals */
#define K2_END "<163586>"       /* <|im_end|> */
#define K2_SEC_BEGIN "<163595>" /* <|tool_calls_section_begin|> */
#define K2_SEC_END "<163596>"
#define K2_CALL_BEGIN "<163597>"
#define K2_ARG_BEGIN "<163598>"
#define K2_CALL_END "<163599>"
#define K2_THINK_END "<163607>" /* </think> */
#define K3_OPEN "<163587>"
#define K3_CLOSE "<163588>"
#define K3_SEP "<163589>"
#define END_ID 163586 /* <|im_end|> (K2) = <|end_of_msg|> (K3) */
#define MAX_CALLS 8

static const json_t *tool_fn(const json_t *tool) { return json_object_get(tool, "function"); }

/* A strict tool's parameters schema; NULL (any JSON object) for a tool that is not strict or has none. */
static const json_t *tool_schema(const json_t *tool) {
    const json_t *fn = tool_fn(tool);
    if (!json_is_true(json_object_get(fn, "strict"))) return NULL;
    const json_t *params = json_object_get(fn, "parameters");
    return json_is_object(params) ? params : NULL;
}

static int any_strict(const json_t *tools) {
    for (size_t i = 0; i < json_array_size(tools); i++)
        if (json_is_true(json_object_get(tool_fn(json_array_get(tools, i)), "strict"))) return 1;
    return 0;
}

int lunar_constrain_spec(lunar_arch arch, const lunar_chat_prompt *p, char **ebnf, char ***names,
                         const json_t ***schemas, int **forms, int *n, int32_t *end_id) {
    *ebnf = NULL, *names = NULL, *schemas = NULL, *forms = NULL, *n = 0, *end_id = END_ID;
    const json_t *tools = p->tools;
    size_t n_tools = tools ? json_array_size(tools) : 0;
    int json = p->response_format != LUNAR_RESPONSE_TEXT;
    lunar_tool_choice tc = p->tool_choice;
    if (n_tools == 0 && (tc == LUNAR_TOOL_CHOICE_REQUIRED || tc == LUNAR_TOOL_CHOICE_NAMED)) tc = LUNAR_TOOL_CHOICE_NONE;
    int calls = n_tools > 0 && (tc == LUNAR_TOOL_CHOICE_REQUIRED || tc == LUNAR_TOOL_CHOICE_NAMED ||
                                (tc == LUNAR_TOOL_CHOICE_AUTO && any_strict(tools)));
    int only_calls = calls && tc != LUNAR_TOOL_CHOICE_AUTO;
    int no_calls = n_tools > 0 && tc == LUNAR_TOOL_CHOICE_NONE;
    if (!json && !calls && !no_calls) return 0;

    int cap = (int)n_tools + 1, k = 0;
    *names = lunar_xcalloc((size_t)cap, sizeof(char *));
    *schemas = lunar_xcalloc((size_t)cap, sizeof(json_t *));
    *forms = lunar_xcalloc((size_t)cap, sizeof(int));
    lunar_sbuf b = {0};
    int k3 = arch == LUNAR_ARCH_KIMI_K3;
    if (json && !only_calls) {
        (*names)[k] = strdup("resp");
        (*schemas)[k++] = p->response_format == LUNAR_RESPONSE_JSON_SCHEMA ? p->response_schema : NULL;
    }
    /* the calls: one alternative per callable tool */
    if (calls) {
        lunar_sbuf_puts(&b, "call ::= ");
        int first = 1;
        for (size_t i = 0; i < n_tools; i++) {
            const json_t *t = json_array_get(tools, i);
            const char *name = json_string_value(json_object_get(tool_fn(t), "name"));
            if (!name) continue;
            if (tc == LUNAR_TOOL_CHOICE_NAMED && (!p->tool_choice_name || strcmp(name, p->tool_choice_name))) continue;
            char rn[32];
            snprintf(rn, sizeof rn, "args%zu", i);
            (*names)[k] = strdup(rn);
            (*schemas)[k] = tool_schema(t);
            /* K3 strict tools: typed argument tags (engine/grammar.h); other arguments: one json block */
            int tagged = k3 && (*schemas)[k];
            (*forms)[k++] = tagged ? LUNAR_SCHEMA_K3_ARGS : LUNAR_SCHEMA_JSON;
            /* names are ^[A-Za-z_][A-Za-z0-9_-]*$ (validated): no escaping in literals or attributes */
            lunar_sbuf_puts(&b, first ? "" : "\n       | ");
            first = 0;
            if (k3 && tagged)
                lunar_sbuf_printf(&b,
                                  K3_OPEN " \"call tool=\\\"%s\\\" index=\\\"\" [1-9] [0-9]{0,2} \"\\\"\" " K3_SEP
                                          " %s " K3_CLOSE " \"call\" " K3_SEP,
                                  name, rn);
            else if (k3)
                lunar_sbuf_printf(&b,
                                  K3_OPEN " \"call tool=\\\"%s\\\" index=\\\"\" [1-9] [0-9]{0,2} \"\\\"\" " K3_SEP
                                          " " K3_OPEN " \"json type=\\\"object\\\"\" " K3_SEP " %s " K3_CLOSE
                                          " \"json\" " K3_SEP " " K3_CLOSE " \"call\" " K3_SEP,
                                  name, rn);
            else
                lunar_sbuf_printf(&b, K2_CALL_BEGIN " \"functions.%s:\" [0-9]{1,3} " K2_ARG_BEGIN " %s " K2_CALL_END,
                                  name, rn);
        }
        lunar_sbuf_puts(&b, "\n");
        if (k3)
            lunar_sbuf_printf(&b, "tools ::= " K3_OPEN " \"tools\" " K3_SEP " call{1,%d} " K3_CLOSE " \"tools\" " K3_SEP "\n",
                              MAX_CALLS);
        else
            lunar_sbuf_printf(&b, "tools ::= " K2_SEC_BEGIN " call{1,%d} " K2_SEC_END "\n", MAX_CALLS);
    }
    *n = k;
    lunar_sbuf_puts(&b, "text ::= .*\n");
    const char *ans = json && !only_calls ? "resp" : "text";
    if (!k3) {
        /* K2 (Kimi-Linear): the answer is the whole output; a tool-call section may follow free text */
        const char *body = only_calls ? "tools"
                           : no_calls || !calls ? ans
                           : json ? "resp | tools"
                                  : "text tools?";
        lunar_sbuf_printf(&b, "root ::= %s(%s)\n", p->thinking ? "text " K2_THINK_END " " : "", body);
    } else {
        /* K3: the prompt ends inside the think channel (thinking) or the response channel */
        int th = p->thinking;
        lunar_sbuf_printf(&b, "answer ::= %s%s " K3_CLOSE " \"response\" " K3_SEP "\n",
                          th ? K3_OPEN " \"response\" " K3_SEP " " : "", ans);
        if (calls) {
            if (th)
                lunar_sbuf_puts(&b, "pre ::= (" K3_OPEN " \"response\" " K3_SEP " text " K3_CLOSE " \"response\" " K3_SEP ")?\n");
            else
                lunar_sbuf_puts(&b, "pre ::= text " K3_CLOSE " \"response\" " K3_SEP "\n");
        }
        const char *body = only_calls ? "pre tools"
                           : no_calls || !calls ? "answer"
                           : json ? "answer | pre tools"
                                  : "pre tools?";
        lunar_sbuf_printf(&b, "root ::= %s(%s) " K3_CLOSE " \"message\" " K3_SEP "\n",
                          th ? "text " K3_CLOSE " \"think\" " K3_SEP " " : "", body);
    }
    *ebnf = lunar_sbuf_take(&b);
    return 0;
}

static void spec_free(char *ebnf, char **names, const json_t **schemas, int *forms, int n) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names), free((void *)schemas), free(forms), free(ebnf);
}

int lunar_constrain_build(const lunar_vocab *v, lunar_arch arch, const lunar_chat_prompt *p, lunar_grammar **g,
                          lunar_err *err) {
    *g = NULL;
    char *ebnf, **names;
    const json_t **schemas;
    int n, *forms;
    int32_t end;
    lunar_constrain_spec(arch, p, &ebnf, &names, &schemas, &forms, &n, &end);
    if (!ebnf) return 0;
    int rc = lunar_grammar_from_ebnf_with_forms(g, v, ebnf, (const char *const *)names, schemas, forms, n, &end, 1, err);
    spec_free(ebnf, names, schemas, forms, n);
    return rc;
}

/* ---- the cache ---- */

typedef struct centry {
    char *key;
    size_t key_len;
    lunar_grammar *g;
} centry;

struct lunar_constrain {
    lunar_vocab *v;
    lunar_arch arch;
    pthread_mutex_t mu;
    centry *e;
    int n, cap;
};

int lunar_constrain_new(lunar_constrain **out, const lunar_tokenizer *tok, lunar_arch arch, lunar_err *err) {
    *out = NULL;
    lunar_constrain *c = lunar_xcalloc(1, sizeof *c);
    if (lunar_vocab_build(&c->v, tok, err)) {
        free(c);
        return -1;
    }
    c->arch = arch;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return 0;
}

void lunar_constrain_free(lunar_constrain *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) free(c->e[i].key), lunar_grammar_free(c->e[i].g);
    free(c->e);
    lunar_vocab_free(c->v);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

int lunar_constrain_cached(lunar_constrain *c) {
    pthread_mutex_lock(&c->mu);
    int n = c->n;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int lunar_constrain_get(lunar_constrain *c, const lunar_chat_prompt *p, const lunar_grammar **g, lunar_err *err) {
    *g = NULL;
    char *ebnf, **names;
    const json_t **schemas;
    int n, *forms;
    int32_t end;
    lunar_constrain_spec(c->arch, p, &ebnf, &names, &schemas, &forms, &n, &end);
    if (!ebnf) return 0;
    /* key: the grammar text, then each schema as compact JSON (key order kept: it is the output order) */
    lunar_sbuf key = {0};
    lunar_sbuf_puts(&key, ebnf);
    for (int i = 0; i < n; i++) {
        char *d = schemas[i] ? json_dumps(schemas[i], JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
        lunar_sbuf_putc(&key, '\0');
        lunar_sbuf_puts(&key, names[i]);
        lunar_sbuf_putc(&key, '=');
        lunar_sbuf_puts(&key, d ? d : "null");
        lunar_sbuf_putc(&key, (char)('0' + forms[i]));
        free(d);
    }
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n; i++)
        if (c->e[i].key_len == key.len && memcmp(c->e[i].key, key.p, key.len) == 0) {
            *g = c->e[i].g;
            break;
        }
    if (!*g) {
        lunar_grammar *ng;
        rc = lunar_grammar_from_ebnf_with_forms(&ng, c->v, ebnf, (const char *const *)names, schemas, forms, n, &end, 1,
                                                err);
        if (rc == 0) {
            if (c->n == c->cap) {
                c->cap = c->cap ? 2 * c->cap : 16;
                c->e = realloc(c->e, (size_t)c->cap * sizeof *c->e);
                LUNAR_ASSERT(c->e);
            }
            c->e[c->n++] = (centry){.key = lunar_xmalloc(key.len ? key.len : 1), .key_len = key.len, .g = ng};
            memcpy(c->e[c->n - 1].key, key.p, key.len);
            *g = ng;
        }
    }
    pthread_mutex_unlock(&c->mu);
    lunar_sbuf_free(&key);
    spec_free(ebnf, names, schemas, forms, n);
    return rc;
}
