/* The cost table (engine/cost_model.h). */
#include "engine/cost_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "engine/model_family.h"

void cost_features_add(cost_features_t *f, const kv_geometry_t *g, const planner_plan_t *pl,
                       int step, int n_images) {
    const double seqs = 2.0 * n_images;
    /* The rows the step computes: the prefix at the first, then a raster
     * step's one token, a scale step's whole scale; each attends the cache
     * the plan holds during the step and, for the last scale (computed, not
     * cached), the scale itself. */
    const int scale = g->step_unit == KV_STEP_SEGMENT;
    const int own = scale ? kv_geometry_sampled(g, step) : kv_geometry_fed(g, step);
    const double rows = own + (step == 0 ? g->n_prompt : 0),
                 keys = pl->tokens[step] + (scale ? own - kv_geometry_fed(g, step) : 0);
    f->sequences += seqs;
    f->new_tokens += seqs * rows;
    f->kv_attended += seqs * rows * keys;
    if (pl->scored && pl->scored[step])
        f->kv_scored += seqs * rows * keys;
}

void cost_features_accumulate(cost_features_t *acc, const cost_features_t *f, double weight) {
    acc->sequences += weight * f->sequences;
    acc->kv_attended += weight * f->kv_attended;
    acc->new_tokens += weight * f->new_tokens;
    acc->kv_scored += weight * f->kv_scored;
}

cost_features_t *cost_plan_features(const kv_geometry_t *g, const planner_plan_t *pl,
                                    int n_images) {
    cost_features_t *f = calloc((size_t)pl->steps, sizeof *f);
    for (int t = 0; f && t < pl->steps; t++)
        cost_features_add(&f[t], g, pl, t, n_images);
    return f;
}

static void features_row(const cost_features_t *f, double row[COST_N_COEF]) {
    row[0] = 1;
    row[1] = f->sequences;
    row[2] = f->kv_attended;
    row[3] = f->new_tokens;
    row[4] = f->kv_scored;
}

double cost_step_seconds(const cost_table_t *t, const cost_features_t *f) {
    double row[COST_N_COEF], s = 0;
    features_row(f, row);
    for (int k = 0; k < COST_N_COEF; k++)
        s += t->coef[k] * row[k];
    return s > 0 ? s : 0;
}

/* Solves the k x k system a x = b in place (Gaussian elimination with
 * partial pivoting); -1 when it is singular. */
static int solve(double *a, double *b, int k) {
    for (int c = 0; c < k; c++) {
        int p = c;
        for (int r = c + 1; r < k; r++)
            if (fabs(a[r * k + c]) > fabs(a[p * k + c]))
                p = r;
        if (fabs(a[p * k + c]) < 1e-300)
            return -1;
        for (int j = 0; j < k; j++) {
            double tmp = a[c * k + j];
            a[c * k + j] = a[p * k + j];
            a[p * k + j] = tmp;
        }
        double tmp = b[c];
        b[c] = b[p];
        b[p] = tmp;
        for (int r = c + 1; r < k; r++) {
            double m = a[r * k + c] / a[c * k + c];
            for (int j = c; j < k; j++)
                a[r * k + j] -= m * a[c * k + j];
            b[r] -= m * b[c];
        }
    }
    for (int c = k - 1; c >= 0; c--) {
        for (int j = c + 1; j < k; j++)
            b[c] -= a[c * k + j] * b[j];
        b[c] /= a[c * k + c];
    }
    return 0;
}

int cost_table_fit(cost_table_t *t, const cost_features_t *x, const double *y, int n) {
    /* A feature no sample has (kv_scored when no policy collected) is left out. */
    int use[COST_N_COEF];
    for (int j = 0; j < COST_N_COEF; j++) {
        use[j] = j == COST_COEF_INTERCEPT;
        for (int i = 0; !use[j] && i < n; i++) {
            double row[COST_N_COEF];
            features_row(&x[i], row);
            use[j] = row[j] != 0;
        }
    }
    for (int round = 0; round < COST_N_COEF; round++) {
        int idx[COST_N_COEF], k = 0;
        for (int j = 0; j < COST_N_COEF; j++)
            if (use[j])
                idx[k++] = j;
        if (n < k)
            return -1;
        /* Columns scaled to unit size, so features of very different
         * magnitudes (1 and millions of pairs) condition alike. */
        double scale[COST_N_COEF] = {0}, a[COST_N_COEF * COST_N_COEF] = {0}, b[COST_N_COEF] = {0};
        for (int i = 0; i < n; i++) {
            double row[COST_N_COEF];
            features_row(&x[i], row);
            for (int p = 0; p < k; p++)
                scale[p] = fmax(scale[p], fabs(row[idx[p]]));
        }
        for (int p = 0; p < k; p++)
            if (scale[p] == 0)
                scale[p] = 1;
        for (int i = 0; i < n; i++) {
            double row[COST_N_COEF];
            features_row(&x[i], row);
            for (int p = 0; p < k; p++) {
                for (int q = 0; q < k; q++)
                    a[p * k + q] += row[idx[p]] / scale[p] * row[idx[q]] / scale[q];
                b[p] += row[idx[p]] / scale[p] * y[i];
            }
        }
        int dropped = 0;
        if (solve(a, b, k) != 0) {
            /* Collinear features (e.g. every batch alike): drop the last. */
            use[idx[k - 1]] = 0;
            continue;
        }
        memset(t->coef, 0, sizeof t->coef);
        for (int p = 0; p < k; p++) {
            t->coef[idx[p]] = b[p] / scale[p];
            if (t->coef[idx[p]] < 0) {
                use[idx[p]] = 0;
                dropped = 1;
            }
        }
        if (!dropped)
            break;
        memset(t->coef, 0, sizeof t->coef);
    }
    double sq = 0, worst = 0;
    for (int i = 0; i < n; i++) {
        double e = (cost_step_seconds(t, &x[i]) - y[i]) / (y[i] > 0 ? y[i] : 1e-12);
        sq += e * e;
        worst = fmax(worst, fabs(e));
    }
    t->fit_samples = n;
    t->fit_rel_rms = n ? sqrt(sq / n) : 0;
    t->fit_max_rel = worst;
    return 0;
}

static const char *const COEF_KEYS[COST_N_COEF] = {
    "intercept_s", "per_sequence_s", "per_kv_attended_s", "per_new_token_s", "per_kv_scored_s"};

cJSON *cost_table_json(const cost_table_t *t) {
    cJSON *o = cJSON_CreateObject(), *step = cJSON_CreateObject(), *fit = cJSON_CreateObject();
    int ok = o && step && fit;
    ok &= cJSON_AddStringToObject(o, "family", t->family) != NULL;
    ok &= cJSON_AddStringToObject(o, "source", t->source) != NULL;
    for (int k = 0; ok && k < COST_N_COEF; k++)
        ok &= cJSON_AddNumberToObject(step, COEF_KEYS[k], t->coef[k]) != NULL;
    ok &= step && cJSON_AddItemToObject(o, "step", step);
    step = NULL;
    ok &= cJSON_AddNumberToObject(o, "decode_s_per_image", t->decode_s) != NULL;
    ok &= cJSON_AddNumberToObject(o, "png_s_per_image", t->png_s) != NULL;
    ok &= cJSON_AddNumberToObject(o, "http_s_per_request", t->http_s) != NULL;
    ok &= fit && cJSON_AddNumberToObject(fit, "samples", t->fit_samples) &&
          cJSON_AddNumberToObject(fit, "rel_rms", t->fit_rel_rms) &&
          cJSON_AddNumberToObject(fit, "max_rel", t->fit_max_rel) &&
          cJSON_AddItemToObject(o, "fit", fit);
    fit = NULL;
    cJSON_Delete(step);
    cJSON_Delete(fit);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

int cost_table_save(const cost_table_t *t, const char *path, char *why, size_t why_cap) {
    cJSON *o = cost_table_json(t);
    char *text = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    FILE *f = text ? fopen(path, "w") : NULL;
    int ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f)
        ok &= fclose(f) == 0;
    cJSON_free(text);
    if (!ok)
        snprintf(why, why_cap, "%s: cannot write: %s", path,
                 text ? strerror(errno) : "out of memory");
    return ok ? 0 : -1;
}

static int get_num(const cJSON *o, const char *key, double *v, const char *path, char *why,
                   size_t why_cap) {
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(n) || !(n->valuedouble >= 0) || !isfinite(n->valuedouble)) {
        snprintf(why, why_cap, "%s: \"%s\" must be a number >= 0", path, key);
        return -1;
    }
    *v = n->valuedouble;
    return 0;
}

int cost_table_load(cost_table_t *t, const char *path, char *why, size_t why_cap) {
    memset(t, 0, sizeof *t);
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(why, why_cap, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    char buf[65536];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    cJSON *o = cJSON_Parse(buf);
    if (!cJSON_IsObject(o)) {
        snprintf(why, why_cap,
                 "%s: not a JSON object (a cost table from `arserve bench --profile`)", path);
        cJSON_Delete(o);
        return -1;
    }
    const cJSON *fam = cJSON_GetObjectItemCaseSensitive(o, "family");
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(o, "source");
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    int rc = 0;
    if (!cJSON_IsString(fam) || strlen(fam->valuestring) >= sizeof t->family) {
        snprintf(why, why_cap, "%s: \"family\" must be a model family's name", path);
        rc = -1;
    } else if (!cJSON_IsObject(step)) {
        snprintf(why, why_cap, "%s: \"step\" must be an object of the step time's coefficients",
                 path);
        rc = -1;
    }
    /* Tables written before the policy's scoring was priced lack its term: 0. */
    for (int k = 0; rc == 0 && k < COST_N_COEF; k++)
        if (k != COST_COEF_KV_SCORED || cJSON_GetObjectItemCaseSensitive(step, COEF_KEYS[k]))
            rc = get_num(step, COEF_KEYS[k], &t->coef[k], path, why, why_cap);
    if (rc == 0)
        rc = get_num(o, "decode_s_per_image", &t->decode_s, path, why, why_cap);
    if (rc == 0)
        rc = get_num(o, "png_s_per_image", &t->png_s, path, why, why_cap);
    /* Tables written before the HTTP side was timed have none: 0. */
    if (rc == 0 && cJSON_GetObjectItemCaseSensitive(o, "http_s_per_request"))
        rc = get_num(o, "http_s_per_request", &t->http_s, path, why, why_cap);
    if (rc == 0) {
        snprintf(t->family, sizeof t->family, "%s", fam->valuestring);
        snprintf(t->source, sizeof t->source, "%s", cJSON_IsString(src) ? src->valuestring : "");
        const cJSON *fit = cJSON_GetObjectItemCaseSensitive(o, "fit");
        const cJSON *v;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "samples")) && cJSON_IsNumber(v))
            t->fit_samples = v->valueint;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "rel_rms")) && cJSON_IsNumber(v))
            t->fit_rel_rms = v->valuedouble;
        if ((v = cJSON_GetObjectItemCaseSensitive(fit, "max_rel")) && cJSON_IsNumber(v))
            t->fit_max_rel = v->valuedouble;
    }
    cJSON_Delete(o);
    return rc;
}

void cost_table_default(cost_table_t *t, const model_config_t *cfg, double n_weights) {
    memset(t, 0, sizeof *t);
    snprintf(t->family, sizeof t->family, "%s", model_family_of(cfg)->name);
    snprintf(t->source, sizeof t->source,
             "default: %.3g FLOP/s for 2 FLOP a weight a new token and 4 a head dimension a "
             "query-key pair (nothing timed yet)",
             COST_DEFAULT_FLOPS);
    t->coef[COST_COEF_NEW_TOKEN] = 2.0 * n_weights / COST_DEFAULT_FLOPS;
    t->coef[COST_COEF_KV_ATTENDED] =
        4.0 * cfg->llm.head_dim * cfg->llm.num_heads * cfg->llm.num_layers / COST_DEFAULT_FLOPS;
    t->decode_s = t->png_s = 1.0;
}

/* ---- the online learner ---- */

int cost_learner_init(cost_learner_t *l, const cost_table_t *seed, int cap, int refit_every) {
    memset(l, 0, sizeof *l);
    l->table = *seed;
    l->cap = cap > COST_N_COEF ? cap : COST_N_COEF + 1;
    l->refit_every = refit_every > 0 ? refit_every : 1;
    l->x = malloc((size_t)l->cap * sizeof *l->x);
    l->kept_x = malloc((size_t)l->cap * sizeof *l->kept_x);
    l->y = malloc((size_t)l->cap * sizeof *l->y);
    l->kept_y = malloc((size_t)l->cap * sizeof *l->kept_y);
    l->err = malloc((size_t)l->cap * sizeof *l->err);
    if (!l->x || !l->kept_x || !l->y || !l->kept_y || !l->err) {
        cost_learner_free(l);
        return AR_ERR;
    }
    return AR_OK;
}

void cost_learner_free(cost_learner_t *l) {
    free(l->x);
    free(l->kept_x);
    free(l->y);
    free(l->kept_y);
    free(l->err);
    memset(l, 0, sizeof *l);
}

static int by_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Fits over the ring: all of it; then the half least slowed under that
 * fit; then, up to COST_TRIM_ROUNDS times in all, what the last fit does
 * not find slowed beyond the outlier bound. A sample's error is how much
 * slower than its fit's step it was, relative to that step: something else
 * only ever slows a step, so a step faster than the fit says is the fit's
 * own error, never left out (a scale model's small steps, which a linear
 * table prices high, would otherwise go and take its mean with them). 1
 * when the table was replaced. */
static int refit(cost_learner_t *l) {
    cost_table_t t = l->table;
    if (cost_table_fit(&t, l->x, l->y, l->n) != 0)
        return 0;
    int k = l->n;
    for (int round = 0; round < COST_TRIM_ROUNDS; round++) {
        for (int i = 0; i < l->n; i++) {
            const double want = cost_step_seconds(&t, &l->x[i]);
            l->err[i] = (l->y[i] - want) / (want > 0 ? want : 1e-12);
        }
        memcpy(l->kept_y, l->err, (size_t)l->n * sizeof *l->kept_y);
        for (int i = 0; round > 0 && i < l->n; i++)
            l->kept_y[i] = fabs(l->kept_y[i]);
        qsort(l->kept_y, (size_t)l->n, sizeof *l->kept_y, by_double);
        /* The first trimmed fit takes the less slowed half only (up to half
         * the samples may be slowed), the later ones what is not slowed
         * beyond COST_OUTLIER_FACTOR times the median error's size. */
        const double median = l->kept_y[l->n / 2],
                     bound = round == 0 ? median
                                        : fmax(COST_OUTLIER_FACTOR * median, COST_OUTLIER_FLOOR);
        int kept = 0;
        for (int i = 0; i < l->n; i++)
            if (l->err[i] <= bound) {
                l->kept_x[kept] = l->x[i];
                l->kept_y[kept++] = l->y[i];
            }
        if (kept == k)
            break; /* the same samples as the last fit's */
        k = kept;
        cost_table_t trimmed = t;
        if (cost_table_fit(&trimmed, l->kept_x, l->kept_y, k) != 0)
            break;
        t = trimmed;
    }
    l->last_outliers = l->n - k;
    t.decode_s = l->table.decode_s;
    t.png_s = l->table.png_s;
    t.http_s = l->table.http_s;
    snprintf(t.source, sizeof t.source,
             "learned from the engine's last %d iterations (%d left out as outliers), refit %lld",
             l->n, l->last_outliers, l->refits + 1);
    l->table = t;
    l->refits++;
    return 1;
}

int cost_learner_add(cost_learner_t *l, const cost_features_t *f, double seconds) {
    if (!(seconds >= 0) || !isfinite(seconds))
        return 0;
    l->x[l->next] = *f;
    l->y[l->next] = seconds;
    l->next = (l->next + 1) % l->cap;
    if (l->n < l->cap)
        l->n++;
    l->samples++;
    l->fed_since_refit_s += seconds;
    if (++l->since_refit < l->refit_every || l->fed_since_refit_s < l->refit_s / COST_REFIT_SHARE)
        return 0;
    l->since_refit = 0;
    l->fed_since_refit_s = 0;
    const double t0 = clock_now_s();
    const int replaced = refit(l);
    l->refit_s = clock_now_s() - t0;
    return replaced;
}

/* Running means that forget: the last ~COST_MEAN_MEMORY values weigh. The
 * weight of the next value, counted in *count (the first: 1, replacing the
 * seed's). */
enum { COST_MEAN_MEMORY = 64 };
static double next_weight(int *count) {
    if (*count < COST_MEAN_MEMORY)
        (*count)++;
    return 1.0 / *count;
}

static void mean_add(double *mean, double w, double x) { *mean = (1 - w) * *mean + w * x; }

void cost_learner_add_image(cost_learner_t *l, double decode_s, double png_s) {
    if (!(decode_s >= 0) || !(png_s >= 0))
        return;
    const double w = next_weight(&l->images);
    mean_add(&l->table.decode_s, w, decode_s);
    mean_add(&l->table.png_s, w, png_s);
}

void cost_learner_add_request(cost_learner_t *l, double http_s) {
    if (http_s >= 0 && isfinite(http_s))
        mean_add(&l->table.http_s, next_weight(&l->requests), http_s);
}
