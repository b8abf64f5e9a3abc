/* Subcommands of the arserve binary and the flag-parsing helpers they share. */
#ifndef ARSERVE_CLI_H
#define ARSERVE_CLI_H

#include <stddef.h>
#include <stdint.h>

#define ARSERVE_VERSION "0.1.0"

int cmd_generate(int argc, char **argv);
int cmd_serve(int argc, char **argv, char **envp);
int cmd_plan(int argc, char **argv);

/* Strict number parsing for flags: the whole string must be a number in
 * [lo, hi]; otherwise prints "arserve: --flag: ..." and returns -1. */
int cli_parse_int(const char *flag, const char *s, long long lo, long long hi, long long *out);
int cli_parse_float(const char *flag, const char *s, double lo, double hi, double *out);

/* The model directory to use when no --model is given: $ARSERVE_MODEL when
 * set and not empty (it must hold an arserve.json); else the shipped demo
 * model beside the executable, <exe dir>/../models/shapes (build/arserve ->
 * models/shapes) and then <exe dir>/models/shapes, the first that holds an
 * arserve.json. Copies it into out[n] and returns 0; otherwise prints a
 * message naming what was tried and saying to pass --model, and returns -1. */
int cli_default_model(char *out, size_t n);

#endif
