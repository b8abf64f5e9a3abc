/* Daemon settings: defaults, each source (config file, environment, flags) and
 * their precedence, every kind of error message, the API key file, and the
 * committed config/arserve.example.json staying equal to the defaults. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/backend/backend.h"
#include "server/config_test.h"
#include "tests/test.h"

#define EXAMPLE_FILE "config/arserve.example.json"

/* Loads with argv = {"serve", args...} and the given environment (both
 * NULL-terminated lists; NULL = empty). */
static int load(server_config_t *c, const char *const *args, const char *const *env,
                ar_error_t *err) {
    char *argv[32] = {"serve"};
    int argc = 1;
    for (const char *const *a = args; a && *a && argc < 31; a++)
        argv[argc++] = (char *)*a;
    char *envp[32] = {0};
    int n = 0;
    for (const char *const *e = env; e && *e && n < 31; e++)
        envp[n++] = (char *)*e;
    err->msg[0] = 0;
    return server_config_load(c, argc, argv, envp, NULL, err);
}

/* Loads a config file holding `json` (through --config) and returns the status. */
static int load_json(server_config_t *c, const char *json, ar_error_t *err) {
    char *path = test_temp_file(json);
    const char *args[] = {"--config", path, NULL};
    int rc = load(c, args, NULL, err);
    test_remove_temp(path);
    return rc;
}

static int configs_equal(const server_config_t *a, const server_config_t *b) {
    char *ja = server_config_to_json(a, 1), *jb = server_config_to_json(b, 1);
    int same = ja && jb && !strcmp(ja, jb) && !strcmp(a->api_key, b->api_key);
    free(ja);
    free(jb);
    return same;
}

static void test_defaults(void) {
    server_config_t c;
    server_config_defaults(&c);
    CHECK(c.model[0] == 0); /* the shipped model, found at start-up */
    CHECK(!strcmp(c.host, "127.0.0.1"));
    CHECK(c.port == 8080);
    CHECK(c.api_key_file[0] == 0 && c.api_key[0] == 0 && c.config_path[0] == 0);
    CHECK(c.max_running == 64 && c.max_waiting == 256);
    CHECK(c.request_timeout_s == 600 && c.drain_timeout_s == 30);
    CHECK(c.max_body_bytes == 1 << 20 && c.max_n == 4);
    CHECK(c.kv_pool_mb == 0 && c.kv_pool_share == 0.9); /* auto: sized from the machine */
    CHECK(c.threads == 0 && c.png_workers == 2);
    CHECK(!strcmp(c.log_level, "info") && !strcmp(c.backend, "auto"));
    CHECK(c.retry_after_s == 1);
    CHECK(!strcmp(c.kv_policy, "full") && c.kv.budget == 0);
}

static void test_no_sources_gives_defaults(void) {
    server_config_t c, d;
    ar_error_t err;
    const char *env[] = {"PATH=/usr/bin", "HOME=/root", NULL};
    memset(&c, 0x5a, sizeof c); /* load must not rely on the caller's contents */
    CHECK_MSG(load(&c, NULL, env, &err) == AR_OK, "%s", err.msg);
    server_config_defaults(&d);
    CHECK(configs_equal(&c, &d));
}

static void test_flags_both_syntaxes(void) {
    server_config_t c;
    ar_error_t err;
    const char *args[] = {
        "--port",       "9000", "--host=0.0.0.0", "--log-level", "debug", "--model=m/x",
        "--kv-pool-mb", "2048", "--backend=cuda", "--threads=0", NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(c.port == 9000 && !strcmp(c.host, "0.0.0.0") && !strcmp(c.log_level, "debug"));
    CHECK(!strcmp(c.model, "m/x") && c.kv_pool_mb == 2048 && !strcmp(c.backend, "cuda"));
    CHECK(c.threads == 0 && c.max_n == 4);
}

/* --kv-pool-mb takes a size or auto (kept as 0) from every source; 0 itself
 * is not a size, and a file writes auto back as "auto". */
static void test_kv_pool_auto(void) {
    server_config_t c;
    ar_error_t err;
    const char *flag[] = {"--kv-pool-mb", "512", "--kv-pool-mb", "auto", NULL};
    CHECK_MSG(load(&c, flag, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(c.kv_pool_mb == 0);
    const char *env[] = {"ARSERVE_KV_POOL_MB=auto", "ARSERVE_KV_POOL_SHARE=0.5", NULL};
    const char *over[] = {"--kv-pool-mb=64", NULL};
    CHECK_MSG(load(&c, over, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.kv_pool_mb == 64 && c.kv_pool_share == 0.5);
    CHECK_MSG(load_json(&c, "{\"kv_pool_mb\": \"auto\"}", &err) == AR_OK, "%s", err.msg);
    CHECK(c.kv_pool_mb == 0);
    char *json = server_config_to_json(&c, 0);
    CHECK(json && strstr(json, "\"kv_pool_mb\": \"auto\","));
    free(json);
    const char *zero[] = {"--kv-pool-mb", "0", NULL};
    CHECK(load(&c, zero, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "--kv-pool-mb: 0 is outside [1, 1048576] (or auto)");
    const char *word[] = {"--kv-pool-mb", "lots", NULL};
    CHECK(load(&c, word, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'lots' is not an integer or auto");
    CHECK(load_json(&c, "{\"kv_pool_mb\": \"big\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'kv_pool_mb' must be an integer or \"auto\"");
    const char *share[] = {"--kv-pool-share", "0", NULL};
    CHECK(load(&c, share, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "--kv-pool-share");
}

static void test_repeated_flag_keeps_last(void) {
    server_config_t c;
    ar_error_t err;
    const char *args[] = {"--max-n", "2", "--max-n=7", NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(c.max_n == 7);
}

static void test_env_source(void) {
    server_config_t c;
    ar_error_t err;
    const char *env[] = {"ARSERVE_PORT=9001", "ARSERVE_MAX_WAITING=0", "ARSERVE_LOG_LEVEL=warn",
                         "ARSERVE_MAX_BODY_BYTES=67108864", NULL};
    CHECK_MSG(load(&c, NULL, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.port == 9001 && c.max_waiting == 0 && !strcmp(c.log_level, "warn"));
    CHECK(c.max_body_bytes == 64 << 20);
}

static void test_env_allow_list_and_foreign_vars_are_ignored(void) {
    server_config_t c;
    ar_error_t err;
    const char *env[] = {"ARSERVE_TINY_MODEL=build/tiny",
                         "ARSERVE_GOLDEN_DIR=tests/golden",
                         "PORT=1",
                         "XARSERVE_PORT=2",
                         "ARSERVE_NOEQUALS",
                         NULL};
    CHECK_MSG(load(&c, NULL, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.port == 8080);
}

/* An empty key file name is an error from every source: it used to start
 * the daemon with no authentication and nothing said. */
static void test_empty_key_file_is_an_error(void) {
    server_config_t c;
    ar_error_t err;
    const char *flag[] = {"--api-key-file=", NULL};
    CHECK(load(&c, flag, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "--api-key-file");
    CHECK_STR_CONTAINS(err.msg, "empty");
    const char *env[] = {"ARSERVE_API_KEY_FILE=", NULL};
    CHECK(load(&c, NULL, env, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "ARSERVE_API_KEY_FILE");
    char *path = test_temp_file("{\"api_key_file\": \"\"}");
    const char *file[] = {"--config", path, NULL};
    CHECK(load(&c, file, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'api_key_file' is empty");
    test_remove_temp(path);
}

/* Config files are RFC 8259 JSON: cJSON alone would read 08080 as 8080. */
static void test_config_file_is_strict_json(void) {
    server_config_t c;
    ar_error_t err;
    char *path = test_temp_file("{\n \"port\": 08080}");
    const char *args[] = {"--config", path, NULL};
    CHECK(load(&c, args, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not valid JSON (line 2)");
    CHECK_STR_CONTAINS(err.msg, "leading zero");
    test_remove_temp(path);
}

static void test_file_source(void) {
    server_config_t c;
    ar_error_t err;
    char *path = test_temp_file("{\"port\": 7000, \"host\": \"::1\", \"backend\": \"cuda\",\n"
                                " \"max_running\": 4096}");
    const char *args[] = {"--config", path, NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(c.port == 7000 && !strcmp(c.host, "::1") && !strcmp(c.backend, "cuda"));
    CHECK(c.max_running == 4096 && c.max_n == 4);
    CHECK(!strcmp(c.config_path, path));
    test_remove_temp(path);
}

static void test_config_from_env_and_flag_beats_env(void) {
    server_config_t c;
    ar_error_t err;
    char *a = test_temp_file("{\"max_n\": 8}"), *b = test_temp_file("{\"max_n\": 16}");
    char env_config[256];
    snprintf(env_config, sizeof env_config, "ARSERVE_CONFIG=%s", a);
    const char *env[] = {env_config, NULL};
    CHECK_MSG(load(&c, NULL, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.max_n == 8);
    char flag[256];
    snprintf(flag, sizeof flag, "--config=%s", b);
    const char *args[] = {flag, NULL};
    CHECK_MSG(load(&c, args, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.max_n == 16 && !strcmp(c.config_path, b));
    /* An empty name means no file. */
    const char *none[] = {"--config", "", NULL};
    CHECK_MSG(load(&c, none, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.max_n == 4 && c.config_path[0] == 0);
    test_remove_temp(a);
    test_remove_temp(b);
}

static void test_precedence_file_env_flag(void) {
    server_config_t c;
    ar_error_t err;
    char *path = test_temp_file("{\"port\": 1001, \"max_n\": 11, \"threads\": 3}");
    const char *env[] = {"ARSERVE_PORT=1002", "ARSERVE_MAX_N=12", NULL};
    const char *args[] = {"--config", path, "--port", "1003", NULL};
    CHECK_MSG(load(&c, args, env, &err) == AR_OK, "%s", err.msg);
    CHECK(c.port == 1003); /* flag > env > file */
    CHECK(c.max_n == 12);  /* env > file */
    CHECK(c.threads == 3); /* file > default */
    CHECK(c.retry_after_s == 1);
    test_remove_temp(path);
}

static void test_bad_integer(void) {
    server_config_t c;
    ar_error_t err;
    const char *a1[] = {"--port", "abc", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--port: 'abc' is not an integer"));
    const char *a2[] = {"--port= 80", NULL};
    CHECK(load(&c, a2, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--port: ' 80' is not an integer"));
    const char *e1[] = {"ARSERVE_MAX_N=4x", NULL};
    CHECK(load(&c, NULL, e1, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_MAX_N: '4x' is not an integer"));
    const char *e2[] = {"ARSERVE_THREADS=", NULL};
    CHECK(load(&c, NULL, e2, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_THREADS: '' is not an integer"));
}

static void test_out_of_range(void) {
    server_config_t c;
    ar_error_t err;
    const char *e1[] = {"ARSERVE_PORT=70000", NULL};
    CHECK(load(&c, NULL, e1, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_PORT: 70000 is outside [0, 65535]"));
    const char *a1[] = {"--max-n", "0", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--max-n: 0 is outside [1, 64]"));
    const char *a2[] = {"--port=-1", NULL};
    CHECK(load(&c, a2, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--port: -1 is outside [0, 65535]"));
    const char *a3[] = {"--kv-pool-mb", "99999999999999999999999", NULL};
    CHECK(load(&c, a3, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg,
                  "--kv-pool-mb: 99999999999999999999999 is outside [1, 1048576] (or auto)"));
    /* The async job store's bounds: a store of no slots or no retention
     * would refuse every async job or forget it before it is read. */
    const char *a4[] = {"--async-max-jobs", "0", NULL};
    CHECK(load(&c, a4, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--async-max-jobs: 0 is outside [1, 65536]"));
    const char *a5[] = {"--async-retention-s=0", NULL};
    CHECK(load(&c, a5, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--async-retention-s: 0 is outside [1, 86400]"));
    CHECK(load_json(&c, "{\"async_max_jobs\": 2.5}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'async_max_jobs' must be an integer");
    CHECK(load_json(&c, "{\"max_body_bytes\": 1023}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, ".json: 'max_body_bytes' is 1023, outside [1024, 67108864]");
    CHECK(load_json(&c, "{\"port\": 1e300}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'port' is ");
    CHECK_STR_CONTAINS(err.msg, "outside [0, 65535]");
}

static void test_bad_enum_lists_choices(void) {
    server_config_t c;
    ar_error_t err;
    const char *a1[] = {"--log-level", "loud", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--log-level: 'loud' is not one of error, warn, info, debug"));
    const char *e1[] = {"ARSERVE_BACKEND=metal", NULL};
    CHECK(load(&c, NULL, e1, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_BACKEND: 'metal' is not one of auto, cpu, cuda"));
    CHECK(load_json(&c, "{\"log_level\": \"INFO\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg,
                       ".json: 'log_level' is 'INFO', not one of error, warn, info, debug");
}

/* 1 when name is one of the comma-separated list's names. */
static int listed(const char *list, const char *name) {
    const size_t n = strlen(name);
    for (const char *p = list; *p; p += strcspn(p, ",") + (p[strcspn(p, ",")] == ',')) {
        p += strspn(p, " ");
        if (strcspn(p, ",") == n && !strncmp(p, name, n))
            return 1;
    }
    return 0;
}

/* --backend takes exactly the names backend_open knows: the config accepts
 * a name where backend_open does not call it unknown, and a backend this
 * binary was built without says how to build it in. */
static void test_backend_choices_are_backend_opens(void) {
    const char *others[] = {"metal", "gpu", "CPU", "", NULL};
    const char *candidates[16];
    int n = 0;
    for (const char *const *b = backend_names; *b && n < 10; b++)
        candidates[n++] = *b;
    CHECK(n >= 2 && !strcmp(backend_names[0], BACKEND_AUTO));
    for (const char **o = others; *o; o++)
        candidates[n++] = *o;
    char built[128];
    backend_list(1, built, sizeof built);
    for (int i = 0; i < n; i++) {
        server_config_t c;
        ar_error_t err, open_err = {{0}};
        const char *args[] = {"--backend", candidates[i], NULL};
        const int accepted = load(&c, args, NULL, &err) == AR_OK;
        backend_t *be = backend_open(candidates[i], 1, &open_err);
        const int known = be != NULL || !strstr(open_err.msg, "unknown backend");
        CHECK_MSG(accepted == known, "'%s': the config %s it, backend_open says '%s'",
                  candidates[i], accepted ? "takes" : "refuses", be ? "ok" : open_err.msg);
        if (!be && known && strcmp(candidates[i], BACKEND_AUTO) && !listed(built, candidates[i]))
            CHECK_STR_CONTAINS(open_err.msg, "rebuild with");
        if (be)
            be->destroy(be);
    }
    CHECK(listed(built, "cpu") && !listed(built, "cp"));
}

static void test_bad_string(void) {
    server_config_t c;
    ar_error_t err;
    const char *a1[] = {"--host=", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--host: value is empty"));
    char longv[1100];
    memset(longv, 'm', sizeof longv - 1);
    longv[sizeof longv - 1] = 0;
    const char *a2[] = {"--model", longv, NULL};
    CHECK(load(&c, a2, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--model: value is longer than 1023 bytes"));
    CHECK(load_json(&c, "{\"host\": \"\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, ".json: 'host' is empty");
    /* An empty model is the shipped one. */
    CHECK(load_json(&c, "{\"model\": \"\"}", &err) == AR_OK && c.model[0] == 0);
}

static void test_unknown_flag_and_bad_arguments(void) {
    server_config_t c;
    ar_error_t err;
    const char *a1[] = {"--prot", "80", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "unknown flag '--prot' (did you mean '--port'?)"));
    const char *a2[] = {"--frobnicate=1", NULL};
    CHECK(load(&c, a2, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "unknown flag '--frobnicate'"));
    const char *a3[] = {"models/x", NULL};
    CHECK(load(&c, a3, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "unexpected argument 'models/x'");
    const char *a4[] = {"--port", NULL};
    CHECK(load(&c, a4, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--port: needs a value"));
    const char *a5[] = {"--host", "--port", "80", NULL};
    CHECK(load(&c, a5, NULL, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "--host: needs a value"));
    const char *a6[] = {"--kv_pool_mb", "1", NULL}; /* the JSON spelling is not a flag */
    CHECK(load(&c, a6, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "unknown flag '--kv_pool_mb' (did you mean '--kv-pool-mb'?)");
    /* The first mistake is the one reported. */
    const char *a7[] = {"--aaa", "--bbb", NULL};
    CHECK(load(&c, a7, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'--aaa'");
}

static void test_unknown_env(void) {
    server_config_t c;
    ar_error_t err;
    const char *e1[] = {"ARSERVE_PROT=80", NULL};
    CHECK(load(&c, NULL, e1, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "unknown environment variable ARSERVE_PROT (did you mean "
                           "'ARSERVE_PORT'?)"));
    const char *e2[] = {"ARSERVE_GPU=1", NULL};
    CHECK(load(&c, NULL, e2, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "unknown environment variable ARSERVE_GPU");
}

static void test_unknown_key(void) {
    server_config_t c;
    ar_error_t err;
    char *path = test_temp_file("{\"prot\": 80}");
    const char *args[] = {"--config", path, NULL};
    CHECK(load(&c, args, NULL, &err) == AR_ERR);
    char want[512];
    snprintf(want, sizeof want, "%s: unknown key 'prot' (did you mean 'port'?)", path);
    CHECK_MSG(!strcmp(err.msg, want), "got '%s'", err.msg);
    test_remove_temp(path);
    CHECK(load_json(&c, "{\"config\": \"x.json\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "unknown key 'config'");
    CHECK(load_json(&c, "{\"api_key\": \"s3cret\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "unknown key 'api_key'");
    CHECK_STR_CONTAINS(err.msg, "api_key_file");
    CHECK(strstr(err.msg, "s3cret") == NULL);
}

static void test_wrong_json_type(void) {
    server_config_t c;
    ar_error_t err;
    char *path = test_temp_file("{\"port\": \"8080\"}");
    const char *args[] = {"--config", path, NULL};
    CHECK(load(&c, args, NULL, &err) == AR_ERR);
    char want[512];
    snprintf(want, sizeof want, "%s: 'port' must be an integer", path);
    CHECK_MSG(!strcmp(err.msg, want), "got '%s'", err.msg);
    test_remove_temp(path);
    CHECK(load_json(&c, "{\"port\": 80.5}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'port' must be an integer");
    CHECK(load_json(&c, "{\"port\": true}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'port' must be an integer");
    CHECK(load_json(&c, "{\"host\": 127}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'host' must be a string");
    CHECK(load_json(&c, "{\"log_level\": null}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'log_level' must be a string");
    CHECK(load_json(&c, "[1, 2]", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, ".json: the top level must be a JSON object");
    CHECK(load_json(&c, "{\n\"port\": 1,\n\"host\": }", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, ".json: not valid JSON (line 3)");
    CHECK(load_json(&c, "{\"port\": 1, \"port\": 2}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, ".json: duplicate key 'port'");
}

static void test_unreadable_config_file(void) {
    server_config_t c;
    ar_error_t err;
    const char *args[] = {"--config", "/nonexistent/arserve.json", NULL};
    CHECK(load(&c, args, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "/nonexistent/arserve.json: cannot open config file");
    const char *env[] = {"ARSERVE_CONFIG=/tmp", NULL}; /* a directory */
    CHECK(load(&c, NULL, env, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "/tmp: cannot read config file");
}

static void test_key_file_is_trimmed(void) {
    server_config_t c;
    ar_error_t err;
    char *key = test_temp_file("s3cret-key  \t\r\n\n");
    const char *args[] = {"--api-key-file", key, NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(!strcmp(c.api_key, "s3cret-key"));
    CHECK(!strcmp(c.api_key_file, key));
    test_remove_temp(key);
}

static void test_api_key_sources(void) {
    server_config_t c;
    ar_error_t err;
    const char *env[] = {"ARSERVE_API_KEY=from-env", NULL};
    CHECK_MSG(load(&c, NULL, env, &err) == AR_OK, "%s", err.msg);
    CHECK(!strcmp(c.api_key, "from-env") && c.api_key_file[0] == 0);

    /* ARSERVE_API_KEY is at the environment's rank: above the file, below flags. */
    char *key = test_temp_file("from-file\n");
    char json[512];
    snprintf(json, sizeof json, "{\"api_key_file\": \"%s\"}", key);
    char *cfg = test_temp_file(json);
    const char *a1[] = {"--config", cfg, NULL};
    CHECK_MSG(load(&c, a1, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(!strcmp(c.api_key, "from-file"));
    CHECK_MSG(load(&c, a1, env, &err) == AR_OK, "%s", err.msg);
    CHECK(!strcmp(c.api_key, "from-env"));
    const char *a2[] = {"--api-key-file", key, NULL};
    CHECK_MSG(load(&c, a2, env, &err) == AR_OK, "%s", err.msg);
    CHECK(!strcmp(c.api_key, "from-file"));

    char both_file[512];
    snprintf(both_file, sizeof both_file, "ARSERVE_API_KEY_FILE=%s", key);
    const char *both[] = {"ARSERVE_API_KEY=k", both_file, NULL};
    CHECK(load(&c, NULL, both, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_API_KEY and ARSERVE_API_KEY_FILE are both set; use one"));
    const char *empty[] = {"ARSERVE_API_KEY=", NULL};
    CHECK(load(&c, NULL, empty, &err) == AR_ERR);
    CHECK(!strcmp(err.msg, "ARSERVE_API_KEY is set but empty"));
    test_remove_temp(cfg);
    test_remove_temp(key);
}

static void test_bad_key_file(void) {
    server_config_t c;
    ar_error_t err;
    const char *a1[] = {"--api-key-file", "/nonexistent/key", NULL};
    CHECK(load(&c, a1, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "/nonexistent/key: cannot open API key file");
    char *empty = test_temp_file(" \n\t\n");
    const char *a2[] = {"--api-key-file", empty, NULL};
    CHECK(load(&c, a2, NULL, &err) == AR_ERR);
    char want[512];
    snprintf(want, sizeof want, "%s: API key file is empty", empty);
    CHECK_MSG(!strcmp(err.msg, want), "got '%s'", err.msg);
    test_remove_temp(empty);
    char *two = test_temp_file("line1\nline2\n");
    const char *a3[] = {"--api-key-file", two, NULL};
    CHECK(load(&c, a3, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "API key contains a control character");
    CHECK(strstr(err.msg, "line1") == NULL);
    test_remove_temp(two);
    char big[300];
    memset(big, 'k', sizeof big - 1);
    big[sizeof big - 1] = 0;
    char *long_key = test_temp_file(big);
    const char *a4[] = {"--api-key-file", long_key, NULL};
    CHECK(load(&c, a4, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "API key is longer than 255 bytes");
    test_remove_temp(long_key);
}

static void test_help(void) {
    server_config_t c;
    ar_error_t err = {{0}};
    int want_help = 0;
    char *argv1[] = {"serve", "--port", "1", "--help", NULL};
    CHECK(server_config_load(&c, 4, argv1, NULL, &want_help, &err) == AR_OK && want_help);
    /* Help wins over mistakes and never reads the config file. */
    want_help = 0;
    char *argv2[] = {"serve", "--bogus", "--config", "/nonexistent.json", "-h", NULL};
    CHECK(server_config_load(&c, 5, argv2, NULL, &want_help, &err) == AR_OK && want_help);
    want_help = 1;
    char *argv3[] = {"serve", NULL};
    CHECK(server_config_load(&c, 1, argv3, NULL, &want_help, &err) == AR_OK && !want_help);
}

static void test_usage_lists_every_setting(void) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    server_config_usage(f);
    fclose(f);
    /* Every key of the JSON form has its derived flag and variable in --help. */
    server_config_t d;
    server_config_defaults(&d);
    char *json = server_config_to_json(&d, 0);
    cJSON *root = cJSON_Parse(json);
    CHECK(root != NULL);
    int n = 0;
    for (const cJSON *it = root ? root->child : NULL; it; it = it->next, n++) {
        char flag[128] = "--", env[128] = "ARSERVE_";
        for (const char *p = it->string; *p; p++) {
            size_t fl = strlen(flag), el = strlen(env);
            flag[fl] = *p == '_' ? '-' : *p;
            flag[fl + 1] = 0;
            env[el] = (char)(*p >= 'a' && *p <= 'z' ? *p - 'a' + 'A' : *p);
            env[el + 1] = 0;
        }
        strcat(flag, " ");
        strcat(env, "\n");
        CHECK_STR_CONTAINS(text, flag);
        CHECK_STR_CONTAINS(text, env);
    }
    /* Every setting but api_key_file and cost_table, left out of the JSON form when empty:
     * ... kv_policy, kv_budget, kv_budget_min, kv_budget_ranges and every knob. */
    CHECK(n == 42 + KV_POLICY_N_KNOBS);
    CHECK_STR_CONTAINS(text, "--kv-pool-mb MIB|auto");
    CHECK_STR_CONTAINS(text, "1..1048576 or auto, default auto.\n");
    CHECK_STR_CONTAINS(text, "error|warn|info|debug, default info.\n");
    CHECK_STR_CONTAINS(text, "empty: the\n      shipped demo model");
    CHECK_STR_CONTAINS(text, "folder. Default: the shipped demo model.\n");
    /* Fits a terminal. */
    for (const char *line = text; *line;
         line += strcspn(line, "\n") + (line[strcspn(line, "\n")] != 0))
        CHECK_MSG(strcspn(line, "\n") <= 80, "long line: %.*s", (int)strcspn(line, "\n"), line);
    CHECK_STR_CONTAINS(text, "--config FILE");
    CHECK_STR_CONTAINS(text, "from ARSERVE_API_KEY, the key itself");
    /* Grouped by topic, every setting under one; the variables only tests
     * read are not a user's business. */
    char ungrouped[64] = "";
    CHECK_MSG(server_config_ungrouped(ungrouped, sizeof ungrouped) == 0,
              "setting %s has no --help topic", ungrouped);
    CHECK_STR_CONTAINS(text, "\nThe KV cache:\n  --kv-pool-mb MIB|auto");
    CHECK_STR_CONTAINS(text, "\nLogs:\n  --log-level LEVEL");
    CHECK(strstr(text, "ARSERVE_TINY_MODEL") == NULL && strstr(text, "ARSERVE_GOLDEN_DIR") == NULL);
    cJSON_Delete(root);
    free(json);
    free(text);
}

static void test_to_json_redacts_key(void) {
    server_config_t c;
    server_config_defaults(&c);
    char *plain = server_config_to_json(&c, 1);
    CHECK_STR_CONTAINS(plain, "\"api_key\": \"\"");
    strcpy(c.api_key, "s3cret");
    char *log = server_config_to_json(&c, 1), *file = server_config_to_json(&c, 0);
    CHECK_STR_CONTAINS(log, "\"api_key\": \"<redacted>\"");
    CHECK(strstr(log, "s3cret") == NULL && strstr(file, "s3cret") == NULL);
    CHECK(strstr(file, "api_key\"") == NULL);
    cJSON *root = cJSON_Parse(log);
    CHECK(root != NULL);
    cJSON_Delete(root);
    free(plain);
    free(log);
    free(file);
}

static void test_to_json_round_trips(void) {
    server_config_t c, back;
    ar_error_t err;
    const char *args[] = {"--model", "dir with \"quotes\"\\", "--port", "0", "--log-level",
                          "error",   "--max-waiting",         "100000", NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    char *json = server_config_to_json(&c, 0);
    CHECK_MSG(load_json(&back, json, &err) == AR_OK, "%s", err.msg);
    back.config_path[0] = 0;
    CHECK(configs_equal(&c, &back));
    CHECK(!strcmp(back.model, "dir with \"quotes\"\\") && back.port == 0);
    free(json);
}

static void test_example_file_equals_defaults(void) {
    server_config_t c, d;
    ar_error_t err;
    server_config_defaults(&d);
    const char *args[] = {"--config", EXAMPLE_FILE, NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    c.config_path[0] = 0;
    CHECK(configs_equal(&c, &d));
    /* Equal values could hide a missing key: the text must match exactly. */
    char *want = server_config_to_json(&d, 0), have[8192] = "";
    FILE *f = fopen(EXAMPLE_FILE, "r");
    if (f) {
        size_t n = fread(have, 1, sizeof have - 1, f);
        have[n] = 0;
        fclose(f);
    }
    CHECK_MSG(!strcmp(have, want), "%s drifted from the settings table; its content should be:\n%s",
              EXAMPLE_FILE, want);
    free(want);
}

/* Every KV knob is a key whose default is the paper's (kv_policy_defaults);
 * the daemon's default policy is full, with each policy's own budget. */
static void test_kv_defaults_are_the_papers(void) {
    server_config_t c;
    server_config_defaults(&c);
    kv_policy_params_t papers, d;
    kv_policy_defaults(&papers, KV_POLICY_LINEAR);
    server_config_kv_defaults(&c, &d);
    CHECK(d.kind == KV_POLICY_FULL && d.budget == 0);
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        CHECK_MSG(kv_policy_knob_get(&d, k) == kv_policy_knob_get(&papers, k), "%s", k->name);
    }
    char *json = server_config_to_json(&c, 0);
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++) {
        char key[64];
        snprintf(key, sizeof key, "\"%s\": ", kv_policy_knobs[i].name);
        CHECK_STR_CONTAINS(json, key);
    }
    free(json);
}

/* The text of --help's paragraph for flag (its lines joined, the
 * indentation gone) into out. */
static void usage_paragraph(const char *usage, const char *flag, char *out, size_t cap) {
    out[0] = 0;
    const char *p = strstr(usage, flag);
    if (!p)
        return;
    p += strcspn(p, "\n"); /* past the flag's own line */
    size_t n = 0;
    while (*p == '\n' && !strncmp(p + 1, "      ", 6)) {
        p += 1 + 6;
        if (n && n + 1 < cap)
            out[n++] = ' ';
        while (*p && *p != '\n' && n + 1 < cap)
            out[n++] = *p++;
    }
    out[n] = 0;
}

/* --kv-budget's help says each policy's own budget: exactly the policies
 * of the table that take one, each with its default, then the others. */
static void test_kv_budget_help_lists_every_policy(void) {
    char *text = NULL, para[2048], *save = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    server_config_usage(f);
    fclose(f);
    usage_paragraph(text, "--kv-budget B", para, sizeof para);
    const char *open = strstr(para, "each policy's own (");
    CHECK_MSG(open != NULL, "%s", para);
    char list[1024] = "";
    if (open)
        snprintf(list, sizeof list, "%.*s", (int)strcspn(open + 19, ")"), open + 19);
    int listed[KV_POLICY_COUNT] = {0};
    char *none = strstr(list, "; ");
    if (none) {
        *none = 0;
        none += 2;
    }
    /* "name B, name B, ..." */
    for (char *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char name[64];
        int num = 0, den = 0;
        double b = 0;
        if (sscanf(item, " %63s %d/%d", name, &num, &den) == 3 && den > 0)
            b = (double)num / den;
        else if (sscanf(item, " %63s %lf", name, &b) != 2)
            CHECK_MSG(0, "'%s' is not 'policy budget'", item);
        const int k = kv_policy_parse(name);
        CHECK_MSG(k >= 0 && kv_policy_uses_budget((kv_policy_kind_t)k, NULL) && !listed[k],
                  "'%s' listed with a budget", name);
        if (k >= 0) {
            listed[k]++;
            CHECK_NEAR(b, kv_policy_default_budget((kv_policy_kind_t)k), 1e-12, 0);
        }
    }
    /* "name, name and name take none" */
    char *end = none ? strstr(none, " take") : NULL;
    CHECK_MSG(end != NULL, "no policies without a budget in '%s'", para);
    if (end) {
        *end = 0;
        for (char *item = strtok_r(none, ", ", &save); item; item = strtok_r(NULL, ", ", &save)) {
            if (!strcmp(item, "and"))
                continue;
            const int k = kv_policy_parse(item);
            CHECK_MSG(k >= 0 && !kv_policy_uses_budget((kv_policy_kind_t)k, NULL) && !listed[k],
                      "'%s' listed as taking no budget", item);
            if (k >= 0)
                listed[k]++;
        }
    }
    for (int k = 0; k < KV_POLICY_COUNT; k++)
        CHECK_MSG(listed[k] == 1, "%s is not in --kv-budget's help: %s",
                  kv_policy_name((kv_policy_kind_t)k), para);
    free(text);
}

static void test_kv_settings_from_every_source(void) {
    server_config_t c;
    ar_error_t err;
    kv_policy_params_t d;
    const char *args[] = {"--kv-budget",           "1/6", "--anchor-lines=0",
                          "--headkv-group-tokens", "40",  NULL};
    const char *env[] = {"ARSERVE_KV_POLICY=linear", "ARSERVE_HEADKV_ALPHA=0.25",
                         "ARSERVE_RECENT_LINES=1", NULL};
    CHECK_MSG(load(&c, args, env, &err) == AR_OK, "%s", err.msg);
    server_config_kv_defaults(&c, &d);
    CHECK(d.kind == KV_POLICY_LINEAR && d.budget == 1.0 / 6);
    CHECK(d.anchor_lines == 0 && d.recent_lines == 1 && d.headkv_alpha == 0.25);
    CHECK(d.headkv_group_tokens == 40 && d.sink_tokens == 4 && d.headkv_threshold == 0.9);
    CHECK(load_json(&c,
                    "{\"kv_policy\": \"headkv\", \"kv_budget\": 0.125, \"headkv_threshold\": "
                    "0.95, \"headkv_local_window\": 16, \"sink_tokens\": 0}",
                    &err) == AR_OK);
    server_config_kv_defaults(&c, &d);
    CHECK(d.kind == KV_POLICY_HEADKV && d.budget == 0.125 && d.headkv_threshold == 0.95);
    CHECK(d.headkv_local_window == 16 && d.sink_tokens == 0);
    /* sink_scales (streaming on next-scale models): a flag, a variable and a key. */
    const char *sargs[] = {"--sink-scales", "2", NULL}, *senv[] = {"ARSERVE_SINK_SCALES=5", NULL};
    CHECK(load(&c, NULL, senv, &err) == AR_OK);
    server_config_kv_defaults(&c, &d);
    CHECK(d.sink_scales == 5);
    CHECK(load(&c, sargs, senv, &err) == AR_OK);
    server_config_kv_defaults(&c, &d);
    CHECK(d.sink_scales == 2);
    CHECK(load_json(&c, "{\"sink_scales\": 0}", &err) == AR_OK);
    server_config_kv_defaults(&c, &d);
    CHECK(d.sink_scales == 0 && d.sink_tokens == 4);
    /* Reals round-trip through the JSON form exactly. */
    server_config_t back;
    c.kv.budget = 1.0 / 6;
    c.kv.headkv_alpha = 0.1 + 0.2;
    char *json = server_config_to_json(&c, 0);
    CHECK_MSG(load_json(&back, json, &err) == AR_OK, "%s", err.msg);
    back.config_path[0] = 0;
    c.config_path[0] = 0;
    CHECK(configs_equal(&c, &back) && back.kv.budget == 1.0 / 6 &&
          back.kv.headkv_alpha == 0.1 + 0.2);
    free(json);
}

static void test_kv_bad_values_name_the_setting(void) {
    server_config_t c;
    ar_error_t err;
    static const struct {
        const char *arg, *msg;
    } flags[] = {
        {"--kv-budget=1.5", "--kv-budget: 1.5 is outside [0, 1]"},
        {"--kv-budget=-0.1", "--kv-budget: -0.1 is outside [0, 1]"},
        {"--kv-budget=abc", "--kv-budget: 'abc' is not a number"},
        {"--kv-budget= 0.5", "--kv-budget: ' 0.5' is not a number"},
        {"--kv-budget=1/0", "--kv-budget: '1/0' is not a number"},
        {"--kv-budget=1/", "--kv-budget: '1/' is not a number"},
        {"--kv-budget=nan", "--kv-budget: nan is outside [0, 1]"},
        {"--headkv-threshold=0", "--headkv-threshold: 0 is outside (0, 1]"},
        {"--headkv-alpha=1.01", "--headkv-alpha: 1.01 is outside [0, 1]"},
        {"--anchor-lines=-1", "--anchor-lines: -1 is outside [0, 4096]"},
        {"--headkv-buffer=0", "--headkv-buffer: 0 is outside [1, 65536]"},
        {"--sink-tokens=1.5", "--sink-tokens: '1.5' is not an integer"},
        {"--kv-policy=lru", "--kv-policy: 'lru' is not one of full, streaming, linear, headkv, "
                            "heatkv, heatkv_binary, amskv, scalekv"},
    };
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        const char *args[] = {flags[i].arg, NULL};
        CHECK(load(&c, args, NULL, &err) == AR_ERR);
        CHECK_MSG(!strcmp(err.msg, flags[i].msg), "%s: got '%s'", flags[i].arg, err.msg);
    }
    CHECK(load_json(&c, "{\"kv_budget\": \"1/6\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'kv_budget' must be a number");
    CHECK(load_json(&c, "{\"headkv_alpha\": 1.5}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'headkv_alpha' is 1.5, outside [0, 1]");
    CHECK(load_json(&c, "{\"recent_lines\": 0.5}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'recent_lines' must be an integer");
    CHECK(load_json(&c, "{\"anchor_line\": 1}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "did you mean 'anchor_lines'");
}

/* kv_budget_ranges: each policy's default range from a flag, a variable or
 * a key; the default policy's from kv_budget_min up to kv_budget; every
 * mistake named with where it came from. */
static void test_kv_budget_ranges(void) {
    server_config_t c;
    ar_error_t err;
    kv_budget_range_t r[KV_POLICY_COUNT];
    const char *args[] = {"--kv-budget-ranges", " heatkv=0.25, scalekv=1/10:0.5 ,", NULL};
    CHECK_MSG(load(&c, args, NULL, &err) == AR_OK, "%s", err.msg);
    CHECK(server_config_kv_ranges(&c, r, &err) == AR_OK);
    CHECK(r[KV_POLICY_HEATKV].min == 0.25 && r[KV_POLICY_HEATKV].max == 0);
    CHECK(r[KV_POLICY_SCALEKV].min == 0.1 && r[KV_POLICY_SCALEKV].max == 0.5);
    CHECK(r[KV_POLICY_LINEAR].min == 0 && r[KV_POLICY_FULL].min == 0);
    const char *env[] = {"ARSERVE_KV_BUDGET_RANGES=linear=0.5:1", NULL};
    const char *def_args[] = {"--kv-policy",     "streaming", "--kv-budget", "0.75",
                              "--kv-budget-min", "0.25",      NULL};
    CHECK_MSG(load(&c, def_args, env, &err) == AR_OK, "%s", err.msg);
    CHECK(server_config_kv_ranges(&c, r, &err) == AR_OK);
    CHECK(r[KV_POLICY_LINEAR].min == 0.5 && r[KV_POLICY_LINEAR].max == 1);
    CHECK(r[KV_POLICY_STREAMING].min == 0.25 && r[KV_POLICY_STREAMING].max == 0.75);
    CHECK(load_json(&c, "{\"kv_budget_ranges\": \"amskv=0.3\"}", &err) == AR_OK);
    CHECK(server_config_kv_ranges(&c, r, &err) == AR_OK && r[KV_POLICY_AMSKV].min == 0.3);
    static const struct {
        const char *arg, *msg;
    } bad[] = {
        {"--kv-budget-ranges=heatkv", "--kv-budget-ranges: entry 'heatkv' is not POLICY=MIN[:MAX]"},
        {"--kv-budget-ranges=lru=0.5", "--kv-budget-ranges: 'lru' is not a KV policy (full, "
                                       "streaming, linear, headkv, heatkv, heatkv_binary, amskv, "
                                       "scalekv)"},
        {"--kv-budget-ranges=full=0.5", "--kv-budget-ranges: full takes no budget, so it has no "
                                        "range"},
        {"--kv-budget-ranges=heatkv=0.2,heatkv=0.3", "--kv-budget-ranges: heatkv is given twice"},
        {"--kv-budget-ranges=heatkv=x", "--kv-budget-ranges: heatkv's range is not MIN or "
                                        "MIN:MAX, numbers"},
        {"--kv-budget-ranges=heatkv=0.2:", "--kv-budget-ranges: heatkv's range is not MIN or "
                                           "MIN:MAX, numbers"},
        {"--kv-budget-ranges=heatkv=0", "--kv-budget-ranges: heatkv's budgets must be in (0, 1]"},
        {"--kv-budget-ranges=heatkv=0.5:1.5", "--kv-budget-ranges: heatkv's budgets must be in "
                                              "(0, 1]"},
        {"--kv-budget-ranges=heatkv=0.5:0.25", "--kv-budget-ranges: heatkv's MIN 0.5 is above "
                                               "its MAX 0.25"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *a[] = {bad[i].arg, NULL};
        CHECK(load(&c, a, NULL, &err) == AR_ERR);
        CHECK_MSG(!strcmp(err.msg, bad[i].msg), "%s: got '%s'", bad[i].arg, err.msg);
    }
    CHECK(load_json(&c, "{\"kv_budget_ranges\": \"heatkv=2\"}", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "'kv_budget_ranges' heatkv's budgets must be in (0, 1]");
    /* The default policy's range is given once. */
    const char *twice[] = {"--kv-policy", "linear", "--kv-budget-min", "0.25", "--kv-budget-ranges",
                           "linear=0.5",  NULL};
    CHECK(load(&c, twice, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "kv_budget_ranges names linear, the default kv_policy, whose "
                                "range kv_budget_min gives");
}

int main(void) {
    TEST_RUN(test_defaults);
    TEST_RUN(test_no_sources_gives_defaults);
    TEST_RUN(test_flags_both_syntaxes);
    TEST_RUN(test_repeated_flag_keeps_last);
    TEST_RUN(test_env_source);
    TEST_RUN(test_env_allow_list_and_foreign_vars_are_ignored);
    TEST_RUN(test_file_source);
    TEST_RUN(test_config_file_is_strict_json);
    TEST_RUN(test_kv_pool_auto);
    TEST_RUN(test_empty_key_file_is_an_error);
    TEST_RUN(test_config_from_env_and_flag_beats_env);
    TEST_RUN(test_precedence_file_env_flag);
    TEST_RUN(test_bad_integer);
    TEST_RUN(test_out_of_range);
    TEST_RUN(test_bad_enum_lists_choices);
    TEST_RUN(test_backend_choices_are_backend_opens);
    TEST_RUN(test_bad_string);
    TEST_RUN(test_unknown_flag_and_bad_arguments);
    TEST_RUN(test_unknown_env);
    TEST_RUN(test_unknown_key);
    TEST_RUN(test_wrong_json_type);
    TEST_RUN(test_unreadable_config_file);
    TEST_RUN(test_key_file_is_trimmed);
    TEST_RUN(test_api_key_sources);
    TEST_RUN(test_bad_key_file);
    TEST_RUN(test_help);
    TEST_RUN(test_usage_lists_every_setting);
    TEST_RUN(test_kv_budget_help_lists_every_policy);
    TEST_RUN(test_to_json_redacts_key);
    TEST_RUN(test_to_json_round_trips);
    TEST_RUN(test_example_file_equals_defaults);
    TEST_RUN(test_kv_defaults_are_the_papers);
    TEST_RUN(test_kv_settings_from_every_source);
    TEST_RUN(test_kv_bad_values_name_the_setting);
    TEST_RUN(test_kv_budget_ranges);
    return TEST_SUMMARY();
}
