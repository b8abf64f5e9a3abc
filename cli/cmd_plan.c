/* `arserve plan`: what a request's KV cache does under each policy, from
 * the model's architecture alone (arserve.json; no weights): the tokens one
 * head holds and the bytes one image holds at every step (the planner's own
 * plan, counted in whole pool blocks, exactly what the daemon reserves), the
 * peak, the peak of a batch of images, and how many images a pool of a
 * given size admits together; in the engine's fp32 K and V, or in the types
 * --kv-dtype names (to compare with papers whose caches are 16-bit).
 * Presets for published models live in config/presets/. */
#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "engine/policy/kv_calibration.h"
#include "engine/policy/kv_policy.h"
#include "engine/weights.h"

/* The daemon's defaults: --kv-pool-mb, and the prompt it sizes its start-up
 * log for (16 text tokens + BOS + image-start). */
#define PLAN_DEFAULT_POOL_MB 1024
#define PLAN_DEFAULT_PROMPT_TOKENS 18
#define PLAN_COL 17 /* width of one policy column */

static void plan_usage(FILE *f, const cli_flag_t *flags) {
    fprintf(
        f, "usage: arserve plan --model DIR_OR_PRESET [--policy P] [--budget B] [--pool-mb M]\n"
           "                    [--device-gib G [--pool-share S]] [--prompt-tokens N] [--batch N]\n"
           "                    [--kv-dtype K,V]\n\n"
           "Prints a request's KV trajectory (tokens per head and bytes per image at every "
           "step;\nevery scale of a next-scale model), its peak, the peak of a batch and how "
           "many images\nfit the pool, for each KV policy side by side. Reads only the "
           "model's arserve.json:\nno weights needed.\n\n");
    cli_flags_usage(f, flags);
}

/* ---- finding the model ---- */

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* Where presets may live, in order: $ARSERVE_PRESETS_DIR, config/presets
 * beside the binary's folder (build/arserve -> config/presets), and
 * config/presets under the current directory. Returns how many exist. */
static int preset_dirs(char dirs[][PATH_MAX], int cap) {
    int n = 0;
    const char *env = getenv("ARSERVE_PRESETS_DIR");
    if (env && env[0] && n < cap && is_dir(env))
        snprintf(dirs[n++], PATH_MAX, "%s", env);
    char exe[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            static const char *const rel[] = {"/../config/presets", "/config/presets"};
            for (int i = 0; i < 2 && n < cap; i++) {
                char d[PATH_MAX];
                if ((size_t)snprintf(d, sizeof d, "%s%s", exe, rel[i]) >= sizeof d || !is_dir(d))
                    continue;
                char real[PATH_MAX];
                if (!realpath(d, real))
                    continue;
                int dup = 0;
                for (int k = 0; k < n; k++)
                    dup |= strcmp(dirs[k], real) == 0;
                if (!dup)
                    snprintf(dirs[n++], PATH_MAX, "%s", real);
            }
        }
    }
    char real[PATH_MAX];
    if (n < cap && is_dir("config/presets") && realpath("config/presets", real)) {
        int dup = 0;
        for (int k = 0; k < n; k++)
            dup |= strcmp(dirs[k], real) == 0;
        if (!dup)
            snprintf(dirs[n++], PATH_MAX, "%s", real);
    }
    return n;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Prints the presets in dir (subfolders holding an arserve.json), sorted. */
static void list_presets(FILE *f, const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    char *names[256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 256) {
        if (e->d_name[0] == '.')
            continue;
        char p[PATH_MAX];
        if ((size_t)snprintf(p, sizeof p, "%s/%s/arserve.json", dir, e->d_name) >= sizeof p ||
            !is_file(p))
            continue;
        if (!(names[n] = strdup(e->d_name)))
            break;
        n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s%s", i ? ", " : "", names[i]);
        free(names[i]);
    }
    if (!n)
        fprintf(f, "(none)");
}

/* DIR_OR_PRESET -> the arserve.json to read. A value with a slash, or
 * naming an existing folder or file, is a path; anything else a preset.
 * Returns 0, or 2 (message printed) when it is neither. */
static int resolve_model(const char *cmd, const char *arg, char *json, size_t cap) {
    if (is_file(arg)) {
        snprintf(json, cap, "%s", arg);
        return 0;
    }
    if (is_dir(arg)) {
        if ((size_t)snprintf(json, cap, "%s/arserve.json", arg) >= cap) {
            fprintf(stderr, "arserve %s: --model: path too long\n", cmd);
            return 2;
        }
        return 0;
    }
    char dirs[4][PATH_MAX];
    int n = preset_dirs(dirs, 4);
    if (!strchr(arg, '/') && arg[0] && strlen(arg) < 128) {
        for (int i = 0; i < n; i++) {
            char p[PATH_MAX];
            if ((size_t)snprintf(p, sizeof p, "%s/%s/arserve.json", dirs[i], arg) < sizeof p &&
                is_file(p)) {
                snprintf(json, cap, "%s", p);
                return 0;
            }
        }
    }
    fprintf(stderr, "arserve %s: --model: '%s' is neither a model directory nor a preset\n", cmd,
            arg);
    if (n == 0)
        fprintf(stderr,
                "  no preset folder found (config/presets beside the binary or here; or set "
                "ARSERVE_PRESETS_DIR)\n");
    for (int i = 0; i < n; i++) {
        fprintf(stderr, "  presets in %s: ", dirs[i]);
        list_presets(stderr, dirs[i]);
        fputc('\n', stderr);
    }
    return 2;
}

int cli_model_config(const char *cmd, const char *arg, char *json, size_t cap, model_config_t *cfg,
                     kv_calibration_set_t *calib, const char **calib_note) {
    int rc = resolve_model(cmd, arg, json, cap);
    if (rc)
        return rc;
    ar_error_t err = {{0}};
    memset(calib, 0, sizeof *calib);
    *calib_note = NULL;
    if (model_config_load(cfg, json, &err) != AR_OK) {
        fprintf(stderr, "arserve %s: cannot read the model: %s\n", cmd, err.msg);
        return 1;
    }
    /* HeatKV needs the model's calibration: the directory's, or for a
     * preset without weights a synthetic one per size (head order: the
     * budget's bytes do not depend on which heads go first). */
    if (strcmp(cfg->family, "scale") != 0)
        return 0;
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%.*s/%s", (int)(strrchr(json, '/') - json), json,
             KV_CALIBRATION_FILE);
    if (is_file(path)) {
        if (kv_calibration_set_load(calib, path, &err) != AR_OK ||
            model_check_calibrations(cfg, calib, &err) != AR_OK) {
            fprintf(stderr, "arserve %s: %s: %s\n", cmd, path, err.msg);
            kv_calibration_set_free(calib);
            return 1;
        }
        *calib_note = calib->n > 1 ? "the model's calibrations" : "the model's calibration";
    } else {
        const int n_sizes = cfg->image.n_sizes > 0 ? cfg->image.n_sizes : 1;
        for (int size = 0; size < n_sizes && size < KV_CALIBRATION_MAX_SIZES; size++) {
            kv_geometry_t g;
            model_geometry_sized(cfg, 0, size, &g);
            if (kv_calibration_synthetic(&calib->c[size], &g, 3, &err) != AR_OK)
                break;
            calib->n = size + 1;
        }
        *calib_note = "a synthetic ordering (no calibration in the model directory; bytes do "
                      "not depend on which heads go first, only where early pruning falls; "
                      "scalekv's drafters fall to the first layers of the first compacted "
                      "scale)";
    }
    cfg->kv_calibrations = calib->n ? calib : NULL;
    return 0;
}

/* ---- numbers ---- */

/* A budget as "1/6 = 0.1667" when it is a simple fraction, else "0.3". */
static void fmt_budget(char *buf, size_t n, double b) {
    if (b >= 1) {
        snprintf(buf, n, "1");
        return;
    }
    for (int q = 2; q <= 64; q++) {
        double p = b * q;
        if (fabs(p - floor(p + 0.5)) < 1e-9) {
            snprintf(buf, n, "%d/%d = %.4g", (int)floor(p + 0.5), q, b);
            return;
        }
    }
    snprintf(buf, n, "%.4g", b);
}

static double mib(size_t bytes) { return (double)bytes / 1048576.0; }

/* What the whole plan is computed for, and the unit of its tables: MiB,
 * or KiB for small models. */
typedef struct plan_ctx {
    const model_config_t *mc;
    const char *json;
    kv_geometry_t g;
    int P, steps, bt;
    int batch;             /* images planned together (each a CFG pair) */
    planner_kv_dtype_t dt; /* the types K and V are counted in */
    dtype_t serve_dt;      /* what `serve --kv-dtype auto` stores both in */
    const char *serve_why; /* and why */
    long long pool_mb;
    const char *pool_why; /* how --device-gib sized the pool, or NULL */
    size_t block, capacity;
    const char *unit_name;
    double unit_div;
} plan_ctx_t;

static double in_unit(const plan_ctx_t *x, size_t bytes) { return (double)bytes / x->unit_div; }

/* One cell of a side-by-side table: padded, except the last of its row. */
static void cell(const char *s, int last) {
    if (last)
        printf("%s", s);
    else
        printf("%-*s", PLAN_COL, s);
}

/* Bytes of K and V for one token of one head of one sequence. */
static size_t token_head_bytes(const plan_ctx_t *x) {
    return (size_t)x->mc->llm.head_dim * (dtype_size(x->dt.k) + dtype_size(x->dt.v));
}

/* Bytes of one token in every (layer, head) of both CFG sequences. */
static size_t token_image_bytes(const plan_ctx_t *x) {
    return planner_token_image_bytes(x->mc, x->dt);
}

/* Next-scale models: one step per scale. */
static int by_scale(const plan_ctx_t *x) { return x->g.step_unit == KV_STEP_SEGMENT; }

/* ---- one policy's plan ---- */

typedef struct policy_plan {
    kv_policy_params_t p;
    int ok;
    char why[1024]; /* when !ok: why the knobs do not suit the grid */
    planner_plan_t plan;
    int peak_tokens;
    size_t peak_token_bytes; /* the tokens alone, without the last blocks' rest */
} policy_plan_t;

static void plan_policy(const plan_ctx_t *x, policy_plan_t *pp) {
    ar_error_t err = {{0}};
    if (planner_plan_dtype(&pp->plan, x->mc, &pp->p, x->P, x->bt, x->dt, NULL, &err) != AR_OK) {
        snprintf(pp->why, sizeof pp->why, "%s", err.msg[0] ? err.msg : "no trajectory");
        return;
    }
    pp->ok = 1;
    pp->peak_tokens = pp->plan.tokens[pp->plan.peak_step];
    /* The tokens alone (heads may hold different lengths): the same plan
     * in blocks of one token. */
    planner_plan_t one;
    if (planner_plan_dtype(&one, x->mc, &pp->p, x->P, 1, x->dt, NULL, NULL) == AR_OK)
        pp->peak_token_bytes = one.peak_bytes;
    planner_plan_free(&one);
}

/* The trajectory as runs: maximal step ranges where a head gains one token
 * per step (or none); identical runs in a row are printed once with a
 * count. */
static void print_runs(const plan_ctx_t *x, const policy_plan_t *pp) {
    const int steps = x->steps;
    typedef struct {
        int a, b, d;
    } run_t;
    run_t *r = malloc((size_t)steps * sizeof *r);
    if (!r)
        return;
    int nr = 0;
    for (int a = 0; a < steps;) {
        int b = a, d = 0;
        if (a + 1 < steps) {
            int diff = pp->plan.tokens[a + 1] - pp->plan.tokens[a];
            if (diff == 0 || diff == 1) {
                d = diff;
                b = a + 1;
                while (b + 1 < steps && pp->plan.tokens[b + 1] - pp->plan.tokens[b] == d)
                    b++;
            }
        }
        r[nr++] = (run_t){a, b, d};
        a = b + 1;
    }
    char head[32];
    snprintf(head, sizeof head, "KV per image (%s)", x->unit_name);
    printf("  %-13s %-22s %s\n", "steps", "tokens per head", head);
    for (int i = 0; i < nr;) {
        int k = i + 1;
        while (k < nr && r[k].b - r[k].a == r[i].b - r[i].a && r[k].d == r[i].d &&
               pp->plan.tokens[r[k].a] == pp->plan.tokens[r[i].a])
            k++;
        const run_t *ru = &r[i];
        char range[32], tok[48], by[48], rep[96] = "";
        snprintf(range, sizeof range, "%d-%d", ru->a, ru->b);
        if (ru->a == ru->b)
            snprintf(range, sizeof range, "%d", ru->a);
        if (ru->d == 1 && ru->b > ru->a) {
            snprintf(tok, sizeof tok, "%d -> %d (+1/step)", pp->plan.tokens[ru->a],
                     pp->plan.tokens[ru->b]);
            snprintf(by, sizeof by, "%.1f -> %.1f", in_unit(x, pp->plan.bytes[ru->a]),
                     in_unit(x, pp->plan.bytes[ru->b]));
        } else {
            snprintf(tok, sizeof tok, "%d%s", pp->plan.tokens[ru->a],
                     ru->b > ru->a ? " (flat)" : "");
            snprintf(by, sizeof by, "%.1f", in_unit(x, pp->plan.bytes[ru->a]));
        }
        if (k - i > 1)
            snprintf(rep, sizeof rep, "repeats x%d, every %d steps, through step %d", k - i,
                     ru->b - ru->a + 1, r[k - 1].b);
        if (rep[0])
            printf("  %-13s %-22s %-24s %s\n", range, tok, by, rep);
        else
            printf("  %-13s %-22s %s\n", range, tok, by);
        i = k;
    }
    free(r);
}

/* ---- the report ---- */

static void print_header(const plan_ctx_t *x) {
    const model_config_t *mc = x->mc;
    const char *seg = model_family_of(mc)->segment_name;
    printf("model    %s (%s)\n", mc->name, x->json);
    printf("         %d layers x %d KV heads x head_dim %d; %d image tokens in %d %ss = %d "
           "steps; %d x %d px\n",
           mc->llm.num_layers, mc->llm.num_kv_heads, mc->llm.head_dim,
           kv_geometry_image_tokens(&x->g), x->g.n_segments, seg, x->steps,
           model_config_image_height(mc), model_config_image_width(mc));
    if (by_scale(x)) {
        const int last = x->g.segment_tokens[x->g.n_segments - 1];
        printf("request  condition: %s, not a cached prefix (--prompt-tokens does not apply); "
               "%d image\n         tokens, %d of them cached: the last scale (%d tokens) attends "
               "to itself and is never\n         cached; CFG: 2 sequences per image\n",
               model_config_has_text_encoder(mc) ? "a prompt read by cross-attention" : "a class",
               kv_geometry_image_tokens(&x->g), kv_geometry_image_tokens(&x->g) - last, last);
    } else if (mc->condition.num_classes > 0) {
        printf(
            "request  condition prefix: 1 class token (--prompt-tokens does not apply); %d image "
            "tokens; CFG: 2\n         sequences per image (the class, and the null class)\n",
            kv_geometry_image_tokens(&x->g));
    } else {
        printf("request  prompt (condition prefix): %d token%s; %d image tokens; CFG: 2 sequences "
               "per image\n",
               x->P, x->P == 1 ? "" : "s", kv_geometry_image_tokens(&x->g));
    }
    const int same = x->dt.k == x->dt.v;
    char types[64];
    if (same)
        snprintf(types, sizeof types, "%s (%zu bytes per element)",
                 x->dt.k == DTYPE_F32 ? "fp32" : planner_kv_dtype_name(x->dt.k),
                 dtype_size(x->dt.k));
    else
        snprintf(types, sizeof types, "K %s, V %s (%zu + %zu bytes per element)",
                 planner_kv_dtype_name(x->dt.k), planner_kv_dtype_name(x->dt.v),
                 dtype_size(x->dt.k), dtype_size(x->dt.v));
    if (planner_kv_dtype_equal(x->dt, planner_kv_same(x->serve_dt)))
        printf("KV dtype %s, as `serve` stores K and V: %zu bytes per token\n", types,
               token_head_bytes(x));
    else
        printf("KV dtype %s as planned (--kv-dtype): %zu bytes per token\n", types,
               token_head_bytes(x));
    printf("         per head, %zu bytes per token of one image (all layers and heads, both CFG "
           "rows)\n",
           token_image_bytes(x));
    if (x->dt.k != x->dt.v) {
        /* The pool holds one type: the wider of the two keeps both exact. */
        const dtype_t wide = dtype_size(x->dt.k) >= dtype_size(x->dt.v) ? x->dt.k : x->dt.v;
        const size_t one = kv_pool_block_bytes(1, mc->llm.head_dim, wide);
        printf("         NOTE: the engine's pool holds K and V in one type: `serve --kv-dtype "
               "%s`\n         (%zu bytes per token per head) reserves %.3gx every byte figure "
               "below\n",
               planner_kv_dtype_name(wide), one, (double)one / (double)token_head_bytes(x));
    } else {
        printf("         (`serve --kv-dtype auto` stores %s: %s; --kv-dtype takes f32,\n"
               "         bf16, f16 or fp8)\n",
               planner_kv_dtype_name(x->serve_dt), x->serve_why);
    }
    printf("pool     %lld MiB: %zu blocks of %d token%s (%zu bytes: one head's K and V), %zu "
           "bytes\n",
           x->pool_mb, x->capacity / x->block, x->bt, x->bt == 1 ? "" : "s", x->block, x->capacity);
    if (x->pool_why)
        printf("         %s\n", x->pool_why);
    printf("         block size: the largest power of two whose last-block overhead is under 5%%\n"
           "         of %d tokens (the image tokens a head holds at budget 1/%d)\n",
           kv_geometry_image_tokens(&x->g) / PLANNER_MIN_BUDGET_INV, PLANNER_MIN_BUDGET_INV);
    const size_t full = planner_full_cache_bytes_dtype(mc, x->P, x->dt);
    printf("full-cache KV per image (all %d tokens): %zu bytes = %.1f MiB\n",
           kv_geometry_held(&x->g, x->steps - 1), full, mib(full));
    printf(
        "full-cache KV of the batch (%d image%s x 2 CFG rows, --batch): %zu bytes = %.1f MiB\n\n",
        x->batch, x->batch == 1 ? "" : "s", full * (size_t)x->batch, mib(full * (size_t)x->batch));
}

/* One row of the side-by-side table: a label and a cell per policy ("n/a"
 * for one that does not suit the grid). */
typedef void (*row_fn)(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                       char *buf, size_t cap);

static void row_peak_tokens(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                            char *buf, size_t cap) {
    snprintf(buf, cap, "%d", pp->peak_tokens);
}
static void row_peak_step(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                          char *buf, size_t cap) {
    snprintf(buf, cap, "%d", pp->plan.peak_step);
}
static void row_token_bytes(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                            char *buf, size_t cap) {
    snprintf(buf, cap, "%zu", pp->peak_token_bytes);
}
static void row_half_bytes(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                           char *buf, size_t cap) {
    /* The peak's tokens are the same whatever their type. */
    const size_t elem = dtype_size(x->dt.k) + dtype_size(x->dt.v);
    snprintf(buf, cap, "%zu", pp->peak_token_bytes / elem * (2 + 2));
}
static void row_batch_tokens(const plan_ctx_t *x, const policy_plan_t *pp,
                             const policy_plan_t *full, char *buf, size_t cap) {
    snprintf(buf, cap, "%.1f", in_unit(x, pp->peak_token_bytes * (size_t)x->batch));
}
static void row_batch_blocks(const plan_ctx_t *x, const policy_plan_t *pp,
                             const policy_plan_t *full, char *buf, size_t cap) {
    snprintf(buf, cap, "%.1f", in_unit(x, pp->plan.peak_bytes * (size_t)x->batch));
}
static void row_block_bytes(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                            char *buf, size_t cap) {
    snprintf(buf, cap, "%zu", pp->plan.peak_bytes);
}
static void row_block_unit(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                           char *buf, size_t cap) {
    snprintf(buf, cap, "%.1f", in_unit(x, pp->plan.peak_bytes));
}
static void row_of_full(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                        char *buf, size_t cap) {
    if (full && full->ok)
        snprintf(buf, cap, "%.1f%%",
                 100.0 * (double)pp->plan.peak_bytes / (double)full->plan.peak_bytes);
    else
        snprintf(buf, cap, "n/a (no full)");
}
static void row_overhead(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                         char *buf, size_t cap) {
    snprintf(buf, cap, "%.2f%%",
             100.0 * (double)(pp->plan.peak_bytes - pp->peak_token_bytes) /
                 (double)pp->peak_token_bytes);
}
/* The budget itself, b x the full cache of the batch: HeatKV Table 1's
 * budget columns. */
static void row_budget_bytes(const plan_ctx_t *x, const policy_plan_t *pp,
                             const policy_plan_t *full, char *buf, size_t cap) {
    const double b = pp->p.kind == KV_POLICY_FULL ? 1.0 : pp->p.budget;
    if (pp->p.kind != KV_POLICY_FULL && !kv_policy_uses_budget(pp->p.kind, &x->g))
        snprintf(buf, cap, "not used");
    else
        snprintf(
            buf, cap, "%.1f",
            in_unit(x, (size_t)(b * (double)planner_full_cache_bytes_dtype(x->mc, x->P, x->dt) *
                                    x->batch +
                                0.5)));
}
static void row_images(const plan_ctx_t *x, const policy_plan_t *pp, const policy_plan_t *full,
                       char *buf, size_t cap) {
    snprintf(buf, cap, "%zu", pp->plan.peak_bytes ? x->capacity / pp->plan.peak_bytes : 0);
}

static void print_side_by_side(const plan_ctx_t *x, const policy_plan_t *plans, int np) {
    const policy_plan_t *full = NULL;
    for (int i = 0; i < np; i++)
        if (plans[i].p.kind == KV_POLICY_FULL)
            full = &plans[i];
    printf("%-32s", "");
    for (int i = 0; i < np; i++)
        cell(kv_policy_name(plans[i].p.kind), i == np - 1);
    printf("\n%-32s", "budget");
    for (int i = 0; i < np; i++) {
        char b[48];
        fmt_budget(b, sizeof b, plans[i].p.kind == KV_POLICY_FULL ? 1.0 : plans[i].p.budget);
        if (plans[i].p.kind != KV_POLICY_FULL && !kv_policy_uses_budget(plans[i].p.kind, &x->g))
            snprintf(b, sizeof b, "not used");
        cell(b, i == np - 1);
    }
    const struct {
        const char *label;
        row_fn fn;
    } rows[] = {
        {"peak tokens per head", row_peak_tokens},
        {"  at step", row_peak_step},
        {"peak KV per image, tokens (B)", row_token_bytes},
        {"  the same in bf16/fp16 (B)", row_half_bytes},
        {"peak in the pool, blocks (B)", row_block_bytes},
        {x->unit_div > 1048575 ? "  MiB" : "  KiB", row_block_unit},
        {"  of the full-cache peak", row_of_full},
        {"  last-block overhead", row_overhead},
        {x->unit_div > 1048575 ? "batch peak, tokens (MiB)" : "batch peak, tokens (KiB)",
         row_batch_tokens},
        {x->unit_div > 1048575 ? "batch peak in the pool (MiB)" : "batch peak in the pool (KiB)",
         row_batch_blocks},
        {x->unit_div > 1048575 ? "budget x full, batch (MiB)" : "budget x full, batch (KiB)",
         row_budget_bytes},
        {"images in the pool at once", row_images},
    };
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
        printf("\n%-32s", rows[r].label);
        for (int i = 0; i < np; i++) {
            char c[64] = "n/a";
            if (plans[i].ok)
                rows[r].fn(x, &plans[i], full, c, sizeof c);
            cell(c, i == np - 1);
        }
    }
    printf("\n");
    for (int i = 0; i < np; i++)
        if (!plans[i].ok)
            printf("  %s: n/a, its knobs do not suit this grid (below)\n",
                   kv_policy_name(plans[i].p.kind));
    for (int i = 0; i < np; i++)
        if (plans[i].ok && plans[i].plan.peak_bytes > x->capacity)
            printf(
                "  %s: one image needs %.1f MiB, more than the pool: the daemon refuses it (400)\n",
                kv_policy_name(plans[i].p.kind), mib(plans[i].plan.peak_bytes));
    if (x->batch > 1)
        printf("  (batch peak: %d images started together, --batch, 2 CFG rows each)\n", x->batch);
    printf("  (images in the pool: images started together, so their trajectories peak together;\n"
           "   the planner admits exactly that many; staggered starts may fit more)\n");
}

/* Next-scale models: every step (one scale each), side by side: the
 * scale's side and tokens, the tokens it adds to the cache, and the tokens
 * one head holds during the step under each policy (after the step's
 * append, before any compaction) with the bytes of the batch. */
static void print_scales(const plan_ctx_t *x, const policy_plan_t *plans, int np) {
    printf("\ntrajectory by scale: tokens per head / %s of the batch (%d image%s), during the "
           "step\n(after its append, before any compaction); the last scale is never cached\n",
           x->unit_name, x->batch, x->batch == 1 ? "" : "s");
    printf("%-6s%-6s%-8s%-8s", "step", "side", "tokens", "cached");
    for (int i = 0; i < np; i++)
        cell(kv_policy_name(plans[i].p.kind), i == np - 1);
    printf("\n");
    const image_size_t *z = &x->mc->image.sizes[x->mc->image.default_size];
    for (int t = 0; t < x->steps; t++) {
        char side[16];
        if (z->h[t] == z->w[t])
            snprintf(side, sizeof side, "%d", z->h[t]);
        else
            snprintf(side, sizeof side, "%dx%d", z->h[t], z->w[t]);
        printf("%-6d%-6s%-8d%-8d", t, side, x->g.segment_tokens[t], kv_geometry_fed(&x->g, t));
        for (int i = 0; i < np; i++) {
            char c[48] = "n/a";
            if (plans[i].ok)
                snprintf(c, sizeof c, "%d / %.1f", plans[i].plan.tokens[t],
                         in_unit(x, plans[i].plan.bytes[t] * (size_t)x->batch));
            cell(c, i == np - 1);
        }
        printf("\n");
    }
}

/* A model with several image sizes (Infinity's aspect ratios): each
 * size's schedule and its full cache, per image and for the batch. */
static void print_sizes(const plan_ctx_t *x) {
    const image_config_t *im = &x->mc->image;
    printf("\nimage sizes (size in a request; the full cache holds every scale but the last)\n");
    printf("%-12s%-8s%-10s%-9s%-9s%-16s%s\n", "size", "h:w", "last", "tokens", "cached",
           "full, MiB", "full of the batch, MiB");
    for (int i = 0; i < im->n_sizes; i++) {
        const image_size_t *z = &im->sizes[i];
        kv_geometry_t g;
        model_geometry_sized(x->mc, x->P, i, &g);
        const int steps = kv_geometry_steps(&g), held = kv_geometry_held(&g, steps - 1);
        const size_t full = (size_t)held * token_image_bytes(x);
        char last[16], ratio[16];
        snprintf(last, sizeof last, "%dx%d", z->h[z->n_scales - 1], z->w[z->n_scales - 1]);
        snprintf(ratio, sizeof ratio, "%.3f",
                 (double)z->h[z->n_scales - 1] / z->w[z->n_scales - 1]);
        printf("%-12s%-8s%-10s%-9d%-9d%-16.1f%.1f%s\n", z->name, ratio, last,
               kv_geometry_image_tokens(&g), held, mib(full), mib(full * (size_t)x->batch),
               i == im->default_size ? "   (default)" : "");
    }
}

/* The trajectory sampled at segment ends (at most about 8 of them), side
 * by side: tokens per head and bytes per image during the step. */
static void print_segment_ends(const plan_ctx_t *x, const policy_plan_t *plans, int np) {
    int any_ok = 0;
    for (int i = 0; i < np; i++)
        any_ok |= plans[i].ok;
    if (!any_ok)
        return;
    const int h = x->g.n_segments, every = h - 1 > 8 ? (h - 1 + 7) / 8 : 1;
    const char *seg = model_family_of(x->mc)->segment_name;
    printf("\ntrajectory at %s ends: tokens per head / %s per image, during the step "
           "(after its append, before any compaction)\n",
           seg, x->unit_name);
    printf("%-8s%-6s", "step", seg);
    for (int i = 0; i < np; i++)
        cell(kv_policy_name(plans[i].p.kind), i == np - 1);
    printf("\n");
    for (int l = 0; l <= h; l++) {
        /* l = 0: the first step; l < h: the end of the l-th segment; then
         * the last step, unless the last segment ended there. */
        int t = l == 0 ? 0 : kv_geometry_segment_end(&x->g, l - 1);
        if (l == h || t < 0)
            t = x->steps - 1;
        if (l > 0 && l < h && l % every)
            continue;
        if (l == h && t == kv_geometry_segment_end(&x->g, h - 2))
            break;
        char label[16];
        if (l == 0)
            snprintf(label, sizeof label, "-");
        else if (l == h)
            snprintf(label, sizeof label, "last");
        else
            snprintf(label, sizeof label, "%d", l);
        printf("%-8d%-6s", t, label);
        for (int i = 0; i < np; i++) {
            char c[48] = "n/a";
            if (plans[i].ok)
                snprintf(c, sizeof c, "%d / %.1f", plans[i].plan.tokens[t],
                         in_unit(x, plans[i].plan.bytes[t]));
            cell(c, i == np - 1);
        }
        printf("\n");
    }
}

/* Each policy's budget in words and its exact step ranges. */
static void print_details(const plan_ctx_t *x, const policy_plan_t *plans, int np) {
    for (int i = 0; i < np; i++) {
        const policy_plan_t *pp = &plans[i];
        char b[48], words[512];
        fmt_budget(b, sizeof b, pp->p.kind == KV_POLICY_FULL ? 1.0 : pp->p.budget);
        printf("\n%s", kv_policy_name(pp->p.kind));
        if (pp->p.kind != KV_POLICY_FULL && kv_policy_uses_budget(pp->p.kind, &x->g))
            printf(" at budget %s", b);
        if (!pp->ok) {
            printf(": does not suit this grid: %s\n", pp->why);
            continue;
        }
        kv_policy_describe(&pp->p, &x->g, words, sizeof words);
        printf(": %s\n", words);
        if (!by_scale(x)) /* a scale model's steps are all in the table above */
            print_runs(x, pp);
    }
}

/* The weight files beside json (a model's arserve.json) opened into ws
 * (headers only); AR_ERR with err set, or err's message empty for a
 * config that lists none. */
static int open_weights(const char *json, const model_config_t *cfg, weight_set_t *ws,
                        ar_error_t *err) {
    if (cfg->n_weight_files == 0)
        return AR_ERR;
    char dir[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%.*s", (int)(strrchr(json, '/') - json), json);
    return weight_set_open(ws, dir, cfg, NULL, err);
}

dtype_t cli_serve_kv_dtype(const char *json, const model_config_t *cfg, const char **why) {
    weight_set_t ws;
    ar_error_t err = {{0}};
    if (open_weights(json, cfg, &ws, &err) != AR_OK) {
        *why = "a preset without weights: bf16, as real checkpoints";
        return DTYPE_BF16;
    }
    const dtype_t t = weight_set_main_dtype(&ws);
    weight_set_close(&ws);
    *why = "the weights' type";
    return t;
}

/* --kv-dtype's value into a planner_kv_dtype_t (CLI_EACH). */
int cli_parse_kv_dtype(void *dest, const char *value) {
    ar_error_t err = {{0}};
    if (planner_kv_dtype_parse(value, dest, &err) == AR_OK)
        return 0;
    fprintf(stderr, "arserve: --kv-dtype: %s\n", err.msg);
    return 2;
}

/* x's KV types (dt, or serve's when dt is unset), geometry, blocks, pool
 * and the unit its tables print in. */
static void plan_ctx_setup(plan_ctx_t *x, planner_kv_dtype_t dt) {
    const model_config_t *cfg = x->mc;
    x->serve_dt = cli_serve_kv_dtype(x->json, cfg, &x->serve_why);
    x->dt = dt.k == DTYPE_U8 ? planner_kv_same(x->serve_dt) : dt;
    model_geometry(cfg, x->P, &x->g);
    x->steps = kv_geometry_steps(&x->g);
    x->bt = planner_block_tokens(cfg);
    x->block = (size_t)x->bt * token_head_bytes(x);
    x->capacity = ((size_t)x->pool_mb << 20) / x->block * x->block; /* the scheduler rounds down */
    const int small = planner_full_cache_bytes_dtype(cfg, x->P, x->dt) < ((size_t)10 << 20);
    x->unit_name = small ? "KiB" : "MiB";
    x->unit_div = small ? 1024.0 : 1048576.0;
}

/* Plans policy only (every one that suits the model when only < 0) at its
 * defaults, budget in place of its own when > 0; returns how many. */
static int plan_policies(const plan_ctx_t *x, policy_plan_t plans[KV_POLICY_COUNT], int only,
                         double budget) {
    int np = 0;
    memset(plans, 0, sizeof(policy_plan_t) * KV_POLICY_COUNT);
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        if (only >= 0 ? k != only : !kv_policy_suits((kv_policy_kind_t)k, &x->g))
            continue;
        policy_plan_t *pp = &plans[np++];
        kv_policy_defaults(&pp->p, (kv_policy_kind_t)k);
        if (budget > 0 && k != KV_POLICY_FULL)
            pp->p.budget = budget;
        plan_policy(x, pp);
    }
    return np;
}

/* --device-gib: share of what the weights in json's directory leave of a
 * device of gib GiB (an upper bound of serve's --kv-pool-mb auto there);
 * 0, or 2 with a message. */
static int device_pool(const char *json, const model_config_t *cfg, double gib, double share,
                       long long *pool_mb, char *why, size_t cap) {
    weight_set_t ws;
    ar_error_t err = {{0}};
    if (open_weights(json, cfg, &ws, &err) != AR_OK) {
        fprintf(stderr, "arserve plan: --device-gib needs the model's weights: %s\n",
                err.msg[0] ? err.msg : "its arserve.json lists none (give a model directory)");
        return 2;
    }
    const double weights = (double)weight_set_bytes(&ws), device = gib * 1073741824.0;
    weight_set_close(&ws);
    if (weights >= device) {
        fprintf(stderr, "arserve plan: the weights take %.2f GiB, more than the %.4g GiB device\n",
                weights / 1073741824.0, gib);
        return 2;
    }
    *pool_mb = (long long)(share * (device - weights) / 1048576.0);
    snprintf(why, cap,
             "--device-gib %.4g: %.3g%% of the %.2f GiB left after the weights' %.2f GiB (their "
             "files); serve's pool there is up to 5%% smaller",
             gib, 100 * share, (device - weights) / 1073741824.0, weights / 1073741824.0);
    if (*pool_mb < 1) {
        fprintf(stderr, "arserve plan: --device-gib %.4g leaves less than 1 MiB for the pool\n",
                gib);
        return 2;
    }
    return 0;
}

int cmd_plan(int argc, char **argv, char **envp) {
    const char *model_arg = NULL;
    int only = -1, help = 0;
    double budget = -1;
    long long budget_tokens = 0;
    long long pool_mb = PLAN_DEFAULT_POOL_MB, n_prompt = PLAN_DEFAULT_PROMPT_TOKENS, batch = 1;
    double device_gib = 0, pool_share = 0.9;
    planner_kv_dtype_t dt = {DTYPE_U8, DTYPE_U8}; /* unset: serve's */
    const cli_flag_t flags[] = {
        {"model", 0, CLI_STRING, &model_arg, .metavar = "DIR_OR_PRESET",
         .help = "a model directory, or a preset from config/presets/ (janus-pro-1b, "
                 "janus-pro-7b, llamagen-b .. llamagen-xxl, var-d16 .. var-d30, infinity-2b, "
                 "infinity-8b)"},
        {"policy", 0, CLI_CHOICE, &only, .choices = kv_policy_names, .metavar = "P",
         .help = "only this KV policy (default: every one)"},
        {"budget", 0, CLI_REAL, &budget, 0, 1, 1, .metavar = "B",
         .help = "KV budget for every policy but full: a fraction in (0, 1], e.g. 0.25 or 1/6 "
                 "(default: each policy's own)"},
        {"budget-tokens", 0, CLI_INT, &budget_tokens, 1, 1 << 30, .metavar = "N",
         .help = "the budget as the tokens one head may hold of the full cache's peak (HeatKV "
                 "Table 1: 1300, 650 and 265 of Infinity's 6425); instead of --budget"},
        {"pool-mb", 0, CLI_INT, &pool_mb, 1, 1 << 20, .metavar = "M",
         .help = "KV pool size in MiB (default 1024; the daemon's --kv-pool-mb auto sizes its "
                 "pool from the machine)"},
        {"device-gib", 0, CLI_REAL, &device_gib, 0, 1 << 20, 1, .metavar = "G",
         .help = "instead of --pool-mb: the pool on a device of G GiB, --pool-share of what the "
                 "model's weights (its files' bytes, 8-bit ones as they are) leave; an upper "
                 "bound of what `serve --kv-pool-mb auto` makes there (the CUDA backend also "
                 "leaves 5% of the device, at least 512 MiB, free and keeps about 100 MiB of "
                 "scratch); a model directory with its weights"},
        {"pool-share", 0, CLI_REAL, &pool_share, 0, 1, 1, .metavar = "S",
         .help = "with --device-gib: serve's --kv-pool-share (default 0.9)"},
        {"prompt-tokens", 0, CLI_INT, &n_prompt, 1, MODEL_MAX_PROMPT_TOKENS, .metavar = "N",
         .help = "condition prefix of each sequence: BOS + templated prompt + image-start "
                 "(default 18: a 16-token prompt; LlamaGen c2i: 1; next-scale models cache no "
                 "prefix and ignore it)"},
        {"batch", 0, CLI_INT, &batch, 1, 65536, .metavar = "N",
         .help = "images planned together, each a CFG pair of sequences: the batch's peak "
                 "(default 1)"},
        {"kv-dtype", 0, CLI_EACH, &dt, .each = cli_parse_kv_dtype, .metavar = "K,V",
         .help = "element types of the cache's K and V, each f32, bf16, f16 or fp8 (one value: "
                 "both); e.g. f32,bf16, what VAR's and HeatKV's reference code holds under "
                 "autocast. Default: what `serve --kv-dtype auto` stores, the weights' type "
                 "(bf16 for a preset: real checkpoints are bf16)"},
        {0}};
    int rc = cli_flags_parse("plan", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help) {
        plan_usage(stdout, flags);
        return 0;
    }
    if (!model_arg) {
        fprintf(stderr, "arserve plan: --model DIR_OR_PRESET is required\n");
        plan_usage(stderr, flags);
        return 2;
    }
    char json[PATH_MAX + 16];
    model_config_t cfg;
    kv_calibration_set_t calib = {0};
    const char *calib_note = NULL;
    if ((rc = cli_model_config("plan", model_arg, json, sizeof json, &cfg, &calib, &calib_note)))
        return rc;
    char pool_why[256];
    if (device_gib > 0 &&
        device_pool(json, &cfg, device_gib, pool_share, &pool_mb, pool_why, sizeof pool_why) != 0) {
        kv_calibration_set_free(&calib);
        return 2;
    }
    plan_ctx_t x = {.mc = &cfg,
                    .pool_why = device_gib > 0 ? pool_why : NULL,
                    .json = json,
                    /* A class-conditional raster model's prefix is its one class token. */
                    .P = cfg.condition.num_classes > 0 ? 1 : (int)n_prompt,
                    .pool_mb = pool_mb,
                    .batch = (int)batch};
    plan_ctx_setup(&x, dt);
    if (budget_tokens > 0) {
        const int peak = kv_geometry_held(&x.g, x.steps - 1);
        if (budget > 0 || budget_tokens > peak) {
            fprintf(stderr, "arserve plan: --budget-tokens %lld: %s\n", budget_tokens,
                    budget > 0 ? "give --budget or --budget-tokens, not both"
                               : "more than a head holds at the full cache's peak");
            kv_calibration_set_free(&calib);
            return 2;
        }
        budget = (double)budget_tokens / peak;
    }
    policy_plan_t plans[KV_POLICY_COUNT];
    const int np = plan_policies(&x, plans, only, budget);
    print_header(&x);
    print_side_by_side(&x, plans, np);
    if (by_scale(&x))
        print_scales(&x, plans, np);
    if (x.mc->image.n_sizes > 1)
        print_sizes(&x);
    else
        print_segment_ends(&x, plans, np);
    print_details(&x, plans, np);
    if (calib_note)
        printf("heatkv and scalekv calibration: %s\n", calib_note);
    if (budget_tokens > 0)
        printf("budget: %lld of the %d tokens a head holds at the full cache's peak = %.6g\n",
               budget_tokens, kv_geometry_held(&x.g, x.steps - 1), budget);
    if (only >= 0 && !plans[0].ok) {
        fprintf(stderr, "arserve plan: %s: %s\n", kv_policy_name(plans[0].p.kind), plans[0].why);
        rc = 1;
    }
    for (int i = 0; i < np; i++)
        planner_plan_free(&plans[i].plan);
    kv_calibration_set_free(&calib);
    (void)envp;
    return rc;
}
