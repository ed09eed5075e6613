#ifndef LUNAR_CLI_COMMANDS_H
#define LUNAR_CLI_COMMANDS_H

/* A subcommand: run(argc, argv) with argv[0] the command name; returns the exit status. */
typedef struct lunar_command {
    const char *name;
    int (*run)(int argc, char **argv);
} lunar_command;

extern const lunar_command lunar_commands[]; /* terminated by {NULL, NULL} */

#endif
