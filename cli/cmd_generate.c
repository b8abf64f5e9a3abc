/* `arserve generate`: one image from a prompt to a PNG file, with a progress
 * bar on a terminal and a one-line summary. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/file.h"
#include "base/text.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "engine/backend/backend.h"
#include "engine/format/png_io.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"

typedef struct generate_args {
    const char *model_dir, *prompt, *prompt_ids, *class_label, *out_path, *backend, *kv_dtype;
    const char *size, *negative_prompt; /* NULL: the default size, none */
    long long seed, top_k, threads, repeat;
    double cfg, temperature, top_p; /* < 0: the model's default */
    int quiet;
    int verbose;
    int batch_invariant; /* backend.h's batch_invariant */
    int activations;     /* backend.h's backend_activations_t */
    int cpu_activations; /* backend.h's backend_cpu_activations_t */
    int graphs;          /* backend.h's backend_graphs_t */
    int kv_policy;       /* a kv_policy_kind_t */
    double kv_budget;    /* <= 0: the policy's own */
    /* For comparing with a reference implementation (NULL: none): the image
     * tokens drawn, tokens to take instead of sampling, each step's logits. */
    const char *tokens_out, *teacher_force, *logits_out;
} generate_args_t;

static void generate_usage(FILE *f, const cli_flag_t *flags) {
    fprintf(f, "usage: arserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | "
               "--class LABEL) [options]\n\n");
    cli_flags_usage(f, flags);
}

static void progress(int done, int total, double elapsed) {
    int width = 30, filled = total ? done * width / total : width;
    fprintf(stderr, "\r[%.*s%*s] %d/%d steps %.1fs", filled, "##############################",
            width - filled, "", done, total, elapsed);
    if (done == total)
        fputc('\n', stderr);
    fflush(stderr);
}

/* Parses "1,2,3" into ids; returns the count or -1 (message printed). */
static int parse_ids(const char *s, int *ids, int cap) {
    int n = 0;
    for (const char *p = s; *p;) {
        char tok[32];
        size_t len = strcspn(p, ",");
        long long v;
        if (len == 0 || len >= sizeof tok || n >= cap) {
            fprintf(stderr,
                    "arserve generate: --prompt-ids: expected comma-separated integers, "
                    "got '%s'\n",
                    s);
            return -1;
        }
        memcpy(tok, p, len);
        tok[len] = 0;
        if (text_parse_int(tok, &v) != NUMBER_OK || v < 0 || v > (1 << 30)) {
            fprintf(stderr, "arserve generate: --prompt-ids: '%s' is not a token id\n", tok);
            return -1;
        }
        ids[n++] = (int)v;
        p += len + (p[len] == ',');
    }
    if (n == 0)
        fprintf(stderr, "arserve generate: --prompt-ids: empty list\n");
    return n ? n : -1;
}

/* Words the model does not know: the image is drawn, and stderr says which. */
static void warn_unknown(const model_t *m, const char *field, const char *text) {
    char w[512];
    if (model_prompt_warning(m, field, text, w, sizeof w))
        fprintf(stderr, "arserve generate: warning: %s\n", w);
}

/* The prompt rows from --prompt or --prompt-ids; 0 or the exit status. */
static int prompt_rows(const generate_args_t *a, const model_t *m, int *cond, int *uncond,
                       int *n_prompt) {
    ar_error_t err = {{0}};
    if (a->prompt_ids) {
        int *ids = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof *ids);
        int n = ids ? parse_ids(a->prompt_ids, ids, MODEL_MAX_PROMPT_TOKENS - 2) : -1;
        int rc = n < 0 ? 2 : 0;
        if (!rc && model_prompt_from_ids(m, ids, n, cond, uncond, n_prompt, &err) != AR_OK) {
            fprintf(stderr, "arserve generate: --prompt-ids: %s\n", err.msg);
            rc = 2;
        }
        free(ids);
        return rc;
    }
    if (a->class_label) {
        /* An index, or a class name (which may itself look like anything). */
        char *end = NULL;
        const long label = strtol(a->class_label, &end, 10);
        const int by_name = model_class_find(m, a->class_label);
        if (by_name < 0 && (end == a->class_label || *end || label < 0 || label > INT32_MAX)) {
            fprintf(stderr,
                    "arserve generate: --class: '%s' is neither a class index nor one of the "
                    "model's class names\n",
                    a->class_label);
            return 2;
        }
        if (model_prompt_from_class(m, by_name >= 0 ? by_name : (int)label, cond, uncond, n_prompt,
                                    &err) != AR_OK) {
            fprintf(stderr, "arserve generate: --class: %s\n", err.msg);
            return 2;
        }
        return 0;
    }
    if (model_prompt_from_text(m, a->prompt, cond, uncond, n_prompt, &err) != AR_OK) {
        fprintf(stderr, "arserve generate: --prompt: %s\n", err.msg);
        return 2;
    }
    warn_unknown(m, "prompt", a->prompt);
    return 0;
}

/* --size and --negative-prompt into opts (neg: room for two prompts' rows,
 * the negative prompt's ids first); 0 or the exit status. */
static int image_opts(const generate_args_t *a, const model_t *m, gen_image_opts_t *opts,
                      int *neg) {
    if (a->size && strcmp(a->size, "auto") != 0) {
        char list[1024];
        if ((opts->size = model_size_by_name(&m->cfg, a->size, list, sizeof list)) < 0) {
            fprintf(stderr, "arserve generate: --size: '%s' is not one of the model's sizes: %s\n",
                    a->size, list);
            return 2;
        }
    }
    if (a->negative_prompt) {
        ar_error_t err = {{0}};
        if (!model_config_has_text_encoder(&m->cfg)) {
            fprintf(stderr, "arserve generate: --negative-prompt: this model takes none (only "
                            "Infinity-architecture models do)\n");
            return 2;
        }
        if (model_prompt_from_text(m, a->negative_prompt, neg, neg + MODEL_MAX_PROMPT_TOKENS,
                                   &opts->n_negative, &err) != AR_OK) {
            fprintf(stderr, "arserve generate: --negative-prompt: %s\n", err.msg);
            return 2;
        }
        warn_unknown(m, "negative_prompt", a->negative_prompt);
        opts->negative = neg;
    }
    return 0;
}

/* Steps the request to its end, showing progress on a terminal; adds what
 * the steps cost the backend (launches, copies, waits) into counts. */
/* The int32 little-endian values of path, exactly n of them, each in
 * [0, limit), into out. */
static int read_tokens(const char *path, int *out, size_t n, int limit, ar_error_t *err) {
    const size_t want = n * sizeof *out;
    size_t len = 0;
    char *bytes = file_read_all(path, "token file", want, &len, err);
    if (!bytes || len != want) {
        if (bytes)
            ar_errorf(err, "%s holds %zu bytes, fewer than the image's %zu int32 token values",
                      path, len, n);
        free(bytes);
        return ar_error_prefix(err, "--teacher-force (as --tokens-out writes them)");
    }
    memcpy(out, bytes, want);
    free(bytes);
    for (size_t i = 0; i < n; i++)
        if (out[i] < 0 || out[i] >= limit)
            return ar_errorf(err, "--teacher-force: %s: value %zu is %d, outside [0, %d)", path, i,
                             out[i], limit);
    return AR_OK;
}

static int write_values(const char *flag, const char *path, const void *p, size_t size, size_t n,
                        ar_error_t *err) {
    FILE *f = fopen(path, "wb");
    const int ok = f && fwrite(p, size, n, f) == n;
    if ((f && fclose(f) != 0) || !ok)
        return ar_errorf(err, "--%s: cannot write %s", flag, path);
    return AR_OK;
}

static int run_steps(gen_request_t *req, backend_t *be, int show, FILE *logits_out,
                     backend_stats_t *counts, double *step_s, ar_error_t *err) {
    const double t0 = clock_now_s();
    gen_request_t *batch[1] = {req};
    backend_stats_t before, after;
    backend_stats(be, &before);
    while (!gen_request_done(req)) {
        const double ts = clock_now_s();
        if (gen_step(batch, 1, err) != AR_OK)
            return AR_ERR;
        step_s[req->step - 1] = clock_now_s() - ts;
        if (logits_out &&
            fwrite(req->logits, sizeof(float), req->n_logits, logits_out) != req->n_logits)
            return ar_errorf(err, "--logits-out: cannot write step %d's logits", req->step - 1);
        if (show && (req->step % 8 == 0 || gen_request_done(req)))
            progress(req->step, req->n_steps, clock_now_s() - t0);
    }
    backend_stats(be, &after);
    backend_stats_add(counts, &after, &before);
    return AR_OK;
}

/* -v: where the time went: the steps (each one's where there are few, as a
 * next-scale model's scales; the first includes the prompt's encoder) and
 * the decoder with the PNG. */
static void print_times(const double *step_s, int n_steps, double decode_s) {
    double sum = 0;
    for (int i = 0; i < n_steps; i++)
        sum += step_s[i];
    fprintf(stderr, "time: %d steps %.2f s", n_steps, sum);
    for (int i = 0; n_steps <= 16 && i < n_steps; i++)
        fprintf(stderr, "%s%.2f", i ? " " : " (", step_s[i]);
    fprintf(stderr, "%s, decoder and PNG %.2f s\n", n_steps <= 16 ? ")" : "", decode_s);
}

/* -v: what a step cost the backend, or why there is nothing to count. */
static void print_step_counts(backend_t *be, const backend_stats_t *counts, int steps) {
    backend_stats_t st;
    char line[256];
    if (!backend_stats(be, &st)) {
        fprintf(stderr,
                "backend %s: computes in host memory, with no kernel launches or copies "
                "to count\n",
                be->name);
        return;
    }
    fprintf(stderr, "backend %s, per step over %d steps: %s; peak device memory %.1f MiB\n",
            be->name, steps, backend_stats_per_step(counts, steps, line, sizeof line),
            (double)st.device_peak_bytes / 1048576.0);
}

/* Loads, generates and writes; 0 or the exit status. */
static int generate(const generate_args_t *a, backend_t *be) {
    backend_stats_t counts = {0};
    model_t model;
    gen_request_t req = {0};
    kv_pool_t pool = {0};
    ar_error_t err = {{0}};
    /* cond, then the negative prompt's rows (--negative-prompt) */
    int *cond = malloc(3 * MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    uint8_t *rgb = NULL;
    int *forced = NULL;
    double *step_s = NULL;
    FILE *logits_out = NULL;
    int n_prompt = 0, rc = 1, loaded = 0;
    const double t0 = clock_now_s();
    if (!cond || !uncond) {
        fprintf(stderr, "arserve generate: out of memory\n");
        goto out;
    }
    if (model_load(&model, a->model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "arserve generate: cannot load model: %s\n", err.msg);
        goto out;
    }
    loaded = 1;
    if (be->cpu_activations == CPU_ACTIVATIONS_BF16 && model.weight_dtype != DTYPE_BF16 &&
        !strcmp(be->name, "cpu"))
        fprintf(stderr,
                "arserve generate: warning: --cpu-activations bf16 changes nothing here: the "
                "model's weights are %s, and bf16 arithmetic takes bf16 weights\n",
                dtype_name(model.weight_dtype));
    sampler_params_t sp = model.cfg.sampling;
    if (a->cfg >= 0)
        sp.cfg = (float)a->cfg;
    if (a->temperature >= 0)
        sp.temperature = (float)a->temperature;
    if (a->top_k >= 0)
        sp.top_k = (int)a->top_k;
    if (a->top_p >= 0)
        sp.top_p = (float)a->top_p;
    if ((rc = prompt_rows(a, &model, cond, uncond, &n_prompt)) != 0)
        goto out;
    rc = 1;
    const double t1 = clock_now_s();
    int H = model_config_image_height(&model.cfg), W = model_config_image_width(&model.cfg);
    dtype_t kv_dtype;
    if (planner_kv_dtype_choose(a->kv_dtype, model.weight_dtype, &kv_dtype, &err) != AR_OK) {
        fprintf(stderr, "arserve generate: --kv-dtype: %s\n", err.msg);
        rc = 2;
        goto out;
    }
    gen_image_opts_t opts = {0};
    if ((rc = image_opts(a, &model, &opts, cond + MODEL_MAX_PROMPT_TOKENS)) != 0)
        goto out;
    rc = 1;
    model_image_dims(&model.cfg, opts.size, &W, &H);
    /* The policy as serve resolves a request's, planned before it runs: a
     * policy that does not suit the model, or a budget too small for it, is
     * a usage error naming the flag. */
    kv_policy_params_t policy, defaults;
    kv_policy_defaults(&defaults, KV_POLICY_FULL);
    defaults.budget = 0; /* none given: each policy's own on the model */
    model_config_kv_card(&model.cfg, &defaults);
    const kv_policy_overrides_t o = {
        .has_kind = 1, .kind = (kv_policy_kind_t)a->kv_policy, .budget = a->kv_budget};
    const char *field = NULL;
    planner_plan_t plan = {0};
    if (kv_policy_resolve(&defaults, &o, &policy, &field, &err) != AR_OK ||
        planner_plan_sized(&plan, &model.cfg, &policy, n_prompt, opts.size,
                           planner_block_tokens(&model.cfg), planner_kv_same(kv_dtype), &field,
                           &err) != AR_OK) {
        const int budget = field && (!strcmp(field, "kv_budget") || !strcmp(field, "budget"));
        fprintf(stderr, "arserve generate: --%s: %s\n", budget ? "kv-budget" : "kv-policy",
                err.msg);
        rc = 2;
        goto out;
    }
    const size_t planned = plan.peak_bytes;
    planner_plan_free(&plan);
    if (gen_pool_for_one_image(&pool, &model, n_prompt, kv_dtype, &err) != AR_OK) {
        fprintf(stderr, "arserve generate: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out;
    }
    /* --repeat: the same image again in this process, each on the buffers
     * the first made (as a serving daemon's steady state); -v reports the
     * last. */
    for (long long rep = 0; rep < a->repeat; rep++) {
        const double t_image = clock_now_s();
        gen_request_free(&req);
        if (gen_request_init_opts(&req, &model, &pool, &policy, cond, uncond, n_prompt, &opts, &sp,
                                  (uint64_t)a->seed, 0, &err) != AR_OK) {
            fprintf(stderr, "arserve generate: %s\n", err.msg[0] ? err.msg : "out of memory");
            goto out;
        }
        const size_t n_values = gen_request_token_values(&req);
        if (a->logits_out && !a->teacher_force && strcmp(model.cfg.family, "raster") != 0) {
            fprintf(stderr,
                    "arserve generate: --logits-out: a next-scale model keeps a scale's "
                    "logits only with --teacher-force (--tokens-out of a run gives them)\n");
            rc = 2;
            goto out;
        }
        if (a->teacher_force && !forced &&
            (!(forced = malloc(n_values * sizeof *forced)) ||
             read_tokens(a->teacher_force, forced, n_values,
                         /* Infinity's values are bits */
                         model.cfg.image.codebook_size > 0 ? model.cfg.image.codebook_size : 2,
                         &err) != AR_OK)) {
            fprintf(stderr, "arserve generate: %s\n", err.msg[0] ? err.msg : "out of memory");
            rc = 2;
            goto out;
        }
        req.forced = forced;
        if (a->logits_out && rep == 0 && !(logits_out = fopen(a->logits_out, "wb"))) {
            fprintf(stderr, "arserve generate: --logits-out: cannot write %s\n", a->logits_out);
            goto out;
        }
        if ((!step_s && !(step_s = calloc((size_t)req.n_steps, sizeof *step_s))) ||
            run_steps(&req, be, !a->quiet && isatty(STDERR_FILENO), logits_out, &counts, step_s,
                      &err) != AR_OK) {
            fprintf(stderr, "arserve generate: %s\n", err.msg);
            goto out;
        }
        const double t_decode = clock_now_s();
        FILE *written = logits_out;
        logits_out = NULL;
        if ((written && fclose(written) != 0 &&
             ar_errorf(&err, "--logits-out: cannot write %s", a->logits_out)) ||
            (a->tokens_out && write_values("tokens-out", a->tokens_out, req.tokens, sizeof(int),
                                           n_values, &err) != AR_OK) ||
            (!rgb && !(rgb = malloc((size_t)H * W * 3))) || gen_decode(&req, rgb, &err) != AR_OK ||
            png_write_file(a->out_path, rgb, W, H, &err) != AR_OK) {
            fprintf(stderr, "arserve generate: %s\n", err.msg[0] ? err.msg : "out of memory");
            goto out;
        }
        const double t2 = clock_now_s(), took = t2 - (rep ? t_image : t1);
        char which[48] = "";
        if (a->repeat > 1)
            snprintf(which, sizeof which, " (image %d of %d)", (int)rep + 1, (int)a->repeat);
        if (!a->quiet)
            fprintf(stderr,
                    "%s: %dx%d, %s %d, %d steps in %.2f s (%.1f steps/s, %.3f images/s; "
                    "model load %.2f s)%s\n",
                    a->out_path, W, H,
                    model_is_class_conditional(&model) ? "class" : "prompt tokens:",
                    model_is_class_conditional(&model) ? cond[0] : n_prompt, req.n_steps, took,
                    req.n_steps / took, 1.0 / took, t1 - t0, which);
        if (rep + 1 < a->repeat) {
            counts = (backend_stats_t){0};
            continue;
        }
        if (a->verbose) {
            char budget[32] = "";
            if (kv_policy_uses_budget(policy.kind, NULL))
                snprintf(budget, sizeof budget, " at budget %.4g", policy.budget);
            fprintf(stderr, "KV cache: %s%s, peak %.2f MiB held, %.2f MiB planned\n",
                    kv_policy_name(policy.kind), budget,
                    (double)pool.peak_in_use * kv_pool_bytes_per_block(&pool) / 1048576.0,
                    (double)planned / 1048576.0);
            print_times(step_s, req.n_steps, t2 - t_decode);
            print_step_counts(be, &counts, req.n_steps);
        }
    }
    rc = 0;
out:
    /* model_load frees what it loaded when it fails. */
    if (logits_out)
        fclose(logits_out);
    free(forced);
    free(step_s);
    gen_request_free(&req);
    kv_pool_free(&pool);
    if (loaded)
        model_free(&model);
    free(rgb);
    free(cond);
    free(uncond);
    return rc;
}

int cmd_generate(int argc, char **argv, char **envp) {
    generate_args_t a = {.out_path = "out.png",
                         .backend = "auto",
                         .kv_dtype = "auto",
                         .kv_policy = KV_POLICY_FULL,
                         .top_k = -1,
                         .cfg = -1,
                         .temperature = -1,
                         .top_p = -1,
                         .repeat = 1};
    /* The backends' and the KV types' names from their tables. */
    char names[128], rule[256], backend_help[512], types[128] = "", kv_dtype_help[512];
    snprintf(backend_help, sizeof backend_help, "%s, or %s: %s (default %s)",
             backend_list(0, names, sizeof names), BACKEND_AUTO,
             backend_auto_rule(rule, sizeof rule), BACKEND_AUTO);
    for (const char *const *t = planner_kv_dtype_settings + 1; *t; t++)
        snprintf(types + strlen(types), sizeof types - strlen(types), "%s, ", *t);
    snprintf(kv_dtype_help, sizeof kv_dtype_help,
             "type the KV cache stores K and V in: %sor %s, the weights' type (default %s); "
             "fp8 is e4m3",
             types, planner_kv_dtype_settings[0], planner_kv_dtype_settings[0]);
    static const char *const on_off[] = {"off", "on", NULL};
    const cli_flag_t flags[] = {
        {"model", 0, CLI_STRING, &a.model_dir, .metavar = "DIR",
         .help = "model directory (arserve.json, weights, tokenizer.json); default: "
                 "$ARSERVE_MODEL, else the shipped demo model, ../models/shapes or "
                 "models/shapes from arserve's folder"},
        {"prompt", 0, CLI_STRING, &a.prompt, .metavar = "TEXT",
         .help = "prompt text, through the model's tokenizer and template"},
        {"prompt-ids", 0, CLI_STRING, &a.prompt_ids, .metavar = "LIST",
         .help = "comma-separated token ids of the templated prompt, bypassing the tokenizer "
                 "(BOS and image-start are still added)"},
        {"class", 0, CLI_STRING, &a.class_label, .metavar = "LABEL",
         .help = "class-conditional models: the class, as an index or one of the model's "
                 "class names"},
        {"size", 0, CLI_STRING, &a.size, .metavar = "WxH",
         .help = "image size, one of the model's (Infinity: one per aspect ratio; `arserve plan` "
                 "lists them), or auto, the default size"},
        {"negative-prompt", 0, CLI_STRING, &a.negative_prompt, .metavar = "TEXT",
         .help = "Infinity: a prompt the unconditional row follows instead of its learned rows"},
        {"seed", 0, CLI_INT, &a.seed, 0, (double)INT64_MAX, .metavar = "N",
         .help = "RNG seed (default 0)"},
        {"cfg", 0, CLI_REAL, &a.cfg, 0, 100, .metavar = "W",
         .help = "classifier-free guidance weight (model default)"},
        {"temperature", 0, CLI_REAL, &a.temperature, 0, 100, .metavar = "T",
         .help = "sampling temperature, 0 = greedy (model default)"},
        {"top-k", 0, CLI_INT, &a.top_k, 0, 1 << 20, .metavar = "K",
         .help = "keep the K most likely tokens, 0 = off, 1 = greedy"},
        {"top-p", 0, CLI_REAL, &a.top_p, 0, 1, 1, .metavar = "P",
         .help = "nucleus sampling mass in (0, 1], 1 = off"},
        {"threads", 0, CLI_INT, &a.threads, 0, 1024, .metavar = "N",
         .help = "CPU threads, 0 = all cores (default 0)"},
        {"backend", 0, CLI_STRING, &a.backend, .metavar = "NAME", .help = backend_help},
        {"gpu-activations", 0, CLI_CHOICE, &a.activations, .choices = backend_activations_names,
         .metavar = "MODE",
         .help = "GPU backends with 16-bit weights, as serve's gpu_activations: bf16 (default), "
                 "activations rounded to the weights' type for their GEMMs, or split, within "
                 "rounding of the CPU at twice the GEMM work"},
        {"cpu-activations", 0, CLI_CHOICE, &a.cpu_activations,
         .choices = backend_cpu_activations_names, .metavar = "f32|bf16",
         .help = "the CPU backend, as serve's cpu_activations: f32 (default), or activations "
                 "rounded to bf16 for the GEMMs of bf16 Linear weights, as PyTorch's bf16 "
                 "autocast (AMX tiles where the CPU has them)"},
        {"gpu-graphs", 0, CLI_CHOICE, &a.graphs, .choices = backend_graphs_names,
         .metavar = "on|off",
         .help = "GPU backends, as serve's gpu_graphs: each step captured into a CUDA graph and "
                 "launched as one (default on), or its ops launched one by one"},
        {"batch-invariant", 0, CLI_CHOICE, &a.batch_invariant, .choices = on_off,
         .metavar = "on|off",
         .help = "next-scale models: the image's rows and the guidance row's as GEMMs of their "
                 "own where the backend's rows depend on the batch, as serve's batch_invariant "
                 "(default off)"},
        {"kv-dtype", 0, CLI_STRING, &a.kv_dtype, .metavar = "TYPE", .help = kv_dtype_help},
        {"kv-policy", 0, CLI_CHOICE, &a.kv_policy, .choices = kv_policy_names, .metavar = "NAME",
         .help = "the KV-cache policy, as a request's kv_policy (default full); heatkv and "
                 "scalekv read the model's kv_calibration.json (arserve calibrate)"},
        {"kv-budget", 0, CLI_REAL, &a.kv_budget, 0, 1, 1, .metavar = "B",
         .help = "its budget, a fraction of the full cache in (0, 1] (default: the policy's "
                 "own)"},
        {"output", 'o', CLI_STRING, &a.out_path, .metavar = "FILE",
         .help = "PNG to write (default out.png)"},
        {"tokens-out", 0, CLI_STRING, &a.tokens_out, .metavar = "FILE",
         .help = "also write the image tokens drawn, int32 little-endian, in the order the "
                 "model draws them (a next-scale model: every scale's, Infinity: every bit)"},
        {"teacher-force", 0, CLI_STRING, &a.teacher_force, .metavar = "FILE",
         .help = "take these tokens (as --tokens-out writes them) instead of sampling: the "
                 "logits of a given sequence, beside a reference implementation's"},
        {"logits-out", 0, CLI_STRING, &a.logits_out, .metavar = "FILE",
         .help = "also write each step's logits, float32 little-endian, step after step: the "
                 "conditional row's then the unconditional's (a raster step: 2 x vocabulary; "
                 "a next-scale step, with --teacher-force: 2 x the scale's tokens x vocabulary)"},
        {"repeat", 0, CLI_INT, &a.repeat, 1, 1000, .metavar = "N",
         .help = "draw the image N times in this process, each on the buffers the first made "
                 "(a serving daemon's steady state): a summary line each, -v's for the last "
                 "(default 1)"},
        {"quiet", 'q', CLI_BOOL, &a.quiet, .help = "no progress bar and no summary"},
        {"verbose", 'v', CLI_BOOL, &a.verbose,
         .help = "also the KV cache's policy and its peak, held and planned, where the time "
                 "went (the steps, each one's for a next-scale model, and the decoder), and "
                 "what a step cost the backend: kernel launches, copies each way and stream waits "
                 "per step "
                 "(a device backend), and its peak device memory"},
        {0}};
    int help = 0, rc = cli_flags_parse("generate", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help) {
        generate_usage(stdout, flags);
        return 0;
    }
    if (!!a.prompt + !!a.prompt_ids + !!a.class_label != 1) {
        fprintf(stderr,
                "arserve generate: give exactly one of --prompt, --prompt-ids and --class\n");
        return 2;
    }
    if (a.prompt && !a.prompt[0]) {
        fprintf(stderr, "arserve generate: --prompt is empty\n");
        return 2;
    }
    if (a.repeat > 1 && a.logits_out) {
        fprintf(stderr, "arserve generate: --logits-out takes one image (--repeat 1)\n");
        return 2;
    }
    char default_dir[1024];
    if (!a.model_dir) {
        if (cli_default_model(default_dir, sizeof default_dir))
            return 1;
        a.model_dir = default_dir;
    }
    ar_error_t err = {{0}};
    backend_t *be = backend_open(a.backend, (int)a.threads, &err);
    if (!be) {
        fprintf(stderr, "arserve generate: %s\n", err.msg);
        return 1;
    }
    be->batch_invariant = a.batch_invariant;
    be->activations = (backend_activations_t)a.activations;
    be->cpu_activations = (backend_cpu_activations_t)a.cpu_activations;
    be->graphs = (backend_graphs_t)a.graphs;
    rc = generate(&a, be);
    be->destroy(be);
    (void)envp;
    return rc;
}
