/* Table-driven flag parsing (flags.h). */
#include "cli/flags.h"

#include <math.h>
#include <string.h>

#include "base/text.h"

static const cli_flag_t *find_long(const cli_flag_t *flags, const char *name, size_t len) {
    for (const cli_flag_t *f = flags; f->name; f++)
        if (strlen(f->name) == len && !strncmp(f->name, name, len))
            return f;
    return NULL;
}

static const cli_flag_t *find_short(const cli_flag_t *flags, char c) {
    for (const cli_flag_t *f = flags; f->name; f++)
        if (f->short_name && f->short_name == c)
            return f;
    return NULL;
}

static void choices_list(const cli_flag_t *f, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = 0;
    for (const char *const *c = f->choices; c && *c; c++)
        text_append(buf, cap, &used, "%s%s", c == f->choices ? "" : ", ", *c);
}

/* Stores value into f's destination, or prints why not and returns 2. */
static int set_value(const char *cmd, const cli_flag_t *f, const char *value) {
    long long i;
    double x;
    switch (f->kind) {
    case CLI_STRING:
        *(const char **)f->dest = value;
        return 0;
    case CLI_BOOL:
        *(int *)f->dest = 1;
        return 0;
    case CLI_EACH:
        return f->each(f->dest, value) ? 2 : 0;
    case CLI_CHOICE:
        for (int k = 0; f->choices[k]; k++)
            if (!strcmp(f->choices[k], value)) {
                *(int *)f->dest = k;
                return 0;
            }
        char list[256];
        choices_list(f, list, sizeof list);
        fprintf(stderr, "arserve %s: --%s: '%s' is not one of %s\n", cmd, f->name, value, list);
        return 2;
    case CLI_INT:
        if (text_parse_int(value, &i) != NUMBER_OK) {
            fprintf(stderr, "arserve %s: --%s: '%s' is not an integer\n", cmd, f->name, value);
            return 2;
        }
        if (i < f->lo || i > f->hi) {
            fprintf(stderr, "arserve %s: --%s: %lld is outside [%.0f, %.0f]\n", cmd, f->name, i,
                    f->lo, f->hi);
            return 2;
        }
        *(long long *)f->dest = i;
        return 0;
    case CLI_REAL:
        if (text_parse_real(value, &x) != NUMBER_OK) {
            fprintf(stderr, "arserve %s: --%s: '%s' is not a number (e.g. 0.25 or 1/4)\n", cmd,
                    f->name, value);
            return 2;
        }
        if (!isfinite(x) || (f->lo_open ? !(x > f->lo) : !(x >= f->lo)) || x > f->hi) {
            fprintf(stderr, "arserve %s: --%s: %s is outside %c%g, %g]\n", cmd, f->name, value,
                    f->lo_open ? '(' : '[', f->lo, f->hi);
            return 2;
        }
        *(double *)f->dest = x;
        return 0;
    }
    return 2;
}

int cli_flags_parse(const char *cmd, const cli_flag_t *flags, int argc, char **argv, int *help) {
    *help = 0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            *help = 1;
            return 0;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *value = NULL;
        const cli_flag_t *f = NULL;
        if (arg[0] == '-' && arg[1] == '-' && arg[2]) {
            const char *eq = strchr(arg + 2, '=');
            size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
            f = find_long(flags, arg + 2, len);
            value = eq ? eq + 1 : NULL;
        } else if (arg[0] == '-' && arg[1] && !arg[2]) {
            f = find_short(flags, arg[1]);
        } else {
            fprintf(stderr, "arserve %s: unexpected argument '%s' (flags start with --)\n", cmd,
                    arg);
            return 2;
        }
        if (!f) {
            fprintf(stderr, "arserve %s: unrecognized flag '%s' (arserve %s --help lists them)\n",
                    cmd, arg, cmd);
            return 2;
        }
        if (f->kind == CLI_BOOL) {
            if (value) {
                fprintf(stderr, "arserve %s: --%s takes no value\n", cmd, f->name);
                return 2;
            }
        } else if (!value) {
            if (i + 1 >= argc) {
                fprintf(stderr, "arserve %s: --%s needs a value (%s)\n", cmd, f->name, f->metavar);
                return 2;
            }
            value = argv[++i];
        }
        if (set_value(cmd, f, value))
            return 2;
    }
    return 0;
}

void cli_flags_usage(FILE *out, const cli_flag_t *flags) {
    for (const cli_flag_t *f = flags; f->name; f++) {
        char left[96], text[768], list[256] = "";
        if (f->short_name)
            snprintf(left, sizeof left, "-%c, --%s", f->short_name, f->name);
        else
            snprintf(left, sizeof left, "    --%s", f->name);
        if (f->kind != CLI_BOOL)
            snprintf(left + strlen(left), sizeof left - strlen(left), " %s", f->metavar);
        if (f->kind == CLI_CHOICE)
            choices_list(f, list, sizeof list);
        snprintf(text, sizeof text, "%s%s%s%s", f->help, list[0] ? " (one of " : "", list,
                 list[0] ? ")" : "");
        if (strlen(left) > 20)
            fprintf(out, "  %s\n%24s", left, "");
        else
            fprintf(out, "  %-22s", left);
        text_print_wrapped(out, 0, 24, text);
    }
}
