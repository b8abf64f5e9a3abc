/* The arserve binary's subcommands (cli/cmd_*.c), dispatched by cli/main.c,
 * and what they share besides the flag parser (cli/flags.h). */
#ifndef ARSERVE_CLI_H
#define ARSERVE_CLI_H

#include <stddef.h>

#define ARSERVE_VERSION "0.1.0"

/* Each takes its own argv (argv[0] is the subcommand's name) and returns
 * the process's exit status: 0, 1 for a failure, 2 for bad usage. */
int cmd_generate(int argc, char **argv, char **envp);
int cmd_serve(int argc, char **argv, char **envp);
int cmd_plan(int argc, char **argv, char **envp);
int cmd_calibrate(int argc, char **argv, char **envp);

/* The model directory to use when no --model is given: $ARSERVE_MODEL when
 * set and not empty (it must hold an arserve.json); else the shipped demo
 * model beside the executable, <exe dir>/../models/shapes (build/arserve ->
 * models/shapes) and then <exe dir>/models/shapes, the first that holds an
 * arserve.json. Copies it into out[n] and returns 0; otherwise prints a
 * message naming what was tried and saying to pass --model, and returns -1. */
int cli_default_model(char *out, size_t n);

#endif
