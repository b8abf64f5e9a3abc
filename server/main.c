/* arserve: one binary with subcommands: serve (the daemon) and generate
 * (one image to a PNG file); plan, calibrate, bench and simulate come with
 * their issues. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* The shipped demo model, found from the executable's own path so that any
 * working directory works: build/arserve finds models/shapes of the checkout,
 * /opt/arserve/bin/arserve finds /opt/arserve/models/shapes. */
#define SHIPPED_MODEL "models/shapes"

static int has_model_config(const char *dir) {
    char path[PATH_MAX + 16];
    struct stat st;
    if ((size_t)snprintf(path, sizeof path, "%s/arserve.json", dir) >= sizeof path)
        return 0;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int copy_path(char *out, size_t n, const char *dir) {
    if ((size_t)snprintf(out, n, "%s", dir) < n)
        return 0;
    fprintf(stderr, "arserve: model path too long: %s\n", dir);
    return -1;
}

int cli_default_model(char *out, size_t n) {
    const char *env = getenv("ARSERVE_MODEL");
    if (env && env[0]) {
        if (has_model_config(env))
            return copy_path(out, n, env);
        fprintf(stderr,
                "arserve: ARSERVE_MODEL=%s has no arserve.json; set it to a model directory, "
                "unset it, or pass --model DIR\n",
                env);
        return -1;
    }
    char exe[PATH_MAX], tried[2][PATH_MAX + 32];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len <= 0) {
        fprintf(stderr,
                "arserve: no --model given and /proc/self/exe is unreadable (%s); "
                "pass --model DIR\n",
                strerror(errno));
        return -1;
    }
    exe[len] = 0;
    *strrchr(exe, '/') = 0; /* the executable's folder ("" for /arserve) */
    const char *up = strrchr(exe, '/');
    snprintf(tried[0], sizeof tried[0], "%.*s/" SHIPPED_MODEL, up ? (int)(up - exe) : 0, exe);
    snprintf(tried[1], sizeof tried[1], "%s/" SHIPPED_MODEL, exe);
    for (int i = 0; i < 2; i++)
        if (has_model_config(tried[i]))
            return copy_path(out, n, tried[i]);
    fprintf(stderr,
            "arserve: no --model given and no shipped model found: no arserve.json in %s or %s "
            "(ARSERVE_MODEL is unset); pass --model DIR\n",
            tried[0], tried[1]);
    return -1;
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
    if (!strcmp(cmd, "generate"))
        return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve"))
        return cmd_serve(argc - 1, argv + 1, envp);
    if (!strcmp(cmd, "plan"))
        return cmd_plan(argc - 1, argv + 1);
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
