/* Small helpers shared by the subcommands: option values and id lists, with messages that name
 * the option. */
#ifndef LUNAR_CLI_ARGS_H
#define LUNAR_CLI_ARGS_H

#include <stdint.h>

#include "base/err.h"
#include "model/model.h"

/* "1,2,3" -> ids (malloc'd), count. Rejects empty items, non-numbers and values outside int32. */
int lunar_parse_ids(const char *s, int32_t **ids, int *n, lunar_err *err);
int lunar_parse_int(const char *opt, const char *s, long lo, long hi, long *out, lunar_err *err);
int lunar_parse_float(const char *opt, const char *s, double lo, double hi, double *out,
                      lunar_err *err);
/* argv[*i] is an option that takes a value: returns the value and advances *i, or NULL (error set). */
const char *lunar_opt_value(int argc, char **argv, int *i, lunar_err *err);

/* The model-loading options every command that loads a model takes (vLLM spellings):
 *   --load-format auto|safetensors|dummy   --num-layers L   --tp-slice N   --dummy-seed S
 *   --quantization ptpc_fp8 (the only value; default: none)
 * Returns 1 when a is one of them (v consumed), 0 when not, -1 on a bad value. */
int lunar_parse_load_option(const char *a, const char *v, lunar_load_options *lo, lunar_err *err);
#define LUNAR_LOAD_OPTIONS_USAGE \
    "[--load-format auto|dummy] [--num-layers L] [--tp-slice N] [--dummy-seed S] [--quantization ptpc_fp8]"

#endif
