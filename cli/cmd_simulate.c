/* `arserve simulate`: capacity without a backend. The engine's batcher and
 * KV planner (engine/batcher.h, engine/planner.h), the daemon's own, run
 * against a simulated clock: each iteration costs what the cost table
 * (engine/cost_model.h) says for its batch, finished images then cost their
 * decode on the drawing thread and their PNG on the first free worker, as
 * the daemon's scheduler does it (the drawing thread is taken to have a
 * core of its own: the engine's iterations do not slow while it draws), and each answer its
 * HTTP thread's time (the table's http_s, after the PNGs). Requests arrive from the
 * load client's generators or a trace (cli/load_spec.h) and are spread over replicas by least
 * outstanding requests (as deploy/nginx balances them); the report is the load client's, so the two
 * compare key by key. Requests are planned as the daemon plans them: the model's arserve.json (a
 * directory or a preset), its policies, the pool in whole blocks. Not simulated: plans tightening
 * while a request runs (HeadKV's and AMS-KV's, which need the attention itself), so a simulation's
 * admission is the daemon's at the start of each request, a little conservative for those policies.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/bench_report.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/load_spec.h"
#include "engine/batcher.h"
#include "engine/cost_model.h"
#include "engine/model_config.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "server/api.h"
#include "server/config.h"
#include "server/http.h"
#include "server/scheduler.h"

#define SIM_MAX_REPLICAS 64
#define SIM_DEFAULT_POOL_MB 1024 /* a replica's KV pool without --kv-pool-mb */
#define SIM_MAX_WORKERS 64

/* One request's job in a simulated replica. */
typedef struct sim_job {
    int rec;    /* its record */
    int client; /* closed loop: the client that sent it, else -1 */
    int n_images;
    int step; /* steps done */
    kv_geometry_t g;
    planner_plan_t plan; /* with a budget range, the admitted level's (the floor's before) */
    size_t *kv_bytes;    /* the plan times n_images */
    /* A budget range (kv_budget_min): its levels, as the daemon plans them
     * (sched_plan_range); level_kv[l] is level l's plan times n_images. */
    planner_levels_t lv;
    size_t *level_kv[PLANNER_MAX_LEVELS];
    /* Each step's cost features (all images): the floor's plan, and with a
     * range each level's, for admission by time (batcher.h). */
    cost_features_t *features, *level_features[PLANNER_MAX_LEVELS];
    double t_admitted, t_last_step;
} sim_job_t;

typedef struct replica {
    batcher_t *b;
    double t_free;    /* when its engine thread is next free */
    double draw_free; /* when its drawing thread is */
    double png_free[SIM_MAX_WORKERS];
    int outstanding; /* requests sent to it and not answered */
} replica_t;

typedef struct sim {
    /* settings */
    const model_config_t *cfg;
    const cost_table_t *costs;
    api_limits_t limits;
    int widths[1], heights[1];
    kv_policy_params_t kv_defaults;
    int n_replicas, png_workers, block_tokens, prompt_tokens;
    planner_kv_dtype_t dt; /* K and V as the pool counts them */
    size_t pool_bytes;
    batcher_options_t bo;
    FILE *timeline;
    /* one run */
    const load_spec_t *s;
    const char *label;
    bench_record_t *rec;
    int n;
    bench_pool_t *pool;
    replica_t r[SIM_MAX_REPLICAS];
    double step_cost; /* the iteration being stepped */
    int next_open;    /* open loop: the next request to arrive */
    int next_closed;  /* closed loop: the next request a client takes */
    double *client_ready;
    /* Budget ranges admitted in this run: their budgets summed, how many,
     * how many below their top. */
    double budget_sum;
    int budget_n, budget_below;
    double slo_s; /* the objective of requests without deadline_ms; 0: none */
    int regimes[BATCHER_REGIME_TIME + 1]; /* admissions in this run, by what decided them */
} sim_t;

static int sim_start(void *ctx, void *work, ar_error_t *err) {
    (void)ctx, (void)work, (void)err;
    return AR_OK;
}

/* An iteration: the batch's features priced by the cost table. */
static int sim_step(void *ctx, void *const *work, int n, size_t *kv_peak, ar_error_t *err) {
    sim_t *x = ctx;
    cost_features_t f = {0};
    for (int i = 0; i < n; i++) {
        sim_job_t *j = work[i];
        cost_features_add(&f, &j->g, &j->plan, j->step, j->n_images);
        j->step++;
    }
    x->step_cost = cost_step_seconds(x->costs, &f);
    *kv_peak = 0; /* nothing is held: the plan is the peak */
    (void)err;
    return AR_OK;
}

static void sim_stop(void *ctx, void *work) { (void)ctx, (void)work; }

static const batcher_ops_t SIM_OPS = {.start = sim_start, .step = sim_step, .stop = sim_stop};

static void job_free(sim_job_t *j) {
    if (!j)
        return;
    planner_plan_free(&j->plan);
    free(j->kv_bytes);
    free(j->features);
    for (int l = 0; l < j->lv.n; l++) {
        free(j->level_kv[l]);
        free(j->level_features[l]);
    }
    planner_levels_free(&j->lv);
    free(j);
}

/* An answer without images at time now. */
static void refuse(bench_record_t *rec, int status, const char *code, double now) {
    rec->status = status;
    snprintf(rec->code, sizeof rec->code, "%s", code);
    rec->sent = rec->done = fmax(now, 1e-9);
}

/* A refused submission, answered as the daemon answers it (http.h). */
static void refuse_as_daemon(const sim_t *x, bench_record_t *rec, sched_refusal_info_t *why,
                             int n_images, double now) {
    why->pool_bytes = x->pool_bytes;
    why->max_running = x->bo.max_running;
    why->max_waiting = x->bo.max_waiting;
    api_error_t e;
    http_refusal_error(why, n_images, 0, &e);
    refuse(rec, e.status, e.code, now);
}

/* Request i arrives at time t: parsed and planned as the daemon would,
 * then queued on the replica with the fewest outstanding requests. */
static void arrive(sim_t *x, int i, double t, int client) {
    bench_record_t *rec = &x->rec[i];
    const char *body = x->s->mix.e[rec->entry].body;
    rec->scheduled = t;
    rec->sent = t;
    api_image_request_t req;
    api_error_t aerr;
    if (api_parse_image_request(body, strlen(body), &x->limits, &req, &aerr) != AR_OK) {
        refuse(rec, aerr.status, aerr.code, t);
        return;
    }
    sim_job_t *j = calloc(1, sizeof *j);
    /* The prefix the daemon reported for it, else a next-scale model's
     * class token, else the typical prompt. */
    const int n_prompt = rec->input_tokens > 0              ? rec->input_tokens
                         : !strcmp(x->cfg->family, "scale") ? 1
                                                            : x->prompt_tokens;
    ar_error_t err = {{0}};
    sched_refusal_info_t why = {.reason = SCHED_REFUSED_INVALID_POLICY};
    double lo = 0;
    if (j && req.kv_budget_min != 0) {
        const double min = req.kv_budget_min < 0 ? SCHED_BUDGET_LEAST : req.kv_budget_min;
        if (sched_plan_range(x->cfg, &req.kv_policy, min, n_prompt, 0, x->block_tokens, x->dt,
                             &j->lv, &lo, &why) != AR_OK) {
            refuse_as_daemon(x, rec, &why, req.n, t);
            api_image_request_free(&req);
            free(j);
            return;
        }
        /* The floor's plan is the job's until it is admitted. */
        j->plan = j->lv.plans[j->lv.n - 1];
        j->lv.plans[j->lv.n - 1] = (planner_plan_t){0};
    } else if (!j || planner_plan_dtype(&j->plan, x->cfg, &req.kv_policy, n_prompt, x->block_tokens,
                                        x->dt, &why.field, &err) != AR_OK) {
        if (!j)
            why.reason = SCHED_REFUSED_NO_MEMORY;
        snprintf(why.message, sizeof why.message, "%.*s", (int)sizeof why.message - 1, err.msg);
        refuse_as_daemon(x, rec, &why, req.n, t);
        api_image_request_free(&req);
        free(j);
        return;
    }
    j->rec = i;
    j->client = client;
    j->n_images = req.n;
    model_geometry(x->cfg, n_prompt, &j->g);
    const double objective = req.deadline_ms > 0 ? req.deadline_ms / 1000.0 : x->slo_s;
    api_image_request_free(&req);
    j->kv_bytes = malloc((size_t)j->plan.steps * sizeof *j->kv_bytes);
    if (!j->kv_bytes || !(j->features = cost_plan_features(&j->g, &j->plan, j->n_images))) {
        refuse(rec, 500, "internal_error", t);
        job_free(j);
        return;
    }
    for (int s = 0; s < j->plan.steps; s++)
        j->kv_bytes[s] = j->plan.bytes[s] * (size_t)j->n_images;
    for (int l = 0; l < j->lv.n; l++) {
        const planner_plan_t *p = l == j->lv.n - 1 ? &j->plan : &j->lv.plans[l];
        if (!(j->level_kv[l] = malloc((size_t)p->steps * sizeof *j->level_kv[l]))) {
            refuse(rec, 500, "internal_error", t);
            job_free(j);
            return;
        }
        for (int s = 0; s < p->steps; s++)
            j->level_kv[l][s] = p->bytes[s] * (size_t)j->n_images;
        if (!(j->level_features[l] = cost_plan_features(&j->g, p, j->n_images))) {
            refuse(rec, 500, "internal_error", t);
            job_free(j);
            return;
        }
    }
    replica_t *best = &x->r[0];
    for (int k = 1; k < x->n_replicas; k++)
        if (x->r[k].outstanding < best->outstanding)
            best = &x->r[k];
    batcher_stats_t st;
    batcher_stats(best->b, &st);
    if (st.waiting + st.running == 0)
        best->t_free = fmax(best->t_free, t); /* an idle engine wakes at the submission */
    batcher_job_t bj = {.n_images = j->n_images,
                        .steps = j->plan.steps,
                        .kv_bytes = j->kv_bytes,
                        .n_levels = j->lv.n,
                        .level_kv_bytes = (const size_t *const *)j->level_kv,
                        .step_features = j->features,
                        .level_step_features =
                            j->lv.n > 0 ? (const cost_features_t *const *)j->level_features : NULL,
                        .deadline = INFINITY,
                        .target = objective > 0 ? t + objective : 0,
                        .submitted = t,
                        .work = j};
    /* As the daemon: what could not keep its objective even alone is refused. */
    const double alone = objective > 0 ? batcher_alone_seconds(best->b, &bj) : -1;
    if (alone > objective) {
        why = (sched_refusal_info_t){
            .reason = SCHED_REFUSED_OBJECTIVE, .predicted_s = alone, .objective_s = objective};
        refuse_as_daemon(x, rec, &why, j->n_images, t);
        job_free(j);
        return;
    }
    const batcher_refusal_t r = batcher_submit(best->b, &bj, NULL);
    if (r == BATCHER_ACCEPTED) {
        best->outstanding++;
        rec->input_tokens = n_prompt;
        return;
    }
    why = (sched_refusal_info_t){.reason = sched_refusal_of(r),
                                 .need_bytes = j->plan.peak_bytes * (size_t)j->n_images};
    refuse_as_daemon(x, rec, &why, j->n_images, t);
    job_free(j);
}

/* A closed-loop client whose answer came at t sends its next request then. */
static void client_answered(sim_t *x, int client, double t) {
    if (client >= 0)
        x->client_ready[client] = t;
}

/* The next arrival's time and request (INFINITY when none is left). */
static double next_arrival(const sim_t *x, int *client) {
    const load_spec_t *s = x->s;
    *client = -1;
    if (s->arrival == LOADGEN_CONCURRENCY && !s->trace) {
        if (x->next_closed >= x->n)
            return INFINITY;
        double best = INFINITY;
        for (int c = 0; c < s->concurrency; c++)
            if (x->client_ready[c] < best) {
                best = x->client_ready[c];
                *client = c;
            }
        return s->duration > 0 && best >= s->duration ? INFINITY : best;
    }
    if (x->next_open >= x->n)
        return INFINITY;
    const double t = x->rec[x->next_open].scheduled;
    return s->duration > 0 && t >= s->duration ? INFINITY : t;
}

/* Handles a replica's events at its time; finishing jobs cost their decode
 * on the drawing thread and their PNGs on the workers. at: when the events
 * happened (the iteration's admission or its step's end). */
static void handle_events(sim_t *x, replica_t *r, double at) {
    batcher_event_t ev[64];
    int n;
    while ((n = batcher_take_events(r->b, ev, 64)) > 0)
        for (int e = 0; e < n; e++) {
            sim_job_t *j = ev[e].work;
            bench_record_t *rec = &x->rec[j->rec];
            if (ev[e].type == BATCHER_ADMITTED) {
                const int l = ev[e].level;
                if (j->lv.n > 0 && l < j->lv.n - 1) { /* it runs at level l's plan */
                    planner_plan_free(&j->plan);
                    j->plan = j->lv.plans[l];
                    j->lv.plans[l] = (planner_plan_t){0};
                }
                if (j->lv.n > 0) {
                    x->budget_sum += j->lv.budgets[l];
                    x->budget_n++;
                    x->budget_below += l > 0;
                }
                j->t_admitted = at;
                rec->queue_s = at - rec->scheduled;
                x->regimes[ev[e].regime]++;
                continue;
            }
            if (ev[e].type == BATCHER_STEPPED) {
                if (ev[e].steps_done == j->plan.steps)
                    j->t_last_step = at;
                continue;
            }
            double done = at;
            if (ev[e].end == BATCHER_END_FINISHED) {
                for (int i = 0; i < j->n_images; i++) {
                    r->draw_free = fmax(r->draw_free, at) + x->costs->decode_s;
                    double *w = &r->png_free[0];
                    for (int k = 1; k < x->png_workers; k++)
                        if (r->png_free[k] < *w)
                            w = &r->png_free[k];
                    *w = fmax(*w, r->draw_free) + x->costs->png_s;
                    done = fmax(done, *w);
                }
                rec->status = 200;
                rec->images = j->n_images;
                rec->output_tokens = j->n_images * kv_geometry_image_tokens(&j->g);
                rec->steps = j->plan.steps;
                rec->run_s = j->t_last_step - j->t_admitted;
                rec->decode_png_s = done - j->t_last_step;
                done += x->costs->http_s; /* its HTTP thread: parsing, then the answer */
            } else {
                refuse(rec, 500, batcher_end_name(ev[e].end), done);
            }
            rec->done = done;
            r->outstanding--;
            client_answered(x, j->client, done);
            job_free(j);
        }
}

/* One iteration of replica r at its time. 0: nothing could run. */
static int iterate(sim_t *x, replica_t *r) {
    const int n = batcher_admit(r->b, r->t_free);
    handle_events(x, r, r->t_free);
    if (n == 0)
        return 0;
    ar_error_t err = {{0}};
    const int rc = batcher_step(r->b, &err);
    r->t_free += x->step_cost;
    batcher_finish(r->b, rc, &err);
    batcher_stats_t st;
    batcher_stats(r->b, &st);
    bench_pool_add(x->pool, (double)st.last_reserved_bytes, (double)st.last_reserved_bytes,
                   st.running + 0.0, st.waiting + 0.0);
    if (x->timeline)
        fprintf(x->timeline, "%s,%d,%.6f,%d,%d,%d,%zu\n", x->label, (int)(r - x->r), r->t_free,
                st.last_images, st.running, st.waiting, st.last_reserved_bytes);
    handle_events(x, r, r->t_free);
    return 1;
}

/* load_run_fn: the run on the simulated clock. */
static int sim_run(void *ctx, const load_spec_t *s, const char *label, double rate,
                   bench_record_t *rec, int n, bench_pool_t *pool) {
    sim_t *x = ctx;
    (void)rate;
    x->label = label;
    x->s = s;
    x->rec = rec;
    x->n = n;
    x->pool = pool;
    x->next_open = x->next_closed = 0;
    x->budget_sum = 0;
    x->budget_n = x->budget_below = 0;
    memset(x->regimes, 0, sizeof x->regimes);
    pool->capacity_bytes = (double)x->pool_bytes;
    free(x->client_ready);
    x->client_ready = calloc((size_t)s->concurrency, sizeof *x->client_ready);
    int rc = x->client_ready ? 0 : -1;
    for (int k = 0; rc == 0 && k < x->n_replicas; k++) {
        ar_error_t err = {{0}};
        x->r[k] = (replica_t){0};
        if (!(x->r[k].b = batcher_create(&x->bo, &SIM_OPS, x, &err))) {
            fprintf(stderr, "arserve simulate: %s\n", err.msg);
            rc = -1;
        } else { /* admission prices time by the table, as a daemon with one does */
            batcher_set_costs(x->r[k].b, x->costs);
        }
    }
    while (rc == 0) {
        int client;
        const double ta = next_arrival(x, &client);
        replica_t *busy = NULL;
        for (int k = 0; k < x->n_replicas; k++) {
            batcher_stats_t st;
            batcher_stats(x->r[k].b, &st);
            if (st.waiting + st.running > 0 && (!busy || x->r[k].t_free < busy->t_free))
                busy = &x->r[k];
        }
        if (ta < INFINITY && (!busy || ta <= busy->t_free)) {
            int i;
            if (client >= 0) {
                i = x->next_closed++;
                x->client_ready[client] = INFINITY; /* waiting for its answer */
            } else {
                i = x->next_open++;
            }
            arrive(x, i, ta, client);
            if (x->rec[i].done > 0) /* refused at once */
                client_answered(x, client, x->rec[i].done);
        } else if (busy) {
            if (!iterate(x, busy)) {
                fprintf(stderr, "arserve simulate: a replica holds requests it can never run "
                                "(a bug)\n");
                rc = -1;
            }
        } else {
            break;
        }
    }
    for (int k = 0; k < x->n_replicas; k++) {
        if (x->r[k].b)
            batcher_shutdown(x->r[k].b);
        batcher_event_t ev[64];
        int got;
        while (x->r[k].b && (got = batcher_take_events(x->r[k].b, ev, 64)) > 0)
            for (int e = 0; e < got; e++)
                job_free(ev[e].work);
        batcher_destroy(x->r[k].b);
        x->r[k].b = NULL;
    }
    if (x->budget_n > 0)
        printf("%s: %d requests with a budget range admitted at a mean budget of %.3f, %d below "
               "their top\n",
               label, x->budget_n, x->budget_sum / x->budget_n, x->budget_below);
    if (x->slo_s > 0 || x->regimes[BATCHER_REGIME_TIME] > 0)
        printf("%s: admissions by what decided them: %d free, %d memory, %d time\n", label,
               x->regimes[BATCHER_REGIME_FREE], x->regimes[BATCHER_REGIME_MEMORY],
               x->regimes[BATCHER_REGIME_TIME]);
    return rc;
}

static void simulate_usage(FILE *f, const cli_flag_t *flags) {
    fprintf(
        f, "usage: arserve simulate --model DIR_OR_PRESET --costs FILE [--replicas N]\n"
           "                        [--kv-pool-mb M] [--max-running N] [--max-waiting N]\n"
           "                        [--arrival KIND] [--rate R | --rates ..] [--trace FILE] ...\n\n"
           "Runs the daemon's batcher and KV planner on a simulated clock, an iteration costing\n"
           "what the cost table (`arserve bench --profile`, or one derived from a paper) says,\n"
           "and prints the report `arserve bench` prints, plus the pool and the admitted\n"
           "concurrency. Reads only the model's arserve.json.\n\n");
    cli_flags_usage(f, flags);
}

/* The simulated daemons as serve makes them: the pool in whole blocks of
 * pool_mb (K and V in dt, or serve's --kv-dtype auto when dt is unset), the
 * batcher's limits, the API's request limits. */
static void sim_setup(sim_t *x, const char *json, planner_kv_dtype_t dt, long long pool_mb,
                      long long max_running, long long max_waiting) {
    const model_config_t *cfg = x->cfg;
    x->block_tokens = planner_block_tokens(cfg);
    if (dt.k == DTYPE_U8) {
        const char *because;
        dt = planner_kv_same(cli_serve_kv_dtype(json, cfg, &because));
    }
    x->dt = dt;
    const size_t block =
        (size_t)x->block_tokens * cfg->llm.head_dim * (dtype_size(dt.k) + dtype_size(dt.v));
    x->pool_bytes = ((size_t)pool_mb << 20) / block * block;
    x->bo = (batcher_options_t){.pool_bytes = x->pool_bytes,
                                .max_running = (int)max_running,
                                .max_waiting = (int)max_waiting};
    kv_policy_defaults(&x->kv_defaults, KV_POLICY_FULL);
    x->kv_defaults.budget = 0; /* as the daemon's without kv_budget: each policy's own */
    model_config_kv_card(cfg, &x->kv_defaults);
    x->widths[0] = model_config_image_width(cfg);
    x->heights[0] = model_config_image_height(cfg);
    x->limits = (api_limits_t){.max_n = SCHED_MAX_IMAGES,
                               .n_sizes = 1,
                               .widths = x->widths,
                               .heights = x->heights,
                               .max_prompt_bytes = 1 << 20,
                               .codebook_size = cfg->image.codebook_size,
                               .num_classes = cfg->condition.num_classes,
                               .kv_defaults = &x->kv_defaults};
    kv_geometry_t g; /* what kv_policy "auto" runs, as the daemon finds it */
    model_geometry(cfg, 1, &g);
    x->limits.kv_auto = kv_policy_auto(&x->kv_defaults, &g);
}

/* What is simulated, before the runs. */
static void sim_print_setup(const sim_t *x, const char *json, const char *costs_path,
                            const char *calib_note) {
    printf("simulating %s (%s family) on %d replica%s: KV pool %.1f MiB each (K %s, V %s), "
           "max running %d, max waiting %d, %d PNG workers\n",
           json, x->cfg->family, x->n_replicas, x->n_replicas == 1 ? "" : "s",
           x->pool_bytes / 1048576.0, planner_kv_dtype_name(x->dt.k),
           planner_kv_dtype_name(x->dt.v), x->bo.max_running, x->bo.max_waiting, x->png_workers);
    const cost_table_t *costs = x->costs;
    if (costs->fit_samples > 0)
        printf("cost table %s: %s (fit over %d iterations: relative RMS error %.1f%%)\n",
               costs_path, costs->source, costs->fit_samples, 100 * costs->fit_rel_rms);
    else
        printf("cost table %s (derived, not fitted): %s\n", costs_path, costs->source);
    if (calib_note)
        printf("heatkv and scalekv calibration: %s\n", calib_note);
    fflush(stdout);
}

int cmd_simulate(int argc, char **argv, char **envp) {
    server_config_t d;
    server_config_defaults(&d);
    const char *model_arg = NULL, *costs_path = NULL, *timeline_path = NULL;
    /* serve sizes an auto pool from its machine; a simulation has none */
    long long replicas = 1, pool_mb = d.kv_pool_mb ? d.kv_pool_mb : SIM_DEFAULT_POOL_MB,
              max_running = d.max_running, max_waiting = d.max_waiting, png_workers = d.png_workers,
              prompt_tokens = 18, slo_ms = 0;
    int help = 0;
    planner_kv_dtype_t dt = {DTYPE_U8, DTYPE_U8}; /* unset: serve's */
    load_spec_t spec;
    load_spec_defaults(&spec);
    cli_flag_t flags[LOAD_N_FLAGS + 16] = {
        {"model", 0, CLI_STRING, &model_arg, .metavar = "DIR_OR_PRESET",
         .help = "the model's directory or a preset (config/presets); only arserve.json is read "
                 "(required)"},
        {"costs", 0, CLI_STRING, &costs_path, .metavar = "FILE",
         .help = "the cost table: `arserve bench --profile` writes one (required)"},
        {"replicas", 0, CLI_INT, &replicas, 1, SIM_MAX_REPLICAS, .metavar = "N",
         .help = "daemons behind a least-connections balancer (default 1)"},
        {"kv-pool-mb", 0, CLI_INT, &pool_mb, 1, 1 << 24, .metavar = "M",
         .help = "each replica's KV pool, as serve's --kv-pool-mb (default 1024)"},
        {"max-running", 0, CLI_INT, &max_running, 1, 1 << 20, .metavar = "N",
         .help = "as serve's --max-running (default serve's)"},
        {"max-waiting", 0, CLI_INT, &max_waiting, 0, 1 << 20, .metavar = "N",
         .help = "as serve's --max-waiting (default serve's)"},
        {"png-workers", 0, CLI_INT, &png_workers, 1, SIM_MAX_WORKERS, .metavar = "N",
         .help = "as serve's --png-workers (default serve's)"},
        {"prompt-tokens", 0, CLI_INT, &prompt_tokens, 1, MODEL_MAX_PROMPT_TOKENS, .metavar = "N",
         .help = "condition prefix of a request whose trace line does not give input_tokens "
                 "(default 18: a 16-token prompt)"},
        {"kv-dtype", 0, CLI_EACH, &dt, .each = cli_parse_kv_dtype, .metavar = "K,V",
         .help = "element types the pool counts K and V in, each f32, bf16, f16 or fp8 (one "
                 "value: both); default: what `serve --kv-dtype auto` stores (the weights' type; "
                 "bf16 for a preset). A projection of a paper's GPU runs takes the paper's (bf16 "
                 "for Janus, f32,bf16 for VAR and Infinity)"},
        {"slo-p99-ms", 0, CLI_INT, &slo_ms, 0, 86400000, .metavar = "MS",
         .help = "as serve's --slo-p99-ms: the latency objective of requests without "
                 "deadline_ms, kept by admission through the cost table (default 0: none)"},
        {"timeline", 0, CLI_STRING, &timeline_path, .metavar = "FILE",
         .help = "CSV of every iteration: run, replica, time, images stepped, running, waiting, "
                 "KV reserved bytes"},
    };
    if (load_flags(flags, (int)(sizeof flags / sizeof *flags), &spec) != 0) {
        fprintf(stderr, "arserve simulate: its flag table is too small (a bug)\n");
        return 1;
    }
    int rc = cli_flags_parse("simulate", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help || !model_arg || !costs_path) {
        simulate_usage(help ? stdout : stderr, flags);
        return help ? 0 : 2;
    }
    char json[4096 + 16], why[512];
    model_config_t cfg;
    kv_calibration_set_t calib;
    const char *calib_note;
    if ((rc =
             cli_model_config("simulate", model_arg, json, sizeof json, &cfg, &calib, &calib_note)))
        return rc;
    cost_table_t costs;
    if (cost_table_load(&costs, costs_path, why, sizeof why)) {
        fprintf(stderr, "arserve simulate: --costs: %s\n", why);
        rc = 2;
    } else if (strcmp(costs.family, cfg.family) != 0) {
        fprintf(stderr, "arserve simulate: --costs %s is for the %s family; %s is a %s model\n",
                costs_path, costs.family, json, cfg.family);
        rc = 2;
    } else
        rc = load_spec_finish(&spec, "simulate");
    if (rc) {
        kv_calibration_set_free(&calib);
        return rc;
    }
    sim_t x = {.cfg = &cfg,
               .costs = &costs,
               .n_replicas = (int)replicas,
               .png_workers = (int)png_workers,
               .prompt_tokens = (int)prompt_tokens,
               .slo_s = slo_ms / 1000.0};
    sim_setup(&x, json, dt, pool_mb, max_running, max_waiting);
    if (timeline_path && !(x.timeline = fopen(timeline_path, "w"))) {
        fprintf(stderr, "arserve simulate: --timeline %s: cannot write\n", timeline_path);
        rc = 1;
    }
    if (x.timeline)
        fprintf(x.timeline, "run,replica,t,images_stepped,running,waiting,kv_reserved_bytes\n");
    if (rc == 0) {
        sim_print_setup(&x, json, costs_path, calib_note);
        rc = load_sweep(&spec, "simulate", sim_run, &x);
    }
    if (x.timeline)
        fclose(x.timeline);
    free(x.client_ready);
    load_spec_free(&spec);
    kv_calibration_set_free(&calib);
    (void)envp;
    return rc;
}
