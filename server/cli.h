/* Subcommands of the arserve binary and the flag-parsing helpers they share. */
#ifndef ARSERVE_CLI_H
#define ARSERVE_CLI_H

#include <stdint.h>

#define ARSERVE_VERSION "0.1.0"

int cmd_generate(int argc, char **argv);
int cmd_serve(int argc, char **argv, char **envp);
int cmd_plan(int argc, char **argv);

/* Strict number parsing for flags: the whole string must be a number in
 * [lo, hi]; otherwise prints "arserve: --flag: ..." and returns -1. */
int cli_parse_int(const char *flag, const char *s, long long lo, long long hi, long long *out);
int cli_parse_float(const char *flag, const char *s, double lo, double hi, double *out);

#endif
