/* arserve: one binary with subcommands: serve (the daemon) and generate
 * (one image to a PNG file); plan, calibrate, bench and simulate come with
 * their issues. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

int cli_parse_int(const char *flag, const char *s, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) {
        fprintf(stderr, "arserve: %s: '%s' is not an integer\n", flag, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "arserve: %s: %lld is outside [%lld, %lld]\n", flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int cli_parse_float(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) {
        fprintf(stderr, "arserve: %s: '%s' is not a number\n", flag, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "arserve: %s: %g is outside [%g, %g]\n", flag, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

static void usage(FILE *f) {
    fprintf(f,
            "arserve %s: autoregressive image generation\n"
            "\n"
            "usage: arserve <command> [options]\n"
            "\n"
            "commands:\n"
            "  serve      run the HTTP daemon (arserve serve --help)\n"
            "  generate   generate one image to a PNG file (arserve generate --help)\n"
            "  plan       a request's KV trajectory and what fits the pool, per KV policy\n"
            "             (arserve plan --help)\n"
            "  version    print the version\n",
            ARSERVE_VERSION);
}

int main(int argc, char **argv, char **envp) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return cmd_serve(argc - 1, argv + 1, envp);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 1, argv + 1);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
#ifdef ARSERVE_CUDA
        printf("arserve %s (backends: cpu, cuda)\n", ARSERVE_VERSION);
#else
        printf("arserve %s (backend: cpu)\n", ARSERVE_VERSION);
#endif
        return 0;
    }
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "arserve: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
