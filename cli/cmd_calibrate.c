/* `arserve calibrate`: HeatKV's calibration of a next-scale model. Runs a
 * full-cache generation per prompt of the prompts file (text for Infinity,
 * a class for VAR), records the
 * conditional row's attention mass from each scale to each earlier one,
 * and writes the S-CAS and CAS orderings into the model directory
 * (engine/policy/kv_calibration.h), where heatkv and heatkv_binary find them.
 * With --kv-scales, of any model: a full-cache generation per prompt, and
 * each (layer, head)'s largest |K| and |V| written for fp8 caches
 * (engine/kv/fp8_scales.h). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "engine/backend/backend.h"
#include "engine/calibration_run.h"
#include "engine/model.h"
#include "engine/planner.h"

#define MAX_PROMPTS 4096

static void progress(int done, int total, void *ctx) {
    (void)ctx;
    const int width = 30, filled = done * width / total;
    fprintf(stderr, "\rcalibrate [%.*s%*s] %d/%d generations", filled,
            "##############################", width - filled, "", done, total);
    if (done == total)
        fputc('\n', stderr);
    fflush(stderr);
}

/* The prompts file's lines (text, or classes by name or number for a
 * class-conditional model): blank lines and lines starting with '#' are
 * skipped. *lines holds them (free each, then it); the count, or -1. A
 * class-conditional model's lines are checked here, so that a bad one is
 * named by its file and line. */
static int read_lines(const model_t *m, const char *path, char ***lines) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "arserve calibrate: %s: cannot open: %s\n", path, strerror(errno));
        return -1;
    }
    char line[4096];
    int n = 0, no = 0;
    *lines = calloc(MAX_PROMPTS, sizeof **lines);
    while (*lines && fgets(line, sizeof line, f)) {
        no++;
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0] || line[0] == '#')
            continue;
        if (model_is_class_conditional(m) && model_class_parse(m, line) < 0) {
            fprintf(stderr,
                    "arserve calibrate: %s:%d: '%s' is neither a class name of the model nor "
                    "a class number from 0 to %d\n",
                    path, no, line, m->cfg.condition.num_classes - 1);
            n = -1;
            break;
        }
        if (n == MAX_PROMPTS) {
            fprintf(stderr, "arserve calibrate: %s: more than %d prompts\n", path, MAX_PROMPTS);
            n = -1;
            break;
        }
        if (!((*lines)[n++] = strdup(line)))
            break;
    }
    fclose(f);
    if (n == 0)
        fprintf(stderr, "arserve calibrate: %s: no prompts (one per line)\n", path);
    return n > 0 ? n : -1;
}

static void free_lines(char **lines) {
    for (int i = 0; lines && i < MAX_PROMPTS && lines[i]; i++)
        free(lines[i]);
    free(lines);
}

/* --kv-scales: measures and writes the fp8 scales; the exit code. */
static int calibrate_kv_scales(model_t *m, const char *prompts, const char *out) {
    char **lines = NULL, path[PATH_MAX];
    const int n = read_lines(m, prompts, &lines);
    fp8_scales_t s = {0};
    ar_error_t err = {{0}};
    int rc = 1;
    snprintf(path, sizeof path, "%s/%s", m->dir, FP8_SCALES_FILE);
    if (n > 0) {
        if (fp8_scales_measure(m, (const char *const *)lines, n, progress, NULL, &s, &err) !=
                AR_OK ||
            fp8_scales_save(&s, out ? out : path, &err) != AR_OK)
            fprintf(stderr, "\narserve calibrate: %s\n", err.msg);
        else {
            float k = 0, v = 0;
            for (int i = 0; i < s.n_layers * s.n_heads; i++) {
                k = s.k_amax[i] > k ? s.k_amax[i] : k;
                v = s.v_amax[i] > v ? s.v_amax[i] : v;
            }
            printf("wrote %s: fp8 KV scales of %d layers x %d heads from %d generations "
                   "(largest |K| %.4g, |V| %.4g)\n",
                   out ? out : path, s.n_layers, s.n_heads, n, k, v);
            rc = 0;
        }
    }
    fp8_scales_free(&s);
    free_lines(lines);
    return rc;
}

/* HeatKV's orderings of a next-scale model at image size `size`, written
 * beside the model's calibrations of its other sizes; the exit code. */
static int calibrate_orderings(model_t *m, const char *prompts, int size, dtype_t kv_dtype,
                               int sinks, const char *out) {
    char **lines = NULL, path[PATH_MAX];
    kv_calibration_t c = {0};
    ar_error_t err = {{0}};
    int rc = 1;
    const int n = read_lines(m, prompts, &lines);
    snprintf(path, sizeof path, "%s/%s", m->dir, KV_CALIBRATION_FILE);
    if (n > 0) {
        if (calibration_run(m, (const char *const *)lines, n, size, kv_dtype, sinks, progress, NULL,
                            &c, &err) != AR_OK ||
            kv_calibration_set_put(&m->calib, &c, &err) != AR_OK ||
            kv_calibration_set_save(&m->calib, out ? out : path, &err) != AR_OK)
            fprintf(stderr, "\narserve calibrate: %s\n", err.msg);
        else {
            kv_geometry_t g;
            model_geometry_sized(&m->cfg, 1, size, &g);
            const kv_calibration_t *made =
                kv_calibration_set_pick(&m->calib, m->cfg.image.sizes[size].name, &g);
            char sizes[512] = "";
            for (int i = 0, used = 0; i < m->calib.n && used < (int)sizeof sizes; i++)
                used += snprintf(sizes + used, sizeof sizes - (size_t)used, "%s%s", i ? ", " : "",
                                 m->calib.c[i].size[0] ? m->calib.c[i].size : "(unnamed)");
            printf("wrote %s: %d layers x %d heads, %d scales, %d generations, %d sink scales "
                   "at %s, K and V in %s; it calibrates %d image size%s: %s\n",
                   out ? out : path, made->n_layers, made->n_heads, made->n_scales, n,
                   made->sink_scales, made->size, planner_kv_dtype_name(kv_dtype), m->calib.n,
                   m->calib.n == 1 ? "" : "s", sizes);
            rc = 0;
        }
    }
    kv_calibration_free(&c);
    free_lines(lines);
    return rc;
}

int cmd_calibrate(int argc, char **argv, char **envp) {
    const char *model_dir = NULL, *prompts = NULL, *out = NULL, *backend = "cpu", *size_arg = NULL,
               *kv_dtype_arg = NULL;
    long long sinks = 3, threads = 0;
    int help = 0, scales = 0;
    char names[128], backend_help[256];
    snprintf(backend_help, sizeof backend_help, "%s, or %s (default cpu)",
             backend_list(0, names, sizeof names), BACKEND_AUTO);
    const cli_flag_t flags[] = {
        {"model", 0, CLI_STRING, &model_dir, .metavar = "DIR",
         .help = "the model directory: a next-scale one, or any with --kv-scales (required)"},
        {"prompts", 0, CLI_STRING, &prompts, .metavar = "FILE",
         .help = "one prompt per line: text for a text-prompted model (Infinity), a class "
                 "by name or number for a class-conditional one (HeatKV calibrates on 10) "
                 "(required)"},
        {"kv-scales", 0, CLI_BOOL, &scales,
         .help = "measure the fp8 KV scales (each layer and head's largest |K| and |V|) into "
                 "DIR/" FP8_SCALES_FILE " instead"},
        {"size", 0, CLI_STRING, &size_arg, .metavar = "WxH",
         .help = "the image size to calibrate, one of the model's (default its default "
                 "size); the file keeps the other sizes' calibrations"},
        {"kv-dtype", 0, CLI_STRING, &kv_dtype_arg, .metavar = "TYPE",
         .help = "type K and V are kept in while the images are drawn: f32 (default, the "
                 "statistics at full precision), or a type of generate's --kv-dtype: bf16 "
                 "halves the cache, for a model whose f32 cache does not fit beside its "
                 "weights"},
        {"sink-scales", 0, CLI_INT, &sinks, 0, 256, .metavar = "S",
         .help = "sink scales the CAS ordering leaves out (default 3, HeatKV's)"},
        {"out", 0, CLI_STRING, &out, .metavar = "FILE",
         .help = "where to write (default DIR/" KV_CALIBRATION_FILE " or DIR/" FP8_SCALES_FILE ")"},
        {"backend", 0, CLI_STRING, &backend, .metavar = "NAME", .help = backend_help},
        {"threads", 0, CLI_INT, &threads, 0, 1024, .metavar = "N",
         .help = "CPU threads, 0 = all cores (default 0)"},
        {0}};
    int rc = cli_flags_parse("calibrate", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help || !model_dir || !prompts) {
        FILE *f = help ? stdout : stderr;
        fprintf(
            f,
            "usage: arserve calibrate --model DIR --prompts FILE [--size WxH] [--kv-dtype TYPE] "
            "[--sink-scales S] [--out FILE]\n       arserve calibrate --model DIR --prompts FILE "
            "--kv-scales [--out FILE]\n\n");
        cli_flags_usage(f, flags);
        return help ? 0 : 2;
    }
    ar_error_t err = {{0}};
    backend_t *be = backend_open(backend, (int)threads, &err);
    if (!be) {
        fprintf(stderr, "arserve calibrate: %s\n", err.msg);
        return 1;
    }
    model_t m;
    if (model_load(&m, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "arserve calibrate: %s\n", err.msg);
        be->destroy(be);
        return 1;
    }
    int size = 0;
    char sizes[1024];
    dtype_t kv_dtype = DTYPE_F32;
    if (kv_dtype_arg && (scales || planner_kv_dtype_choose(kv_dtype_arg, m.weight_dtype, &kv_dtype,
                                                           &err) != AR_OK)) {
        if (scales)
            fprintf(stderr, "arserve calibrate: --kv-dtype: fp8 KV scales are measured on an "
                            "f32 cache only\n");
        else
            fprintf(stderr, "arserve calibrate: --kv-dtype: %s\n", err.msg);
        rc = 2;
    } else if (size_arg &&
               (scales || (size = model_size_by_name(&m.cfg, size_arg, sizes, sizeof sizes)) < 0)) {
        if (scales)
            fprintf(stderr, "arserve calibrate: --size: fp8 KV scales are measured at the default "
                            "size only\n");
        else
            fprintf(stderr, "arserve calibrate: --size: '%s' is not one of the model's sizes: %s\n",
                    size_arg, sizes);
        rc = 2;
    } else
        rc = scales ? calibrate_kv_scales(&m, prompts, out)
                    : calibrate_orderings(&m, prompts, size, kv_dtype, (int)sinks, out);
    model_free(&m);
    be->destroy(be);
    (void)envp;
    return rc;
}
