/* lunar tokenize / detokenize / render: the text layer on its own, for checking prompts. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "cli/args.h"
#include "cli/commands.h"
#include "io/config.h"
#include "text/prompt.h"

/* Longest text or request file the commands read (the server's body limit is separate). */
#define MAX_INPUT_BYTES (256u << 20)

typedef struct text_opts {
    const char *model_dir, *text_file, *ids, *request;
    int special; /* tokenize: recognise special-token strings */
} text_opts;

static int parse(int argc, char **argv, text_opts *o, lunar_err *err) {
    memset(o, 0, sizeof *o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (a[0] != '-') {
            if (o->model_dir) return lunar_fail(err, "unexpected argument '%s'", a);
            o->model_dir = a;
        } else if (strcmp(a, "--special") == 0) {
            o->special = 1;
        } else if (!(v = lunar_opt_value(argc, argv, &i, err))) {
            return -1;
        } else if (strcmp(a, "--text-file") == 0) {
            o->text_file = v;
        } else if (strcmp(a, "--ids") == 0) {
            o->ids = v;
        } else if (strcmp(a, "--request") == 0) {
            o->request = v;
        } else {
            return lunar_fail(err, "unknown option '%s'", a);
        }
    }
    if (!o->model_dir) return lunar_fail(err, "missing MODEL_DIR (a directory with tiktoken.model)");
    return 0;
}

static void print_ids(const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
    printf("\n");
}

static int fail(const char *cmd, const char *usage, lunar_err *err) {
    fprintf(stderr, "lunar %s: %s\nusage: %s\n", cmd, err->msg, usage);
    return 1;
}

int lunar_cmd_tokenize(int argc, char **argv) {
    static const char *usage = "lunar tokenize MODEL_DIR --text-file FILE [--special]";
    text_opts o;
    lunar_err err;
    lunar_tokenizer *tok = NULL;
    char *text = NULL;
    size_t len;
    if (parse(argc, argv, &o, &err)) return fail("tokenize", usage, &err);
    if (!o.text_file) {
        lunar_fail(&err, "missing --text-file");
        return fail("tokenize", usage, &err);
    }
    if (lunar_tokenizer_load(&tok, o.model_dir, &err) ||
        lunar_read_file(o.text_file, MAX_INPUT_BYTES, &text, &len, &err)) {
        lunar_tokenizer_free(tok);
        return fail("tokenize", usage, &err);
    }
    lunar_ids ids = {0};
    int rc = lunar_tokenize(tok, text, len, o.special, &ids, &err) ? 1 : 0;
    if (rc)
        fprintf(stderr, "lunar tokenize: %s: %s\n", o.text_file, err.msg);
    else
        print_ids(ids.ids, ids.n);
    lunar_ids_free(&ids);
    free(text);
    lunar_tokenizer_free(tok);
    return rc;
}

int lunar_cmd_detokenize(int argc, char **argv) {
    static const char *usage = "lunar detokenize MODEL_DIR --ids 1,2,3";
    text_opts o;
    lunar_err err;
    lunar_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    int n;
    if (parse(argc, argv, &o, &err)) return fail("detokenize", usage, &err);
    if (!o.ids) {
        lunar_fail(&err, "missing --ids");
        return fail("detokenize", usage, &err);
    }
    if (lunar_parse_ids(o.ids, &ids, &n, &err) || lunar_tokenizer_load(&tok, o.model_dir, &err)) {
        free(ids);
        return fail("detokenize", usage, &err);
    }
    int rc = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= lunar_tokenizer_vocab_size(tok)) {
            fprintf(stderr, "lunar detokenize: id %d is outside the vocabulary [0, %d)\n", ids[i],
                    lunar_tokenizer_vocab_size(tok));
            rc = 1;
        }
    if (!rc) {
        size_t len;
        char *s = lunar_detokenize(tok, ids, (size_t)n, false, &len);
        fwrite(s, 1, len, stdout);
        printf("\n");
        free(s);
    }
    free(ids);
    lunar_tokenizer_free(tok);
    return rc;
}

int lunar_cmd_render(int argc, char **argv) {
    static const char *usage = "lunar render MODEL_DIR --request REQUEST.json";
    text_opts o;
    lunar_err err;
    if (parse(argc, argv, &o, &err)) return fail("render", usage, &err);
    if (!o.request) {
        lunar_fail(&err, "missing --request");
        return fail("render", usage, &err);
    }
    char path[1100];
    lunar_config cfg;
    snprintf(path, sizeof path, "%s/config.json", o.model_dir);
    if (lunar_config_load(&cfg, path, &err)) return fail("render", usage, &err);
    json_error_t je;
    json_t *req = json_load_file(o.request, JSON_REJECT_DUPLICATES, &je);
    if (!req) {
        fprintf(stderr, "lunar render: %s:%d:%d: %s\n", o.request, je.line, je.column, je.text);
        return 1;
    }
    lunar_tokenizer *tok = NULL;
    lunar_chat_prompt p;
    memset(&p, 0, sizeof p);
    lunar_ids ids = {0};
    int rc = 1;
    if (lunar_tokenizer_load(&tok, o.model_dir, &err) == 0 &&
        lunar_chat_render(cfg.arch, req, &p, &err) == 0 && lunar_prompt_ids(tok, &p, &ids, &err) == 0) {
        printf("%s\n", lunar_chat_prompt_text(&p));
        print_ids(ids.ids, ids.n);
        printf("prompt_tokens: %zu\n", ids.n - p.stub_tokens);
        rc = 0;
    } else {
        fprintf(stderr, "lunar render: %s: %s\n", o.request, err.msg);
    }
    lunar_ids_free(&ids);
    lunar_chat_prompt_free(&p);
    lunar_tokenizer_free(tok);
    json_decref(req);
    return rc;
}
