/* Arrival processes, request mixes and traces for the load client and the
 * simulator. Random draws are Philox (base/rng.h) on fixed streams, so a
 * seed gives the same schedule and picks in bench and in simulate. */
#include "cli/loadgen.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/rng.h"

const char *const loadgen_arrival_names[] = {"poisson", "gamma", "burst", "concurrency", NULL};

/* Streams of the draws: one per purpose, so adding requests never shifts
 * another purpose's numbers. */
enum { STREAM_GAPS = 1, STREAM_GAMMA_NORMAL, STREAM_GAMMA_ACCEPT, STREAM_GAMMA_BOOST, STREAM_MIX };

/* A uniform in (0, 1): never 0, so logarithms stay finite. */
static double uniform_open(uint64_t seed, uint64_t stream, uint64_t ctr) {
    return 1.0 - rng_uniform(seed, stream, ctr);
}

/* A standard normal (Box-Muller) from the draws ctr*2 and ctr*2+1. */
static double normal(uint64_t seed, uint64_t ctr) {
    double u1 = uniform_open(seed, STREAM_GAMMA_NORMAL, 2 * ctr);
    double u2 = rng_uniform(seed, STREAM_GAMMA_NORMAL, 2 * ctr + 1);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Gamma(shape, 1) by Marsaglia and Tsang (2000), with the U^(1/shape)
 * boost below shape 1. *ctr counts the draws used. */
static double gamma_draw(double shape, uint64_t seed, uint64_t *ctr) {
    double boost = 1.0;
    if (shape < 1.0) {
        boost = pow(uniform_open(seed, STREAM_GAMMA_BOOST, *ctr), 1.0 / shape);
        shape += 1.0;
    }
    const double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        const uint64_t k = (*ctr)++;
        double x = normal(seed, k), v = 1.0 + c * x;
        if (v <= 0)
            continue;
        v = v * v * v;
        double u = uniform_open(seed, STREAM_GAMMA_ACCEPT, k);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v))
            return boost * d * v;
    }
}

void loadgen_schedule(loadgen_arrival_t a, double rate, double burstiness, uint64_t seed, double *t,
                      int n) {
    double now = 0;
    uint64_t ctr = 0;
    for (int i = 0; i < n; i++) {
        if (a == LOADGEN_POISSON)
            now += -log(uniform_open(seed, STREAM_GAPS, (uint64_t)i)) / rate;
        else if (a == LOADGEN_GAMMA)
            now += gamma_draw(burstiness, seed, &ctr) / (burstiness * rate);
        t[i] = a == LOADGEN_BURST ? 0.0 : now;
    }
}

/* ---- mixes ---- */

static int mix_add(loadgen_mix_t *m, cJSON *obj, const char *where, char *why, size_t why_cap) {
    if (!cJSON_IsObject(obj)) {
        snprintf(why, why_cap, "%s: not a JSON object", where);
        return -1;
    }
    double weight = 1.0;
    cJSON *w = cJSON_GetObjectItemCaseSensitive(obj, "weight");
    if (w) {
        if (!cJSON_IsNumber(w) || !(w->valuedouble > 0) || !isfinite(w->valuedouble)) {
            snprintf(why, why_cap, "%s: \"weight\" must be a number above 0", where);
            return -1;
        }
        weight = w->valuedouble;
        cJSON_DeleteItemFromObjectCaseSensitive(obj, "weight");
    }
    cJSON *prompt = cJSON_GetObjectItemCaseSensitive(obj, "prompt");
    cJSON *label = cJSON_GetObjectItemCaseSensitive(obj, "class_label");
    if (!prompt && !label) {
        snprintf(why, why_cap, "%s: a request needs \"prompt\" (or \"class_label\")", where);
        return -1;
    }
    loadgen_entry_t *grown = realloc(m->e, (size_t)(m->n + 1) * sizeof *grown);
    if (!grown) {
        snprintf(why, why_cap, "%s: out of memory", where);
        return -1;
    }
    m->e = grown;
    loadgen_entry_t *e = &m->e[m->n];
    *e = (loadgen_entry_t){.body = cJSON_PrintUnformatted(obj), .weight = weight};
    if (!e->body) {
        snprintf(why, why_cap, "%s: out of memory", where);
        return -1;
    }
    cJSON *pol = cJSON_GetObjectItemCaseSensitive(obj, "kv_policy");
    cJSON *bud = cJSON_GetObjectItemCaseSensitive(obj, "kv_budget");
    if (cJSON_IsString(pol) && cJSON_IsNumber(bud))
        snprintf(e->label, sizeof e->label, "%.40s@%g", pol->valuestring, bud->valuedouble);
    else if (cJSON_IsString(pol))
        snprintf(e->label, sizeof e->label, "%.40s", pol->valuestring);
    else
        snprintf(e->label, sizeof e->label, "default");
    m->n++;
    m->total_weight += weight;
    return 0;
}

int loadgen_mix_one(loadgen_mix_t *m, const char *body) {
    memset(m, 0, sizeof *m);
    char why[256];
    cJSON *obj = cJSON_Parse(body);
    int rc = obj ? mix_add(m, obj, "the request body", why, sizeof why) : -1;
    if (!obj)
        snprintf(why, sizeof why, "the request body is not valid JSON");
    cJSON_Delete(obj);
    if (rc)
        fprintf(stderr, "%s\n", why);
    return rc;
}

int loadgen_mix_read(loadgen_mix_t *m, const char *path) {
    memset(m, 0, sizeof *m);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: cannot open: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL, why[512], where[300];
    size_t cap = 0;
    int no = 0, rc = 0;
    while (rc == 0 && getline(&line, &cap, f) > 0) {
        no++;
        line[strcspn(line, "\r\n")] = 0;
        const char *p = line + strspn(line, " \t");
        if (!*p || *p == '#')
            continue;
        snprintf(where, sizeof where, "%.256s:%d", path, no);
        cJSON *obj = cJSON_Parse(p);
        if (!obj) {
            snprintf(why, sizeof why, "%s: not valid JSON", where);
            rc = -1;
        } else {
            rc = mix_add(m, obj, where, why, sizeof why);
        }
        cJSON_Delete(obj);
    }
    free(line);
    fclose(f);
    if (rc == 0 && m->n == 0) {
        snprintf(why, sizeof why, "%s: no requests (one JSON object per line)", path);
        rc = -1;
    }
    if (rc) {
        fprintf(stderr, "%s\n", why);
        loadgen_mix_free(m);
    }
    return rc;
}

void loadgen_mix_free(loadgen_mix_t *m) {
    for (int i = 0; i < m->n; i++)
        cJSON_free(m->e[i].body);
    free(m->e);
    memset(m, 0, sizeof *m);
}

int loadgen_mix_pick(const loadgen_mix_t *m, uint64_t seed, int i) {
    double x = rng_uniform(seed, STREAM_MIX, (uint64_t)i) * m->total_weight;
    for (int k = 0; k < m->n; k++) {
        x -= m->e[k].weight;
        if (x < 0)
            return k;
    }
    return m->n - 1;
}

/* ---- traces ---- */

static int cmp_item(const void *a, const void *b) {
    const loadgen_trace_item_t *x = a, *y = b;
    if (x->t != y->t)
        return (x->t > y->t) - (x->t < y->t);
    return (x->line > y->line) - (x->line < y->line);
}

int loadgen_trace_read(const char *path, loadgen_trace_item_t **items, int *n, loadgen_mix_t *mix) {
    memset(mix, 0, sizeof *mix);
    *items = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: cannot open: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL, why[512] = "", where[300];
    size_t cap = 0;
    int no = 0, rc = 0, n_cap = 0;
    while (rc == 0 && getline(&line, &cap, f) > 0) {
        no++;
        const char *p = line + strspn(line, " \t\r\n");
        if (!*p || *p == '#')
            continue;
        snprintf(where, sizeof where, "%.256s:%d", path, no);
        cJSON *o = cJSON_Parse(p);
        cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "t");
        cJSON *req = cJSON_GetObjectItemCaseSensitive(o, "request");
        cJSON *in = cJSON_GetObjectItemCaseSensitive(o, "input_tokens");
        if (!o || !cJSON_IsNumber(t) || !(t->valuedouble >= 0) || !cJSON_IsObject(req)) {
            snprintf(why, sizeof why,
                     "%s: a trace line is {\"t\": seconds >= 0, \"request\": {a request body}}",
                     where);
            rc = -1;
        }
        int entry = -1;
        char *body = rc == 0 ? cJSON_PrintUnformatted(req) : NULL;
        for (int k = 0; body && k < mix->n; k++)
            if (!strcmp(mix->e[k].body, body))
                entry = k;
        cJSON_free(body);
        if (rc == 0 && entry < 0) {
            cJSON *copy = cJSON_Duplicate(req, 1);
            rc = copy ? mix_add(mix, copy, where, why, sizeof why) : -1;
            cJSON_Delete(copy);
            entry = mix->n - 1;
        }
        if (rc == 0 && *n == n_cap) {
            n_cap = n_cap ? 2 * n_cap : 256;
            loadgen_trace_item_t *grown = realloc(*items, (size_t)n_cap * sizeof *grown);
            if (!grown) {
                snprintf(why, sizeof why, "%s: out of memory", where);
                rc = -1;
            } else {
                *items = grown;
            }
        }
        if (rc == 0)
            (*items)[(*n)++] = (loadgen_trace_item_t){
                .t = t->valuedouble,
                .entry = entry,
                .input_tokens =
                    cJSON_IsNumber(in) && in->valuedouble > 0 ? (int)in->valuedouble : 0,
                .line = no};
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    if (rc == 0 && *n == 0) {
        snprintf(why, sizeof why, "%s: no requests in the trace", path);
        rc = -1;
    }
    if (rc) {
        fprintf(stderr, "%s\n", why);
        free(*items);
        *items = NULL;
        *n = 0;
        loadgen_mix_free(mix);
        return -1;
    }
    qsort(*items, (size_t)*n, sizeof **items, cmp_item);
    return 0;
}
