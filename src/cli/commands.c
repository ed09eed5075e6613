#include "cli/commands.h"

#include <stddef.h>

int lunar_cmd_info(int argc, char **argv);
int lunar_cmd_logits(int argc, char **argv);
int lunar_cmd_generate(int argc, char **argv);
int lunar_cmd_tokenize(int argc, char **argv);
int lunar_cmd_detokenize(int argc, char **argv);
int lunar_cmd_render(int argc, char **argv);
int lunar_cmd_plan(int argc, char **argv);
int lunar_cmd_serve(int argc, char **argv);
int lunar_cmd_bench(int argc, char **argv);
int lunar_cmd_bench_comm(int argc, char **argv);

const lunar_command lunar_commands[] = {
    {"info", lunar_cmd_info},
    {"logits", lunar_cmd_logits},
    {"generate", lunar_cmd_generate},
    {"tokenize", lunar_cmd_tokenize},
    {"detokenize", lunar_cmd_detokenize},
    {"render", lunar_cmd_render},
    {"plan", lunar_cmd_plan},
    {"serve", lunar_cmd_serve},
    {"bench", lunar_cmd_bench},
    {"bench-comm", lunar_cmd_bench_comm},
    {NULL, NULL},
};
