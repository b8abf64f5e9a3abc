/* libFuzzer target: bytes as a model directory's arserve.json, through
 * model_config_parse (engine/model_config.c). A refused text must give a
 * message naming the file; an accepted one must hold what the model loader
 * relies on: a known family, sizes in range, image sides that do not
 * overflow, NUL-terminated strings.
 * Build and run: make -f Makefile -f tests/fuzz/fuzz.mk fuzz (tests/fuzz/fuzz.mk). */
#include "engine/model_config.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    model_config_t cfg;
    ar_error_t err = {{0}};
    if (model_config_parse(&cfg, (const char *)data, size, "fuzz/arserve.json", &err) != AR_OK) {
        FUZZ_REQUIRE(strncmp(err.msg, "fuzz/arserve.json: ", 19) == 0,
                     "message does not name the file: %s", err.msg);
        return 0;
    }
    FUZZ_REQUIRE(strcmp(cfg.family, "raster") == 0 || strcmp(cfg.family, "scale") == 0, "family %s",
                 cfg.family);
    FUZZ_REQUIRE(memchr(cfg.name, 0, sizeof cfg.name) &&
                     memchr(cfg.tokenizer, 0, sizeof cfg.tokenizer),
                 "unterminated string");
    FUZZ_REQUIRE(cfg.n_weight_files >= 1 && cfg.n_weight_files <= MODEL_MAX_WEIGHT_FILES,
                 "%d weight files", cfg.n_weight_files);
    FUZZ_REQUIRE(cfg.decoder.n_levels >= 1 && cfg.decoder.n_levels <= MODEL_MAX_LEVELS,
                 "%d decoder levels", cfg.decoder.n_levels);
    FUZZ_REQUIRE(cfg.llm.num_layers >= 1 && cfg.llm.num_heads >= 1 && cfg.llm.head_dim >= 1,
                 "llm shape");
    FUZZ_REQUIRE(cfg.image.n_scales >= 0 && cfg.image.n_scales <= MODEL_MAX_SCALES, "%d scales",
                 cfg.image.n_scales);
    /* UBSan reports a shift that overflows here. */
    int hgt = model_config_image_height(&cfg), wid = model_config_image_width(&cfg);
    FUZZ_REQUIRE(hgt >= 1 && wid >= 1, "image %dx%d", wid, hgt);
    return 0;
}
