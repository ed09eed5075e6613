#include "cli/commands.h"

#include <stddef.h>

int lunar_cmd_info(int argc, char **argv);
int lunar_cmd_logits(int argc, char **argv);
int lunar_cmd_generate(int argc, char **argv);
int lunar_cmd_plan(int argc, char **argv);

const lunar_command lunar_commands[] = {
    {"info", lunar_cmd_info},
    {"logits", lunar_cmd_logits},
    {"generate", lunar_cmd_generate},
    {"plan", lunar_cmd_plan},
    {NULL, NULL},
};
