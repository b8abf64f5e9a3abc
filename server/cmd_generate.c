/* `arserve generate`: one image from a prompt to a PNG file, with a progress
 * bar on a terminal and a one-line summary. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "engine/backend.h"
#include "engine/clock.h"
#include "engine/generate.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/png_io.h"
#include "server/backend_open.h"

static void generate_usage(FILE *f) {
    fprintf(f,
            "usage: arserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
            "\n"
            "  --model DIR          model directory (arserve.json, weights, tokenizer.json);\n"
            "                       default: $ARSERVE_MODEL, else the shipped demo model,\n"
            "                       ../models/shapes or models/shapes from arserve's folder\n"
            "  --prompt TEXT        prompt text, through the model's tokenizer and template\n"
            "  --prompt-ids LIST    comma-separated token ids of the templated prompt, bypassing\n"
            "                       the tokenizer (BOS and image-start are still added)\n"
            "  --seed N             RNG seed (default 0)\n"
            "  --cfg W              classifier-free guidance weight (model default)\n"
            "  --temperature T      sampling temperature, 0 = greedy (model default)\n"
            "  --top-k K            keep the K most likely tokens, 0 = off, 1 = greedy\n"
            "  --top-p P            nucleus sampling mass in (0, 1], 1 = off\n"
            "  --threads N          CPU threads, 0 = all cores (default 0)\n"
            "  --backend NAME       cpu, cuda, or auto: cuda when built in (make CUDA=1) and a\n"
            "                       GPU is present, else cpu (default auto)\n"
            "  -o, --output FILE    PNG to write (default out.png)\n"
            "  -q, --quiet          no progress bar and no summary\n");
}

static void progress(int done, int total, double elapsed) {
    int width = 30, filled = total ? done * width / total : width;
    fprintf(stderr, "\r[%.*s%*s] %d/%d tokens %.1fs", filled, "##############################",
            width - filled, "", done, total, elapsed);
    if (done == total)
        fputc('\n', stderr);
    fflush(stderr);
}

/* Parses "1,2,3" into ids; returns the count or -1. */
static int parse_ids(const char *s, int *ids, int cap) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char tok[32];
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof tok || n >= cap) {
            fprintf(stderr, "arserve: --prompt-ids: expected comma-separated integers, got '%s'\n",
                    s);
            return -1;
        }
        memcpy(tok, p, len);
        tok[len] = 0;
        long long v;
        if (cli_parse_int("--prompt-ids", tok, 0, 1 << 30, &v))
            return -1;
        ids[n++] = (int)v;
        p += len;
        if (*p == ',')
            p++;
    }
    if (n == 0) {
        fprintf(stderr, "arserve: --prompt-ids: empty list\n");
        return -1;
    }
    return n;
}

/* A KV pool that holds exactly one full-cache image: the peak of its
 * planned trajectory, in blocks of the size the daemon would choose. */
static int pool_for_one_image(kv_pool_t *pool, model_t *m, int n_prompt, ar_error_t *err) {
    const model_config_t *c = &m->cfg;
    const int steps = planner_steps(c);
    const int bt = planner_block_tokens(c);
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    size_t *bytes = malloc((size_t)steps * sizeof *bytes), peak = 0;
    if (!bytes)
        return ar_errorf(err, "out of memory");
    if (planner_trajectory_bytes(c, &full, n_prompt, bt, bytes, err) != AR_OK) {
        free(bytes);
        return AR_ERR;
    }
    for (int t = 0; t < steps; t++)
        peak = bytes[t] > peak ? bytes[t] : peak;
    free(bytes);
    return kv_pool_init(pool, m->be, (int)(peak / kv_pool_block_bytes(bt, c->llm.head_dim)), bt,
                        c->llm.head_dim, err);
}

int cmd_generate(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"prompt", required_argument, 0, 'p'},
                                         {"prompt-ids", required_argument, 0, 'i'},
                                         {"seed", required_argument, 0, 's'},
                                         {"cfg", required_argument, 0, 'c'},
                                         {"temperature", required_argument, 0, 't'},
                                         {"top-k", required_argument, 0, 'k'},
                                         {"top-p", required_argument, 0, 'P'},
                                         {"threads", required_argument, 0, 'j'},
                                         {"output", required_argument, 0, 'o'},
                                         {"quiet", no_argument, 0, 'q'},
                                         {"help", no_argument, 0, 'h'},
                                         {"backend", required_argument, 0, 'b'},
                                         {0, 0, 0, 0}};
    const char *model_dir = NULL, *prompt = NULL, *prompt_ids = NULL, *out_path = "out.png";
    const char *backend_name = "auto";
    long long seed = 0, top_k = -1, threads = 0;
    double cfg_w = -1, temperature = -1, top_p = -1;
    int quiet = 0, c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:qh", opts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case 'm':
            model_dir = optarg;
            break;
        case 'p':
            prompt = optarg;
            break;
        case 'i':
            prompt_ids = optarg;
            break;
        case 's':
            bad = cli_parse_int("--seed", optarg, 0, INT64_MAX, &seed);
            break;
        case 'c':
            bad = cli_parse_float("--cfg", optarg, 0, 100, &cfg_w);
            break;
        case 't':
            bad = cli_parse_float("--temperature", optarg, 0, 100, &temperature);
            break;
        case 'k':
            bad = cli_parse_int("--top-k", optarg, 0, 1 << 20, &top_k);
            break;
        case 'P':
            bad = cli_parse_float("--top-p", optarg, 1e-6, 1, &top_p);
            break;
        case 'j':
            bad = cli_parse_int("--threads", optarg, 0, 1024, &threads);
            break;
        case 'o':
            out_path = optarg;
            break;
        case 'b':
            backend_name = optarg;
            break;
        case 'q':
            quiet = 1;
            break;
        case 'h':
            generate_usage(stdout);
            return 0;
        default:
            generate_usage(stderr);
            return 2;
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "arserve: generate: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!prompt == !prompt_ids) {
        fprintf(stderr, "arserve: generate: give exactly one of --prompt and --prompt-ids\n");
        return 2;
    }
    if (prompt && !prompt[0]) {
        fprintf(stderr, "arserve: generate: --prompt is empty\n");
        return 2;
    }

    char default_dir[1024];
    if (!model_dir) {
        if (cli_default_model(default_dir, sizeof default_dir))
            return 1;
        model_dir = default_dir;
    }

    ar_error_t err = {{0}};
    int rc = 1;
    backend_t *be = backend_open(backend_name, (int)threads, &err);
    if (!be) {
        fprintf(stderr, "arserve: %s\n", err.msg);
        return 1;
    }
    model_t model;
    gen_request_t req = {0};
    kv_pool_t pool = {0};
    uint8_t *rgb = NULL;
    int *cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *ids = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int n_prompt = 0, loaded = 0;
    if (!cond || !uncond || !ids) {
        fprintf(stderr, "arserve: out of memory\n");
        goto out;
    }
    double t0 = clock_now_s();
    if (model_load(&model, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "arserve: cannot load model: %s\n", err.msg);
        goto out;
    }
    loaded = 1;
    sampler_params_t sp = model.cfg.sampling;
    if (cfg_w >= 0)
        sp.cfg = (float)cfg_w;
    if (temperature >= 0)
        sp.temperature = (float)temperature;
    if (top_k >= 0)
        sp.top_k = (int)top_k;
    if (top_p >= 0)
        sp.top_p = (float)top_p;
    if (prompt_ids) {
        int n = parse_ids(prompt_ids, ids, MODEL_MAX_PROMPT_TOKENS - 2);
        if (n < 0) {
            rc = 2;
            goto out;
        }
        if (model_prompt_from_ids(&model, ids, n, cond, uncond, &n_prompt, &err) != AR_OK) {
            fprintf(stderr, "arserve: --prompt-ids: %s\n", err.msg);
            rc = 2;
            goto out;
        }
    } else if (model_prompt_from_text(&model, prompt, cond, uncond, &n_prompt, &err) != AR_OK) {
        fprintf(stderr, "arserve: --prompt: %s\n", err.msg);
        rc = 2;
        goto out;
    }
    if (pool_for_one_image(&pool, &model, n_prompt, &err) != AR_OK ||
        gen_request_init(&req, &model, &pool, NULL, cond, uncond, n_prompt, &sp, (uint64_t)seed, 0,
                         &err)) {
        fprintf(stderr, "arserve: %s\n", err.msg);
        goto out;
    }
    double t1 = clock_now_s();
    int show = !quiet && isatty(STDERR_FILENO);
    gen_request_t *batch[1] = {&req};
    while (!gen_request_done(&req)) {
        if (gen_step(batch, 1, &err) != AR_OK) {
            fprintf(stderr, "arserve: %s\n", err.msg);
            goto out;
        }
        if (show && (req.step % 8 == 0 || gen_request_done(&req)))
            progress(req.step, req.n_steps, clock_now_s() - t1);
    }
    int H = model_config_image_height(&model.cfg), W = model_config_image_width(&model.cfg);
    rgb = malloc((size_t)H * W * 3);
    if (!rgb) {
        fprintf(stderr, "arserve: out of memory\n");
        goto out;
    }
    if (gen_decode(&req, rgb, &err) != AR_OK ||
        png_write_file(out_path, rgb, W, H, &err) != AR_OK) {
        fprintf(stderr, "arserve: %s\n", err.msg);
        goto out;
    }
    double t2 = clock_now_s();
    if (!quiet)
        fprintf(stderr,
                "%s: %dx%d, %d prompt tokens, %d steps in %.2f s (%.1f tokens/s, %.3f images/s; "
                "model load %.2f s)\n",
                out_path, W, H, n_prompt, req.n_steps, t2 - t1, req.n_steps / (t2 - t1),
                1.0 / (t2 - t1), t1 - t0);
    rc = 0;
out:
    gen_request_free(&req);
    kv_pool_free(&pool);
    if (loaded)
        model_free(&model);
    free(rgb);
    free(cond);
    free(uncond);
    free(ids);
    be->destroy(be);
    return rc;
}
