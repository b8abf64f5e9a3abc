/* The JSON half of arserve's OpenAI-compatible HTTP API: validates
 * `POST /v1/images/generations` bodies into a request struct, and builds the
 * response, error, model-list and Server-Sent-Event payloads. No networking. */
#ifndef ARSERVE_API_H
#define ARSERVE_API_H

#include "base/status.h"
#include "engine/policy/kv_policy.h"
#include "engine/sampler.h"

#include <stddef.h>
#include <stdint.h>

/* Deepest nesting of arrays and objects a request body may have (the body
 * object itself is level 1). cJSON's own cap is 1000 and compiled in, so this
 * is checked by a lexical scan before cJSON sees the body. */
#define API_MAX_JSON_DEPTH 16

/* Largest seed accepted: 2^53 - 1. Every integer up to 2^53 is exact in a
 * double, but 2^53 + 1 parses to 2^53, so allowing 2^53 itself would accept
 * a seed the client did not send. */
#define API_MAX_SEED 9007199254740991.0
/* Previews a streamed image may ask for (OpenAI's partial_images range). */
#define API_MAX_PARTIAL_IMAGES 3

/* An error as the API reports it. status is the HTTP status; type is
 * "invalid_request_error" (4xx) or "server_error" (5xx); param is the request
 * field at fault, or "" when none (api_error_json writes null); code is one of
 *   invalid_json               body is empty, not UTF-8, nested deeper than
 *                              API_MAX_JSON_DEPTH, not JSON, or not an object
 *   unknown_parameter          a field arserve does not know
 *   duplicate_parameter        a field given twice
 *   missing_required_parameter prompt absent or null
 *   invalid_type               a value of the wrong JSON type, or a number
 *                              with a fraction where an integer is meant
 *   invalid_value              a value out of range or not in the allowed set
 *   unsupported_value          an OpenAI value arserve does not implement
 *                              (response_format "url", output_format "jpeg")
 *   model_not_found            model is not the served one (status 404)
 *   out_of_memory, invalid_limits  (status 500)
 * message is one sentence naming the field and what is allowed. Strings are
 * truncated, never mid UTF-8 sequence. */
typedef struct api_error {
    int status;
    char message[512];
    char type[48];
    char param[48];
    char code[48];
} api_error_t;

/* Fills *err (may be NULL): the status, type from the status
 * ("server_error" from 500 on, else "invalid_request_error"), param and
 * code ("" or NULL for none) and the formatted message, each cut at a
 * character boundary. Returns AR_ERR. */
int api_errorf(api_error_t *err, int status, const char *param, const char *code, const char *fmt,
               ...) __attribute__((format(printf, 5, 6)));

/* What the served model accepts; owned by the caller and read only. */
typedef struct api_limits {
    const char *model_name; /* the served model's id; NULL accepts any `model` */
    /* Every name `model` may give, comma-separated (model_name among them);
     * NULL or "": model_name alone. */
    const char *model_names;
    int max_n;                   /* images per request, >= 1 */
    int n_sizes;                 /* >= 1; "auto" means the first size */
    const int *widths, *heights; /* the sizes the model produces */
    size_t max_prompt_bytes;     /* >= 1 */
    int codebook_size;           /* top_k upper bound */
    /* 1 when the model takes a negative_prompt (an arserve extension, as
     * stable-diffusion.cpp's): Infinity, whose unconditional row is then the
     * negative prompt's text instead of its learned rows. */
    int negative_prompt;
    /* Class-conditional models (the scale family): num_classes > 0, and
     * class_names (num_classes names, or NULL when the model has none).
     * Requests then give class_label (an index or a name) or a prompt that
     * names a class; 0 for prompt models, which refuse class_label. */
    int num_classes;
    const char *const *class_names;
    /* The daemon's KV defaults (config keys kv_policy, kv_budget and every
     * knob): kind is the policy of requests without `kv_policy`, budget 0
     * means each policy's own. NULL: full, and the papers' knobs. */
    const kv_policy_params_t *kv_defaults;
    /* The budget range each policy runs with for requests that give
     * neither kv_budget nor kv_budget_min (kv_ranges[kind]; config
     * kv_budget_ranges and kv_budget_min); NULL or min 0: none. */
    const kv_budget_range_t *kv_ranges;
    /* The policy `kv_policy: "auto"` names (kv_policy_auto on the served
     * model); full (0) or -1 when the model has none (auto is refused). */
    int kv_auto;
} api_limits_t;

/* A validated request. Fields the client left out (or sent as null) keep the
 * defaults below and their has_* flag 0, so the engine's model defaults apply. */
typedef struct api_image_request {
    char *prompt;          /* malloc'd, non-empty, <= max_prompt_bytes, valid UTF-8, no NUL;
                              NULL when a class-conditional request gives class_label */
    char *negative_prompt; /* the same rules, or NULL (only where limits allow one) */
    int has_class;
    int class_label;   /* 0..num_classes-1: class_label as given, or its name looked up */
    int n;             /* 1..max_n, default 1 */
    int width, height; /* one of the allowed sizes, default the first */
    int want_b64;      /* always 1: "b64_json" is the only format served */
    int stream;        /* default 0 */
    int async; /* default 0; 1: answered at once (202) with a job to poll; never with stream */
    int partial_images; /* 0..API_MAX_PARTIAL_IMAGES, default 0; only meaningful with stream */
    int has_seed;
    uint64_t seed; /* 0..API_MAX_SEED */
    int has_guidance_scale, has_temperature, has_top_k, has_top_p;
    float guidance_scale; /* 0..100 */
    float temperature;    /* 0..100; 0 is greedy */
    float top_p;          /* (0, 1]; 1 is off */
    int top_k;            /* 0..codebook_size; 0 is off */
    /* What the request said about its KV policy (kv_policy, kv_budget and
     * the knobs, each a request field named as in KV_POLICY_KNOBS), and
     * the policy it runs with: that, resolved against lim->kv_defaults. */
    kv_policy_overrides_t kv;
    kv_policy_params_t kv_policy;
    /* Elastic budgets (an arserve extension): kv_budget_min, the least
     * budget of a range up to kv_policy.budget; 0: none (the budget is
     * fixed); API_BUDGET_LEAST: from the least the policy takes on the
     * request (kv_policy "auto" without kv_budget_min). Whether the least
     * suits the request is the scheduler's check. */
    double kv_budget_min;
    /* The request's latency objective (an arserve extension), ms from its
     * arrival to its images; 0: the server's slo_p99_ms. */
    double deadline_ms;
    int kv_auto;    /* kv_policy was "auto" */
    char user[128]; /* "" when not given; at most 127 bytes */
} api_image_request_t;

#define API_BUDGET_LEAST (-1.0)

/* Validates a request body of len bytes (need not be NUL-terminated) against
 * lim. AR_OK with *out filled (free it with api_image_request_free), or AR_ERR
 * with *err filled and *out holding nothing to free. Checks, in this order:
 *   1. a lexical scan of the raw bytes: not empty, valid UTF-8 (RFC 8259 8.1;
 *      so every string field is valid UTF-8 too), no raw control characters
 *      (JSON allows only space, tab, CR, LF between tokens and none inside
 *      strings; cJSON would take them as whitespace), no \u0000 escapes (cJSON
 *      would cut the string there), nesting at most API_MAX_JSON_DEPTH;
 *   2. the strict RFC 8259 check (engine/format/json_strict.h: no 01, 1., trailing
 *      commas or data after the value), then cJSON's parse; a number longer
 *      than cJSON reads (JSON_STRICT_MAX_NUMBER_CHARS) is read as its
 *      nearest double first, so its field's range check names it in step 4;
 *   3. the value is an object;
 *   4. its members in document order: duplicates, unknown names, types,
 *      ranges (a KV knob's as KV_POLICY_KNOBS gives); the first fault is
 *      reported;
 *   5. prompt present (for a class-conditional model: prompt or class_label,
 *      not both; a prompt there must be a class name, the engine's check);
 *   6. the KV policy resolved (kv_policy_resolve against lim->kv_defaults):
 *      a knob given for another policy than the request's (`kv_policy`,
 *      else the daemon's default) is a 400 naming the knob. Whether the
 *      values suit the model (a budget too small for the knobs) is the
 *      scheduler's check, when it plans the request;
 *   7. a budget range: kv_budget_min on a policy that takes no budget, or
 *      above the range's top (kv_budget, else the policy's budget), is a
 *      400 naming kv_budget_min. kv_policy "auto" is lim->kv_auto with the
 *      range [its least, 1] where kv_budget_min and kv_budget are not
 *      given.
 * Thread-safe apart from cJSON's global error pointer, which cJSON writes on
 * every failed parse and arserve never reads. Cost O(len). */
int api_parse_image_request(const char *body, size_t len, const api_limits_t *lim,
                            api_image_request_t *out, api_error_t *err);

/* Frees the prompt and zeroes *r; safe on a zeroed or already-freed request. */
void api_image_request_free(api_image_request_t *r);

/* Copies the sampling fields the client gave (guidance_scale -> cfg,
 * temperature, top_k, top_p) over the model's defaults into *out. */
void api_image_request_sampler_params(const api_image_request_t *r,
                                      const sampler_params_t *defaults, sampler_params_t *out);

/* Every builder below returns malloc'd NUL-terminated JSON text without
 * newlines (cJSON_PrintUnformatted, so strings are escaped), which the caller
 * frees; NULL only when memory runs out or an argument is NULL or negative.
 * b64 arguments are copied into the text, not retained. */

/* {"error": {"message", "type", "param", "code"}}; an empty param or code is
 * written as null. Streams report a late error with this payload as the SSE
 * event "error": the openai client raises it as an APIError. */
char *api_error_json(const api_error_t *e);

/* The Images API response:
 *   {"created": created, "data": [{"b64_json": ...}, ...n],
 *    "output_format": "png", "size": "WxH",
 *    "usage": {"input_tokens": prompt_tokens, "output_tokens": image_tokens,
 *              "total_tokens": their sum,
 *              "input_tokens_details": {"text_tokens": prompt_tokens, "image_tokens": 0}}}
 * as openai-python's ImagesResponse and Usage name them. image_tokens is the
 * total over all n images; prompt_tokens counts the prompt once (what the
 * client sent, not the CFG rows arserve adds). OpenAI's optional `background`
 * and `quality` are left out: arserve has neither setting. With kv (may be
 * NULL), an arserve extension follows:
 *   "kv_cache": {"policy": "linear", "budget": 0.25, "anchor_lines": 1,
 *                "recent_lines": 2, "planned_peak_bytes": P, "peak_bytes": M}
 * the policy the request ran with, its budget and knobs (full has none;
 * with a budget range, the budget it was admitted at, and "budget_range":
 * [least, most] follows it),
 * the planner's peak KV bytes of one image (its CFG pair) and the most one
 * of its images measured. */
typedef struct api_kv_report {
    kv_policy_params_t policy;
    size_t planned_peak_bytes, peak_bytes;
    double budget_min, budget_max; /* a budget range: "budget_range": [min, max]; 0: none */
    /* "admission": what decided its admission ("free", "memory", "time"),
     * and "predicted_s", its predicted seconds when admission priced time;
     * NULL, 0: not said. */
    const char *admission;
    double predicted_s;
} api_kv_report_t;
/* With timings (may be NULL), another extension follows, for load clients
 * (`arserve bench`) to split a request's latency:
 *   "timings": {"queue_s": Q, "run_s": R, "steps": S, "decode_png_s": D}
 * seconds waiting for admission, from admission to the last of its S
 * steps, and from there to its last PNG (decoding and encoding). */
typedef struct api_timings {
    double queue_s, run_s, decode_png_s;
    int steps;
} api_timings_t;
/* With warnings (NULL or "": none), one per line, the arserve extension
 *   "warnings": ["prompt: 2 words the model does not know ...", ...]
 * follows: what the request asked that the model could not follow, though
 * it drew an image (model_prompt_warning). */
char *api_images_response_json(long created, int n, const char *const *b64_pngs, int width,
                               int height, int image_tokens, int prompt_tokens,
                               const api_kv_report_t *kv, const api_timings_t *timings,
                               const char *warnings);

/* An async job as GET /v1/images/jobs/ID (and the 202 that accepted it)
 * shows it, after the job object of stable-diffusion.cpp's server
 * (examples/server, GET /sdcpp/v1/jobs/{id}):
 *   {"id": "job_...", "object": "image.generation.job",
 *    "status": "queued" | "running" | "done" | "failed" | "cancelled" | "expired",
 *    "created": T, "started": T or null, "completed": T or null (Unix seconds),
 *    "queue_position": P (1 = next to start; 0 once not queued),
 *    "progress": {"steps_done": d, "steps_total": t},
 *    "poll_url": "/v1/images/jobs/job_...",
 *    "result": null, or when done the synchronous response's object
 *              (api_images_response_json: created, data, usage, kv_cache, ...),
 *    "error": null, or the error object of api_error_json (its "error"
 *             member) when failed, cancelled or expired}
 * b64_pngs etc. are read only when status is "done" (n images). */
typedef struct api_job_report {
    const char *id, *status, *poll_url;
    long created, started, completed; /* 0: null */
    int queue_position, steps_done, steps_total;
    const api_error_t *error; /* NULL: null */
    /* The result, when done: */
    int n;
    const char *const *b64_pngs;
    int width, height, image_tokens, prompt_tokens;
    const api_kv_report_t *kv;
    const api_timings_t *timings;
    const char *warnings;
} api_job_report_t;
char *api_job_json(const api_job_report_t *job);
/* DELETE's answer on an ended job: {"id", "object": "image.generation.job",
 * "status", "deleted": deleted (0: another request forgot it first)}. */
char *api_job_deleted_json(const char *id, const char *status, int deleted);

/* What GET /v1/models tells of the served model beyond OpenAI's fields:
 * what a client needs to build a request form (the playground page does). */
typedef struct api_model_card {
    long created;
    const char *family;        /* arserve.json "family": "raster" or "scale" */
    const char *segment_name;  /* "line" or "scale" */
    const kv_geometry_t *geom; /* the shortest request's geometry (calibration included) */
    /* The same at each of lim's sizes, in their order (geom's is the first),
     * or NULL for one size: where a policy that needs a per-size calibration
     * runs. */
    const kv_geometry_t *size_geoms;
    sampler_params_t sampling; /* the model's defaults */
    const char *const *words;  /* a closed vocabulary's words (tokenizer_words), or NULL */
    int n_words;
} api_model_card_t;

/* {"object": "list", "data": [{"id": lim->model_name, "object": "model",
 *  "created": card->created, "owned_by": "arserve", ...}]}; a
 * class-conditional model (num_classes > 0) adds "num_classes" and, when it
 * has names, "classes" (the names, index = class_label). An arserve
 * extension follows:
 *   "arserve": {"family": "raster", "conditioning": "text" or "class",
 *     "width": W, "height": H, "steps": S, "step_unit": "token" or "segment",
 *     "segment_name": "line", "segment_tokens": [tokens of each segment],
 *     "sampling": {"guidance_scale", "temperature", "top_k", "top_p"},
 *     "vocabulary": ["a", "red", ...]: the words a prompt may use, on a model
 *       whose tokenizer reads only a closed list (the demo models; absent
 *       where its pieces spell any text),
 *     "limits": {"max_n", "max_partial_images", "max_prompt_bytes"},
 *     "kv_policy": the server's default policy,
 *     "kv_policy_auto": what kv_policy "auto" runs (absent when nothing),
 *     "kv_policies": [{"name": "full", "knobs": []},
 *                     {"name": "linear", "budget": 0.1667, "min_budget": 0.25,
 *                      "knobs": [{"name": "anchor_lines", "type": "integer", "min": 0,
 *                                 "min_exclusive": false, "max": 4096, "default": 1,
 *                                 "description": "..."}, ...]}, ...]}
 * kv_policies lists the policies that run on this model with the server's
 * knobs (the others are refused at any budget); one whose budget shapes
 * the cache has the budget a request naming only kv_policy gets, and the
 * least kv_budget the shortest request may ask for (kv_policy_min_budget on
 * card->geom: a longer prompt may need more; the default may be below it on
 * a small model, and such a request is refused). On a model of several
 * sizes, a policy that runs at some of them only (HeatKV and ScaleKV at the
 * sizes the model is calibrated for) lists them, "sizes": ["WxH", ...], its
 * budgets those of the first; one that runs at none is left out. Each lists its knobs
 * (KV_POLICY_KNOBS): type ("integer" or "number"), range ([min, max], or
 * (min, max] when min_exclusive), the value a request that does not give
 * it gets (the server's default) and its help. NULL when lim or card is
 * incomplete or memory runs out. */
char *api_models_json(const api_limits_t *lim, const api_model_card_t *card);

/* Server-Sent Events for `stream: true`. Each payload carries its event name
 * in "type" as well, because the openai client ignores the SSE event line and
 * picks the event class from "type". A stream sends, for each image (n > 1
 * interleaves them; image_index tells them apart, an arserve extension since
 * OpenAI streams one image at a time):
 *
 *   event: arserve.progress        (arserve extension, every step or fewer)
 *   {"type": "arserve.progress", "image_index": i, "steps_done": d, "steps_total": t}
 *     Once, when the job is admitted and before any step's progress, the
 *     event also says "kv_cache": {"policy": "linear", "budget": 0.5}: the
 *     budget it runs at (api_sse_progress_kv).
 *     An arserve name, so it cannot collide with OpenAI's own events; the
 *     openai client has no class for it and yields it as a loosely built
 *     object, which clients that only want images skip by "type".
 *
 *   event: image_generation.partial_image   (partial_images of them, 0..3)
 *   {"type": "image_generation.partial_image", "b64_json", "partial_image_index",
 *    "created_at", "size": "WxH", "quality": "auto", "background": "opaque",
 *    "output_format": "png", "image_index": i}
 *
 *   event: image_generation.completed       (once per image)
 *   {"type": "image_generation.completed", "b64_json", "created_at", "size",
 *    "quality": "auto", "background": "opaque", "output_format": "png",
 *    "usage": {as in api_images_response_json}, "image_index": i}
 *
 * A completed event carries "kv_cache", "timings" and "warnings" too when
 * they are given (as in api_images_response_json: the job's, so every
 * image of it reports the same).
 *
 * OpenAI's ImageGen*Event schemas mark size, quality, background and
 * output_format required, so strictly typed clients need them: "quality" is
 * "auto" (arserve has no quality setting) and "background" is "opaque" (the
 * PNGs are RGB). A completed event's usage is that image's own: its image
 * tokens and the prompt's tokens. */
char *api_sse_progress(int steps_done, int steps_total, int image_index);
/* The same with "kv_cache": {"policy", "budget"} (full: no budget): the
 * policy and budget the job was admitted at, which a stream says once,
 * when the job starts, before its first step's progress. */
char *api_sse_progress_kv(int steps_done, int steps_total, int image_index,
                          const kv_policy_params_t *admitted);
char *api_sse_partial_image(const char *b64, int partial_image_index, int image_index,
                            long created_at, int width, int height);
char *api_sse_completed(const char *b64, int image_index, long created_at, int width, int height,
                        int image_tokens, int prompt_tokens, const api_kv_report_t *kv,
                        const api_timings_t *timings, const char *warnings);

/* Event names as above, for api_sse_frame. */
#define API_SSE_PROGRESS "arserve.progress"
#define API_SSE_PARTIAL_IMAGE "image_generation.partial_image"
#define API_SSE_COMPLETED "image_generation.completed"
#define API_SSE_ERROR "error"

/* One SSE frame: "event: EVENT\ndata: JSON\n\n". A line break inside json
 * (CRLF, CR or LF, as SSE readers end lines) starts another "data: " line,
 * which readers join back with "\n". NULL
 * when event is empty or holds CR or LF, or memory runs out. */
char *api_sse_frame(const char *event, const char *json);

/* Base64 of n bytes, standard alphabet with '=' padding (RFC 4648 section 4),
 * no line breaks, as a malloc'd string ("" for n == 0). NULL on overflow or
 * out of memory, or buf NULL with n > 0. */
char *api_base64(const uint8_t *buf, size_t n);

#endif
