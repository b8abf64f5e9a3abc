/* The arserve binary's subcommands (cli/cmd_*.c), dispatched by cli/main.c,
 * and what they share besides the flag parser (cli/flags.h). */
#ifndef ARSERVE_CLI_H
#define ARSERVE_CLI_H

#include <stddef.h>

#include "base/dtype.h"
#include "engine/model_config.h"
#include "engine/policy/kv_calibration.h"

#define ARSERVE_VERSION "0.1.0"

/* Each takes its own argv (argv[0] is the subcommand's name) and returns
 * the process's exit status: 0, 1 for a failure, 2 for bad usage. */
int cmd_generate(int argc, char **argv, char **envp);
int cmd_serve(int argc, char **argv, char **envp);
int cmd_plan(int argc, char **argv, char **envp);
int cmd_calibrate(int argc, char **argv, char **envp);
int cmd_bench(int argc, char **argv, char **envp);
int cmd_simulate(int argc, char **argv, char **envp);

/* `arserve bench --profile` (cli/bench_profile.c): the engine timed
 * in-process, and the simulator's cost table fitted and written to out. */
typedef struct bench_profile_opts {
    const char *model_dir; /* NULL: the shipped demo model */
    const char *policies;  /* "full,linear"; NULL: full and one compressed policy */
    const char *out;       /* the cost table's file */
    long long max_batch, threads;
} bench_profile_opts_t;
bench_profile_opts_t bench_profile_defaults(void);
int bench_profile_run(const bench_profile_opts_t *o);

/* The model directory to use when no --model is given: $ARSERVE_MODEL when
 * set and not empty (it must hold an arserve.json); else the shipped demo
 * model beside the executable, <exe dir>/../models/shapes (build/arserve ->
 * models/shapes) and then <exe dir>/models/shapes, the first that holds an
 * arserve.json. Copies it into out[n] and returns 0; otherwise prints a
 * message naming what was tried and saying to pass --model, and returns -1. */
int cli_default_model(char *out, size_t n);

/* --model DIR_OR_PRESET of `plan` and `simulate` (cmd names the command
 * in messages): the arserve.json it names (into json[cap]) read into cfg,
 * with, for a next-scale model, its KV calibrations (or synthetic ones,
 * one per image size, when the directory has none: *calib_note says which)
 * in calib and cfg->kv_calibrations. 0, or 1 or 2 after a message; free
 * calib with kv_calibration_set_free. */
int cli_model_config(const char *cmd, const char *arg, char *json, size_t cap, model_config_t *cfg,
                     kv_calibration_set_t *calib, const char **calib_note);

/* --kv-dtype K,V (a CLI_EACH parser; dest: planner_kv_dtype_t). */
int cli_parse_kv_dtype(void *dest, const char *value);

/* What `serve --kv-dtype auto` stores K and V in for the model whose
 * arserve.json is json: its weights' type, or bf16 for a preset, which has
 * no weights (real checkpoints are bf16); *why says which. */
dtype_t cli_serve_kv_dtype(const char *json, const model_config_t *cfg, const char **why);

#endif
