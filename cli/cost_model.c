/* The simulator's cost table (cli/cost_model.h). */
#include "cli/cost_model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cost_features_add(cost_features_t *f, const kv_geometry_t *g, const planner_plan_t *pl,
                       int step, int n_images) {
    const double seqs = 2.0 * n_images;
    const double fed = kv_geometry_fed(g, step) + (step == 0 ? g->n_prompt : 0);
    f->sequences += seqs;
    f->new_tokens += seqs * fed;
    f->kv_attended += seqs * fed * pl->tokens[step];
}

static void features_row(const cost_features_t *f, double row[COST_N_COEF]) {
    row[0] = 1;
    row[1] = f->sequences;
    row[2] = f->kv_attended;
    row[3] = f->new_tokens;
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
    int use[COST_N_COEF] = {1, 1, 1, 1};
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

static const char *const COEF_KEYS[COST_N_COEF] = {"intercept_s", "per_sequence_s",
                                                   "per_kv_attended_s", "per_new_token_s"};

int cost_table_save(const cost_table_t *t, const char *path, char *why, size_t why_cap) {
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
    ok &= fit && cJSON_AddNumberToObject(fit, "samples", t->fit_samples) &&
          cJSON_AddNumberToObject(fit, "rel_rms", t->fit_rel_rms) &&
          cJSON_AddNumberToObject(fit, "max_rel", t->fit_max_rel) &&
          cJSON_AddItemToObject(o, "fit", fit);
    fit = NULL;
    char *text = ok ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    cJSON_Delete(step);
    cJSON_Delete(fit);
    FILE *f = text ? fopen(path, "w") : NULL;
    ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
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
    for (int k = 0; rc == 0 && k < COST_N_COEF; k++)
        rc = get_num(step, COEF_KEYS[k], &t->coef[k], path, why, why_cap);
    if (rc == 0)
        rc = get_num(o, "decode_s_per_image", &t->decode_s, path, why, why_cap);
    if (rc == 0)
        rc = get_num(o, "png_s_per_image", &t->png_s, path, why, why_cap);
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
