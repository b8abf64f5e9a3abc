/* arserve: one binary with subcommands (COMMANDS below): serve (the
 * daemon, server/), generate (one image to a PNG file), plan (KV
 * trajectories), calibrate (HeatKV's orderings), bench (a load client)
 * and simulate (capacity on a simulated clock). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "engine/backend/backend.h"

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

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv, char **envp);
    const char *summary;
} command_t;

static const command_t COMMANDS[] = {
    {"serve", cmd_serve, "run the HTTP daemon"},
    {"generate", cmd_generate, "generate one image to a PNG file"},
    {"plan", cmd_plan, "a request's KV trajectory and what fits the pool, per KV policy"},
    {"calibrate", cmd_calibrate, "HeatKV's head orderings for a next-scale model"},
    {"bench", cmd_bench, "load a running daemon and report throughput and latency"},
    {"simulate", cmd_simulate, "the batcher and planner on a simulated clock: capacity"},
};
#define N_COMMANDS (int)(sizeof COMMANDS / sizeof COMMANDS[0])

static void usage(FILE *f) {
    fprintf(f,
            "arserve %s: autoregressive image generation\n\nusage: arserve <command> [options]\n\n"
            "commands:\n",
            ARSERVE_VERSION);
    for (int i = 0; i < N_COMMANDS; i++)
        fprintf(f, "  %-10s %s (arserve %s --help)\n", COMMANDS[i].name, COMMANDS[i].summary,
                COMMANDS[i].name);
    fprintf(f, "  %-10s print the version\n", "version");
}

static int version(void) {
    char names[128];
    backend_list(1, names, sizeof names);
    printf("arserve %s (backend%s: %s)\n", ARSERVE_VERSION, strchr(names, ',') ? "s" : "", names);
    return 0;
}

/* The daemon's OpenMP teams wait passively (asleep, not spinning) unless
 * the caller chose otherwise. libgomp reads OMP_WAIT_POLICY once, as it
 * loads, so `serve` sets it and starts itself again (same process, same
 * arguments); where that cannot be done it goes on as it is. Spinning
 * waits made a 2-thread engine 10-20x slower whenever another process
 * held a core; OMP_WAIT_POLICY=active trades that back for speed on
 * dedicated cores (docs/configuration.md, "Threads"). */
static void serve_waits_passively(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT"))
        return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) == 0)
        execv("/proc/self/exe", argv);
    unsetenv("OMP_WAIT_POLICY"); /* execv failed: this process's libgomp never saw it */
}

int main(int argc, char **argv, char **envp) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "serve"))
        serve_waits_passively(argv);
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(cmd, COMMANDS[i].name))
            return COMMANDS[i].run(argc - 1, argv + 1, envp);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version"))
        return version();
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "arserve: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
