#include "cli/commands.h"

#include <stddef.h>

const lunar_command lunar_commands[] = {
    {NULL, NULL},
};
