/* The one flag parser of arserve's subcommands: each command describes its
 * flags in a table, and parsing, range checks, error messages and --help
 * all come from it. (`serve` reads its settings through server/config.h,
 * where every flag is also an environment variable and a config key; the
 * numbers parse alike: base/text.h.) */
#ifndef ARSERVE_CLI_FLAGS_H
#define ARSERVE_CLI_FLAGS_H

#include <stdio.h>

typedef enum cli_flag_kind {
    CLI_STRING, /* dest: const char ** */
    CLI_INT,    /* dest: long long *, in [lo, hi] */
    CLI_REAL,   /* dest: double *, in [lo, hi] or (lo, hi] when lo_open; "1/6" is a number */
    CLI_CHOICE, /* dest: int *, the index of the value in choices (NULL-terminated) */
    CLI_BOOL,   /* dest: int *, set to 1; takes no value */
    CLI_EACH,   /* each(dest, value) for every occurrence: a repeatable flag */
} cli_flag_kind_t;

typedef struct cli_flag {
    const char *name; /* "seed" for --seed; NULL ends a table */
    char short_name;  /* 'o' for -o, or 0 */
    cli_flag_kind_t kind;
    void *dest;
    double lo, hi;
    int lo_open;
    const char *const *choices;
    /* CLI_EACH: takes the value (0), or prints why not and returns 2 */
    int (*each)(void *dest, const char *value);
    const char *metavar; /* "N", "DIR" (none for CLI_BOOL) */
    const char *help;    /* one or more sentences; wrapped by cli_flags_usage */
} cli_flag_t;

/* Parses argv[1..argc): "--name VALUE", "--name=VALUE" and "-x VALUE"; a
 * flag given twice keeps its last value. --help or -h sets *help and
 * returns 0 at once. Anything else wrong prints "arserve CMD: ..." naming
 * the flag on stderr and returns 2: an unknown flag ("unrecognized"), a
 * missing value, a value that is not a number of its kind, is out of its
 * range or not one of its choices, and any positional argument. */
int cli_flags_parse(const char *cmd, const cli_flag_t *flags, int argc, char **argv, int *help);

/* One entry per flag: "  --seed N", then its help (and choices), wrapped. */
void cli_flags_usage(FILE *f, const cli_flag_t *flags);

#endif
