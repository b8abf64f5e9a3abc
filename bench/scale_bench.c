/* `make bench-scale`: images per second of a class-conditional next-scale
 * model at batch 1 and at a larger batch, measured side by side in one run.
 * A wave is B images of classes 0, 1, ... started together and stepped in
 * lockstep (one gen_step per scale over all of them, as the batcher does
 * when they arrive together), then decoded; the two batch sizes alternate
 * wave sets --reps times, and the medians are compared.
 *
 *   build/scale_bench --model DIR [--batch N] [--images N] [--reps N] [--threads N]
 *
 * Prints one line per batch size (median images/s, median seconds per wave
 * set, KV bytes per image) and the ratio of the larger batch to batch 1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/flags.h"
#include "engine/clock.h"
#include "engine/generate.h"
#include "engine/planner.h"

#define MAX_BATCH 256
#define MAX_REPS 64

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Runs `images` images in waves of `batch`; the seconds taken, or < 0. */
static double run_waves(model_t *m, kv_pool_t *pool, int batch, int images, uint8_t *rgb) {
    gen_request_t *reqs = calloc((size_t)batch, sizeof *reqs);
    gen_request_t **ptrs = calloc((size_t)batch, sizeof *ptrs);
    ar_error_t err = {{0}};
    const double t0 = clock_now_s();
    double took = -1;
    for (int done = 0; reqs && ptrs && done < images; done += batch) {
        const int n = images - done < batch ? images - done : batch;
        for (int i = 0; i < n; i++) {
            int cond, uncond, len;
            ptrs[i] = &reqs[i];
            if (model_prompt_from_class(m, (done + i) % m->cfg.condition.num_classes, &cond,
                                        &uncond, &len, &err) != AR_OK ||
                gen_request_init(&reqs[i], m, pool, NULL, &cond, &uncond, len, &m->cfg.sampling,
                                 (uint64_t)(done + i), 0, &err) != AR_OK)
                goto out;
        }
        while (!gen_request_done(&reqs[0]))
            if (gen_step(ptrs, n, &err) != AR_OK)
                goto out;
        for (int i = 0; i < n; i++) {
            if (gen_decode(&reqs[i], rgb, &err) != AR_OK)
                goto out;
            gen_request_free(&reqs[i]);
        }
    }
    took = clock_now_s() - t0;
out:
    if (took < 0)
        fprintf(stderr, "scale_bench: %s\n", err.msg);
    for (int i = 0; reqs && i < batch; i++)
        gen_request_free(&reqs[i]);
    free(reqs);
    free(ptrs);
    return took;
}

int main(int argc, char **argv) {
    const char *model_dir = NULL;
    long long batch = 16, images = 32, reps = 3, threads = 1;
    const cli_flag_t flags[] = {{"model", 0, CLI_STRING, &model_dir, .metavar = "DIR",
                                 .help = "a class-conditional next-scale model directory"},
                                {"batch", 0, CLI_INT, &batch, 2, MAX_BATCH, .metavar = "N",
                                 .help = "the batch compared with batch 1 (default 16)"},
                                {"images", 0, CLI_INT, &images, 1, 1 << 16, .metavar = "N",
                                 .help = "images per wave set, a multiple of --batch (default 32)"},
                                {"reps", 0, CLI_INT, &reps, 1, MAX_REPS, .metavar = "N",
                                 .help = "wave sets of each batch size, alternating (default 3)"},
                                {"threads", 0, CLI_INT, &threads, 0, 1024, .metavar = "N",
                                 .help = "CPU threads, 0 = every core (default 1)"},
                                {0}};
    int help = 0, rc = cli_flags_parse("scale_bench", flags, argc, argv, &help);
    if (rc || help) {
        if (help)
            cli_flags_usage(stdout, flags);
        return rc;
    }
    if (!model_dir || images % batch) {
        fprintf(stderr, "scale_bench: give --model, and --images a multiple of --batch\n");
        return 2;
    }
    ar_error_t err = {{0}};
    backend_t *be = backend_cpu_create((int)threads, &err);
    model_t m;
    if (!be || model_load(&m, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "scale_bench: %s\n", err.msg);
        return 1;
    }
    if (!model_is_class_conditional(&m)) {
        fprintf(stderr, "scale_bench: %s is not a class-conditional model\n", model_dir);
        return 2;
    }
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    planner_plan_t plan;
    kv_pool_t pool;
    const int bt = planner_block_tokens(&m.cfg);
    const size_t block = kv_pool_block_bytes(bt, m.cfg.llm.head_dim);
    uint8_t *rgb =
        malloc((size_t)model_config_image_height(&m.cfg) * model_config_image_width(&m.cfg) * 3);
    if (!rgb || planner_plan(&plan, &m.cfg, &full, 1, bt, NULL, &err) != AR_OK ||
        kv_pool_init(&pool, be, (int)(batch * (long long)(plan.peak_bytes / block)), bt,
                     m.cfg.llm.head_dim, &err) != AR_OK) {
        fprintf(stderr, "scale_bench: %s\n", err.msg[0] ? err.msg : "out of memory");
        return 1;
    }
    const double peak_mib = plan.peak_bytes / 1048576.0;
    planner_plan_free(&plan);
    const int sizes[2] = {1, (int)batch};
    double took[2][MAX_REPS];
    run_waves(&m, &pool, 1, 1, rgb); /* warm-up: workspaces, page faults */
    for (int r = 0; r < reps; r++)
        for (int s = 0; s < 2; s++)
            if ((took[s][r] = run_waves(&m, &pool, sizes[s], (int)images, rgb)) < 0)
                return 1;
    double ips[2];
    printf("%s: %lld images per wave set, %lld sets each, %lld thread(s), KV %.2f MiB per "
           "image (full cache)\n",
           m.cfg.name, images, reps, threads, peak_mib);
    for (int s = 0; s < 2; s++) {
        qsort(took[s], (size_t)reps, sizeof took[s][0], cmp_double);
        const double med = took[s][reps / 2];
        ips[s] = images / med;
        printf("batch %3d: %8.2f images/s (median %.2f s per set; min %.2f, max %.2f)\n", sizes[s],
               ips[s], med, took[s][0], took[s][reps - 1]);
    }
    printf("batch %d / batch 1: %.2fx\n", sizes[1], ips[1] / ips[0]);
    kv_pool_free(&pool);
    model_free(&m);
    free(rgb);
    be->destroy(be);
    return 0;
}
