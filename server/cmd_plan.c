/* `arserve plan`: what a request's KV cache does under each policy, from
 * the model's architecture alone (arserve.json; no weights): the tokens one
 * head holds and the bytes one image holds at every step (the planner's own
 * trajectory, counted in whole pool blocks, exactly what the daemon
 * reserves), the peak, and how many images a pool of a given size admits
 * together. Presets for published models live in config/models/. */
#include <dirent.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "engine/kv_policy.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/planner.h"

/* The daemon's defaults: --kv-pool-mb, and the prompt it sizes its start-up
 * log for (16 text tokens + BOS + image-start). */
#define PLAN_DEFAULT_POOL_MB 1024
#define PLAN_DEFAULT_PROMPT_TOKENS 18
#define PLAN_COL 17 /* width of one policy column */

static void plan_usage(FILE *f) {
    fprintf(
        f,
        "usage: arserve plan --model DIR_OR_PRESET [--policy P] [--budget B] [--pool-mb M]\n"
        "                    [--prompt-tokens N]\n"
        "\n"
        "Prints a request's KV trajectory (tokens per head and bytes per image at every step),\n"
        "its peak and how many images fit the pool, for each KV policy side by side. Reads only\n"
        "the model's arserve.json: no weights needed.\n"
        "\n"
        "  --model DIR_OR_PRESET  a model directory, or a preset from config/models/\n"
        "                         (janus-pro-1b, janus-pro-7b, llamagen-xl)\n"
        "  --policy P             full, streaming, linear or headkv (default: all four)\n"
        "  --budget B             KV budget for every policy but full: a fraction in (0, 1],\n"
        "                         e.g. 0.25 or 1/6 (default: each policy's own)\n"
        "  --pool-mb M            KV pool size in MiB (default %d, as the daemon's --kv-pool-mb)\n"
        "  --prompt-tokens N      condition prefix of each sequence: BOS + templated prompt +\n"
        "                         image-start (default %d: a 16-token prompt; LlamaGen c2i: 1)\n",
        PLAN_DEFAULT_POOL_MB, PLAN_DEFAULT_PROMPT_TOKENS);
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

/* Where presets may live, in order: $ARSERVE_PRESETS_DIR, config/models
 * beside the binary's folder (build/arserve -> config/models), and
 * config/models under the current directory. Returns how many exist. */
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
            static const char *const rel[] = {"/../config/models", "/config/models"};
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
    if (n < cap && is_dir("config/models") && realpath("config/models", real)) {
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
static int resolve_model(const char *arg, char *json, size_t cap) {
    if (is_file(arg)) {
        snprintf(json, cap, "%s", arg);
        return 0;
    }
    if (is_dir(arg)) {
        if ((size_t)snprintf(json, cap, "%s/arserve.json", arg) >= cap) {
            fprintf(stderr, "arserve: --model: path too long\n");
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
    fprintf(stderr, "arserve: --model: '%s' is neither a model directory nor a preset\n", arg);
    if (n == 0)
        fprintf(stderr, "  no preset folder found (config/models beside the binary or here; or set "
                        "ARSERVE_PRESETS_DIR)\n");
    for (int i = 0; i < n; i++) {
        fprintf(stderr, "  presets in %s: ", dirs[i]);
        list_presets(stderr, dirs[i]);
        fputc('\n', stderr);
    }
    return 2;
}

/* ---- numbers ---- */

/* "0.25", "1/6" -> (0, 1]. */
static int parse_budget(const char *s, double *out) {
    char *end;
    double v;
    const char *slash = strchr(s, '/');
    if (slash) {
        long long num, den;
        char a[32];
        size_t la = (size_t)(slash - s);
        if (la == 0 || la >= sizeof a)
            goto bad;
        memcpy(a, s, la);
        a[la] = 0;
        num = strtoll(a, &end, 10);
        if (*end || end == a)
            goto bad;
        den = strtoll(slash + 1, &end, 10);
        if (*end || end == slash + 1 || den <= 0)
            goto bad;
        v = (double)num / (double)den;
    } else {
        v = strtod(s, &end);
        if (*end || end == s || !isfinite(v))
            goto bad;
    }
    if (!(v > 0 && v <= 1)) {
        fprintf(stderr, "arserve: --budget: %s is outside (0, 1]\n", s);
        return -1;
    }
    *out = v;
    return 0;
bad:
    fprintf(stderr, "arserve: --budget: '%s' is not a fraction (e.g. 0.25 or 1/6)\n", s);
    return -1;
}

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

/* The unit of the trajectory tables: MiB, or KiB for small models. */
static const char *unit_name = "MiB";
static double unit_div = 1048576.0;
static double in_unit(size_t bytes) { return (double)bytes / unit_div; }

/* One cell of a side-by-side table: padded, except the last of its row. */
static void cell(const char *s, int last) {
    if (last)
        printf("%s", s);
    else
        printf("%-*s", PLAN_COL, s);
}

/* ---- one policy's plan ---- */

typedef struct policy_plan {
    kv_policy_params_t p;
    int ok;
    char why[1024]; /* when !ok: why the knobs do not suit the grid */
    int *tokens;    /* per head, per step */
    size_t *bytes;  /* per image, per step (whole blocks) */
    int peak_step;
    int peak_tokens;
    size_t peak_bytes;       /* whole blocks: what the planner reserves */
    size_t peak_token_bytes; /* the tokens alone */
} policy_plan_t;

/* Bytes of K and V for one token of one head of one sequence. */
static size_t token_head_bytes(const model_config_t *c) {
    return kv_pool_block_bytes(1, c->llm.head_dim);
}

/* Bytes of one token in every (layer, head) of both CFG sequences. */
static size_t token_image_bytes(const model_config_t *c) {
    return token_head_bytes(c) * (size_t)c->llm.num_layers * (size_t)c->llm.num_kv_heads * 2;
}

static int plan_policy(const model_config_t *c, int n_prompt, int bt, policy_plan_t *pp) {
    const int steps = planner_steps(c);
    pp->tokens = malloc((size_t)steps * sizeof *pp->tokens);
    pp->bytes = malloc((size_t)steps * sizeof *pp->bytes);
    if (!pp->tokens || !pp->bytes) {
        fprintf(stderr, "arserve: out of memory\n");
        return -1;
    }
    ar_error_t err = {{0}};
    kv_geometry_t g = planner_geometry(c, n_prompt);
    if (planner_trajectory_bytes(c, &pp->p, n_prompt, bt, pp->bytes, &err) != AR_OK ||
        kv_policy_trajectory(&pp->p, &g, pp->tokens) != AR_OK) {
        pp->ok = 0;
        snprintf(pp->why, sizeof pp->why, "%s", err.msg[0] ? err.msg : "no trajectory");
        return 0;
    }
    pp->ok = 1;
    /* Bytes grow with tokens (whole blocks of the same size for every
     * head), so the peak is at the first step holding the most tokens. */
    for (int t = 0; t < steps; t++)
        if (t == 0 || pp->tokens[t] > pp->peak_tokens) {
            pp->peak_tokens = pp->tokens[t];
            pp->peak_step = t;
        }
    for (int t = 0; t < steps; t++)
        if (pp->bytes[t] > pp->peak_bytes)
            pp->peak_bytes = pp->bytes[t];
    pp->peak_token_bytes = (size_t)pp->peak_tokens * token_image_bytes(c);
    return 0;
}

/* What a policy's budget comes to on this grid, in words. */
static void budget_words(const model_config_t *c, int n_prompt, const kv_policy_params_t *p,
                         char *buf, size_t n) {
    const int w = c->image.grid_width, h = c->image.grid_height, S = w * h;
    const double eps = 1e-9;
    switch (p->kind) {
    case KV_POLICY_STREAMING: {
        int cap = (int)floor(p->budget * (n_prompt + S - 1) + eps);
        snprintf(buf, n, "cap %d tokens per head: prefix %d + %d sinks + a window of %d", cap,
                 n_prompt, p->sink_tokens, cap - n_prompt - p->sink_tokens);
        break;
    }
    case KV_POLICY_LINEAR: {
        int lines = (int)floor(p->budget * h + eps);
        snprintf(buf, n,
                 "B = %d of %d lines = %d image tokens + the prefix; %d anchor line(s), %d recent; "
                 "compacts at each line end once full",
                 lines, h, lines * w, p->anchor_lines, p->recent_lines);
        break;
    }
    case KV_POLICY_HEADKV: {
        int G = (int)floor(p->budget * S + eps);
        snprintf(buf, n,
                 "G = %d image tokens per global head + the prefix (every head planned global); "
                 "groups at %d, updates every %d, %d recent lines",
                 G, p->headkv_group_tokens, p->headkv_buffer, p->headkv_recent_lines);
        break;
    }
    default:
        snprintf(buf, n, "every token kept");
        break;
    }
}

/* The trajectory as runs: maximal step ranges where a head gains one token
 * per step (or none); identical runs in a row are printed once with a
 * count. */
static void print_runs(const model_config_t *c, const policy_plan_t *pp) {
    const int steps = planner_steps(c);
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
            int diff = pp->tokens[a + 1] - pp->tokens[a];
            if (diff == 0 || diff == 1) {
                d = diff;
                b = a + 1;
                while (b + 1 < steps && pp->tokens[b + 1] - pp->tokens[b] == d)
                    b++;
            }
        }
        r[nr++] = (run_t){a, b, d};
        a = b + 1;
    }
    char head[32];
    snprintf(head, sizeof head, "KV per image (%s)", unit_name);
    printf("  %-13s %-22s %s\n", "steps", "tokens per head", head);
    for (int i = 0; i < nr;) {
        int k = i + 1;
        while (k < nr && r[k].b - r[k].a == r[i].b - r[i].a && r[k].d == r[i].d &&
               pp->tokens[r[k].a] == pp->tokens[r[i].a])
            k++;
        const run_t *x = &r[i];
        char range[32], tok[48], by[48], rep[96] = "";
        snprintf(range, sizeof range, "%d-%d", x->a, x->b);
        if (x->a == x->b)
            snprintf(range, sizeof range, "%d", x->a);
        if (x->d == 1 && x->b > x->a) {
            snprintf(tok, sizeof tok, "%d -> %d (+1/step)", pp->tokens[x->a], pp->tokens[x->b]);
            snprintf(by, sizeof by, "%.1f -> %.1f", in_unit(pp->bytes[x->a]),
                     in_unit(pp->bytes[x->b]));
        } else {
            snprintf(tok, sizeof tok, "%d%s", pp->tokens[x->a], x->b > x->a ? " (flat)" : "");
            snprintf(by, sizeof by, "%.1f", in_unit(pp->bytes[x->a]));
        }
        if (k - i > 1)
            snprintf(rep, sizeof rep, "repeats x%d, every %d steps, through step %d", k - i,
                     x->b - x->a + 1, r[k - 1].b);
        if (rep[0])
            printf("  %-13s %-22s %-24s %s\n", range, tok, by, rep);
        else
            printf("  %-13s %-22s %s\n", range, tok, by);
        i = k;
    }
    free(r);
}

int cmd_plan(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"policy", required_argument, 0, 'p'},
                                         {"budget", required_argument, 0, 'b'},
                                         {"pool-mb", required_argument, 0, 'M'},
                                         {"prompt-tokens", required_argument, 0, 'n'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model_arg = NULL;
    int only = -1, c;
    double budget = -1;
    long long pool_mb = PLAN_DEFAULT_POOL_MB, n_prompt = PLAN_DEFAULT_PROMPT_TOKENS;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case 'm':
            model_arg = optarg;
            break;
        case 'p':
            only = kv_policy_parse(optarg);
            if (only < 0) {
                fprintf(stderr,
                        "arserve: --policy: '%s' is not one of full, streaming, linear, headkv\n",
                        optarg);
                bad = 1;
            }
            break;
        case 'b':
            bad = parse_budget(optarg, &budget);
            break;
        case 'M':
            bad = cli_parse_int("--pool-mb", optarg, 1, 1 << 20, &pool_mb);
            break;
        case 'n':
            bad = cli_parse_int("--prompt-tokens", optarg, 1, MODEL_MAX_PROMPT_TOKENS, &n_prompt);
            break;
        case 'h':
            plan_usage(stdout);
            return 0;
        default:
            plan_usage(stderr);
            return 2;
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "arserve: plan: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!model_arg) {
        fprintf(stderr, "arserve: plan: --model DIR_OR_PRESET is required\n");
        plan_usage(stderr);
        return 2;
    }
    char json[PATH_MAX + 16];
    int rc = resolve_model(model_arg, json, sizeof json);
    if (rc)
        return rc;
    model_config_t cfg;
    ar_error_t err = {{0}};
    if (model_config_load(&cfg, json, &err) != AR_OK) {
        fprintf(stderr, "arserve: cannot read the model: %s\n", err.msg);
        return 1;
    }
    const model_config_t *mc = &cfg;
    const int steps = planner_steps(mc), P = (int)n_prompt;
    const int bt = planner_block_tokens(mc);
    const size_t block = kv_pool_block_bytes(bt, mc->llm.head_dim);
    const size_t pool_req = (size_t)pool_mb << 20;
    const size_t capacity = pool_req / block * block; /* the scheduler rounds down */
    const size_t elem = token_head_bytes(mc) / (2 * (size_t)mc->llm.head_dim);

    policy_plan_t plans[4];
    int np = 0;
    memset(plans, 0, sizeof plans);
    for (int k = KV_POLICY_FULL; k <= KV_POLICY_HEADKV; k++) {
        if (only >= 0 && k != only)
            continue;
        policy_plan_t *pp = &plans[np];
        kv_policy_defaults(&pp->p, (kv_policy_kind_t)k);
        if (budget > 0 && k != KV_POLICY_FULL)
            pp->p.budget = budget;
        np++;
        if (plan_policy(mc, P, bt, pp)) {
            rc = 1;
            goto out;
        }
    }

    if (planner_full_cache_bytes(mc, P) < ((size_t)10 << 20)) {
        unit_name = "KiB";
        unit_div = 1024.0;
    }

    /* ---- header ---- */
    printf("model    %s (%s)\n", mc->name, json);
    printf("         %d layers x %d KV heads x head_dim %d; %d x %d image tokens = %d steps; "
           "%d x %d px\n",
           mc->llm.num_layers, mc->llm.num_kv_heads, mc->llm.head_dim, mc->image.grid_height,
           mc->image.grid_width, steps, model_config_image_height(mc),
           model_config_image_width(mc));
    printf("request  prompt (condition prefix): %d token%s; %d image tokens; CFG: 2 sequences per "
           "image\n",
           P, P == 1 ? "" : "s", steps);
    printf(
        "KV dtype %s (%zu bytes per element), as the engine stores K and V: %zu bytes per token\n"
        "         per head, %zu bytes per token of one image (all layers and heads, both CFG "
        "rows);\n"
        "         the papers' reference code keeps bf16/fp16 KV, half these bytes (bf16 row)\n",
        elem == 4   ? "fp32"
        : elem == 2 ? "16-bit"
                    : "?",
        elem, token_head_bytes(mc), token_image_bytes(mc));
    printf("pool     %lld MiB: %zu blocks of %d token%s (%zu bytes: one head's K and V), %zu "
           "bytes\n",
           pool_mb, capacity / block, bt, bt == 1 ? "" : "s", block, capacity);
    printf("         block size: the largest power of two whose last-block overhead is under 5%%\n"
           "         of %d tokens (the image tokens a head holds at budget 1/%d)\n",
           steps / PLANNER_MIN_BUDGET_INV, PLANNER_MIN_BUDGET_INV);
    printf("full-cache KV per image (all %d tokens): %zu bytes = %.1f MiB\n\n", P + steps - 1,
           planner_full_cache_bytes(mc, P), mib(planner_full_cache_bytes(mc, P)));

    /* ---- side by side ---- */
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
        cell(b, i == np - 1);
    }
#define ROW(label, ...)                                                                            \
    do {                                                                                           \
        printf("\n%-32s", label);                                                                  \
        for (int i = 0; i < np; i++) {                                                             \
            const policy_plan_t *x = &plans[i];                                                    \
            char c_[64];                                                                           \
            if (!x->ok)                                                                            \
                snprintf(c_, sizeof c_, "n/a");                                                    \
            else                                                                                   \
                snprintf(c_, sizeof c_, __VA_ARGS__);                                              \
            cell(c_, i == np - 1);                                                                 \
        }                                                                                          \
    } while (0)
    ROW("peak tokens per head", "%d", x->peak_tokens);
    ROW("  at step", "%d", x->peak_step);
    ROW("peak KV per image, tokens (B)", "%zu", x->peak_token_bytes);
    ROW("  the same in bf16/fp16 (B)", "%zu", x->peak_token_bytes / elem * 2);
    ROW("peak in the pool, blocks (B)", "%zu", x->peak_bytes);
    ROW(unit_div > 1048575 ? "  MiB" : "  KiB", "%.1f", in_unit(x->peak_bytes));
    ROW("  of the full-cache peak", "%.1f%%",
        full && full->ok ? 100.0 * (double)x->peak_bytes / (double)full->peak_bytes : 0.0);
    ROW("  last-block overhead", "%.2f%%",
        100.0 * (double)(x->peak_bytes - x->peak_token_bytes) / (double)x->peak_token_bytes);
    ROW("images in the pool at once", "%zu", x->peak_bytes ? capacity / x->peak_bytes : 0);
#undef ROW
    printf("\n");
    for (int i = 0; i < np; i++)
        if (!plans[i].ok)
            printf("  %s: n/a, its knobs do not suit this grid (below)\n",
                   kv_policy_name(plans[i].p.kind));
    for (int i = 0; i < np; i++)
        if (plans[i].ok && plans[i].peak_bytes > capacity)
            printf(
                "  %s: one image needs %.1f MiB, more than the pool: the daemon refuses it (400)\n",
                kv_policy_name(plans[i].p.kind), mib(plans[i].peak_bytes));
    printf("  (images in the pool: images started together, so their trajectories peak together;\n"
           "   the planner admits exactly that many; staggered starts may fit more)\n");

    /* ---- sampled steps, side by side ---- */
    int any_ok = 0;
    for (int i = 0; i < np; i++)
        any_ok |= plans[i].ok;
    if (any_ok) {
        const int w = mc->image.grid_width, h = mc->image.grid_height;
        const int every = h - 1 > 8 ? (h - 1 + 7) / 8 : 1;
        printf("\ntrajectory at line ends: tokens per head / %s per image, during the step "
               "(after its append, before any compaction)\n",
               unit_name);
        printf("%-8s%-6s", "step", "line");
        for (int i = 0; i < np; i++)
            cell(kv_policy_name(plans[i].p.kind), i == np - 1);
        printf("\n");
        for (int l = 0; l <= h; l++) {
            int t = l == h ? steps - 1 : l * w;
            if (l > 0 && l < h && l % every)
                continue;
            if (l == h && t == (h - 1) * w)
                break;
            char line[16];
            if (l == 0)
                snprintf(line, sizeof line, "-");
            else if (l == h)
                snprintf(line, sizeof line, "last");
            else
                snprintf(line, sizeof line, "%d", l);
            printf("%-8d%-6s", t, line);
            for (int i = 0; i < np; i++) {
                char c_[48];
                if (plans[i].ok)
                    snprintf(c_, sizeof c_, "%d / %.1f", plans[i].tokens[t],
                             in_unit(plans[i].bytes[t]));
                else
                    snprintf(c_, sizeof c_, "n/a");
                cell(c_, i == np - 1);
            }
            printf("\n");
        }
    }

    /* ---- exact step ranges, per policy ---- */
    for (int i = 0; i < np; i++) {
        const policy_plan_t *x = &plans[i];
        char b[48], words[256];
        fmt_budget(b, sizeof b, x->p.kind == KV_POLICY_FULL ? 1.0 : x->p.budget);
        printf("\n%s", kv_policy_name(x->p.kind));
        if (x->p.kind != KV_POLICY_FULL)
            printf(" at budget %s", b);
        if (!x->ok) {
            printf(": does not suit this grid: %s\n", x->why);
            continue;
        }
        budget_words(mc, P, &x->p, words, sizeof words);
        printf(": %s\n", words);
        print_runs(mc, x);
    }
    if (only >= 0 && !plans[0].ok) {
        fprintf(stderr, "arserve: plan: %s: %s\n", kv_policy_name(plans[0].p.kind), plans[0].why);
        rc = 1;
    }
out:
    for (int i = 0; i < np; i++) {
        free(plans[i].tokens);
        free(plans[i].bytes);
    }
    return rc;
}
