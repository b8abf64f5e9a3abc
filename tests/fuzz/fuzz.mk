# libFuzzer targets for the parsers that read what arserve did not write:
# request bodies, SSE frames, arserve.json, tokenizer.json, safetensors.
# Included by the Makefile after its own variables (BUILD, CI); standalone:
#   make -f Makefile -f tests/fuzz/fuzz.mk test-fuzz
#
#   make fuzz        each target for FUZZ_SECONDS (600) in turn, new corpus
#                    entries in $(BUILD)/fuzz/corpus/<target>, then a table of
#                    execs, exec/s, cov, ft and corpus size per target
#   make test-fuzz   every regression input and seed once, then each target
#                    from a fixed seed for its FUZZ_TEST_RUNS inputs (about 2 s
#                    each on AVX-512, 4 s on a 2-core AVX2 machine), at most
#                    FUZZ_TEST_SECONDS (6); any crash,
#                    leak, UB report or timeout fails it
#
# Targets compile the engine and server/api.c again with clang and
# -fsanitize=fuzzer,address,undefined and libc malloc (ARSERVE_JEMALLOC is
# not defined). Crash inputs go to $(BUILD)/fuzz/artifacts/; a fixed bug's
# input belongs in tests/fuzz/regressions/<target>/.

FUZZ_CC           ?= clang
FUZZ_SECONDS      ?= 600
FUZZ_TEST_SECONDS ?= 6
# Inputs each target runs in test-fuzz (target=count): the same inputs on
# every machine fast enough to run them within FUZZ_TEST_SECONDS.
FUZZ_TEST_RUNS    ?= fuzz_request=60000 fuzz_sse=20000 fuzz_model_config=150000 \
                     fuzz_tokenizer=3000 fuzz_safetensors=30000
# Longest input a fuzzing run makes (the replay of regressions runs each file
# whole, 100000-level nestings included).
FUZZ_MAX_LEN      ?= 16384
FUZZ_DIR          := $(BUILD)/fuzz
FUZZ_TARGETS      := fuzz_request fuzz_sse fuzz_model_config fuzz_tokenizer fuzz_safetensors
FUZZ_BINS         := $(FUZZ_TARGETS:%=$(FUZZ_DIR)/%)
# The engine without its backends and CPU kernels (no target reaches them;
# the kernels need OpenMP, and gemm_packed.c alone took 32 s of clang here)
# and the HTTP API's JSON half, in an archive: each target links what it
# uses.
FUZZ_LIB_SRC      := $(filter-out engine/backend/backend_cuda.c engine/backend/backend_cpu.c kernels/cpu/%,$(ENGINE_SRC)) \
                     server/api.c
FUZZ_LIB_OBJ      := $(FUZZ_LIB_SRC:%.c=$(FUZZ_DIR)/obj/%.o)
FUZZ_LIB          := $(FUZZ_DIR)/libfuzzarserve.a
FUZZ_SAN          := address,undefined
FUZZ_CFLAGS       := -std=c11 -D_GNU_SOURCE -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread \
                     -g -O1 -fno-omit-frame-pointer -fno-sanitize-recover=all \
                     -Wall -Wextra -Wshadow -Wno-unused-parameter -Wno-unknown-pragmas -MMD -MP
ifeq ($(CI),true)
FUZZ_CFLAGS       += -Werror
endif
FUZZ_LIBS         := -lcjson -lpng -lpcre2-8 -lm -lopenblas -lpthread
# FUZZ_CJSON_SRC=DIR/cJSON.c (a cJSON source tree of the system's version):
# cJSON compiled with the sanitizers too, instead of the system library,
# which ASan cannot see into. Use its own BUILD, e.g.
#   make -f Makefile -f tests/fuzz/fuzz.mk BUILD=build-cjson FUZZ_CJSON_SRC=../cJSON/cJSON.c test-fuzz
FUZZ_CJSON_SRC    ?=
ifneq ($(FUZZ_CJSON_SRC),)
FUZZ_LIB_OBJ      += $(FUZZ_DIR)/obj/cjson/cJSON.o
FUZZ_LIBS         := $(filter-out -lcjson,$(FUZZ_LIBS))
$(FUZZ_DIR)/obj/cjson/cJSON.o: $(FUZZ_CJSON_SRC) | fuzz-check-tools
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c89 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,$(FUZZ_SAN) \
		-fno-sanitize-recover=all -c $< -o $@
endif
# libFuzzer flags for every run: a hang or a huge allocation is a failure,
# crash inputs go to the build folder, not the working directory.
FUZZ_RUN_FLAGS    := -timeout=10 -rss_limit_mb=2048 -artifact_prefix=$(FUZZ_DIR)/artifacts/ \
                     -print_final_stats=1

.PHONY: fuzz test-fuzz fuzz-build fuzz-check-tools

# clang with libFuzzer's runtime (Debian 12: clang, and libclang-rt-14-dev,
# the libclang-rt-N-dev of clang N, which holds libclang_rt.fuzzer).
fuzz-check-tools:
	@command -v $(FUZZ_CC) >/dev/null || { \
		echo "fuzz: $(FUZZ_CC) not found; install clang (Debian: apt-get install clang libclang-rt-14-dev)"; exit 1; }
	@mkdir -p $(FUZZ_DIR)
	@printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n' \
		> $(FUZZ_DIR)/probe.c
	@$(FUZZ_CC) -fsanitize=fuzzer,$(FUZZ_SAN) $(FUZZ_DIR)/probe.c -o $(FUZZ_DIR)/probe 2>$(FUZZ_DIR)/probe.log || { \
		v=$$($(FUZZ_CC) -dumpversion | cut -d. -f1); \
		echo "fuzz: $(FUZZ_CC) cannot link libFuzzer with ASan and UBSan ($(FUZZ_DIR)/probe.log);"; \
		echo "      install its runtime: apt-get install libclang-rt-$$v-dev (the version of $(FUZZ_CC) --version)"; \
		exit 1; }

$(FUZZ_DIR)/obj/%.o: %.c | fuzz-check-tools
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link,$(FUZZ_SAN) -c $< -o $@

$(FUZZ_LIB): $(FUZZ_LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(FUZZ_DIR)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz.h $(FUZZ_LIB) | fuzz-check-tools
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,$(FUZZ_SAN) -o $@ $< $(FUZZ_LIB) $(FUZZ_LIBS)

fuzz-build: $(FUZZ_BINS)

# Each target in turn for FUZZ_SECONDS, from the committed seeds and
# regressions plus what earlier runs found ($(FUZZ_DIR)/corpus/<target>, the
# first corpus folder, where libFuzzer writes new entries); logs in
# $(FUZZ_DIR)/logs/, then the table.
fuzz: fuzz-build
	@mkdir -p $(FUZZ_DIR)/artifacts $(FUZZ_DIR)/logs
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_DIR)/corpus/$$t; \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s (log $(FUZZ_DIR)/logs/$$t.log)"; \
		$(FUZZ_DIR)/$$t $(FUZZ_RUN_FLAGS) -max_total_time=$(FUZZ_SECONDS) -max_len=$(FUZZ_MAX_LEN) -dict=tests/fuzz/$$t.dict \
			$(FUZZ_DIR)/corpus/$$t tests/fuzz/corpus/$$t tests/fuzz/regressions/$$t \
			>$(FUZZ_DIR)/logs/$$t.log 2>&1 || { tail -n 40 $(FUZZ_DIR)/logs/$$t.log; \
			echo "fuzz: $$t FAILED; the input is in $(FUZZ_DIR)/artifacts/"; exit 1; }; \
	done
	@tests/fuzz/fuzz_summary.sh $(FUZZ_DIR) $(FUZZ_TARGETS)

# Regression inputs and seeds once each, then a short fixed-seed run per
# target in a scratch corpus (the committed one is not written).
test-fuzz: fuzz-build
	@mkdir -p $(FUZZ_DIR)/artifacts $(FUZZ_DIR)/logs
	@for t in $(FUZZ_TARGETS); do \
		n=$$(find tests/fuzz/regressions/$$t tests/fuzz/corpus/$$t -type f | wc -l); \
		$(FUZZ_DIR)/$$t $(FUZZ_RUN_FLAGS) tests/fuzz/regressions/$$t/* tests/fuzz/corpus/$$t/* \
			>$(FUZZ_DIR)/logs/$$t.replay.log 2>&1 || { tail -n 40 $(FUZZ_DIR)/logs/$$t.replay.log; \
			echo "not ok  $$t: a regression or seed input fails"; exit 1; }; \
		echo "ok      $$t: $$n regression and seed inputs"; \
		rm -rf $(FUZZ_DIR)/test-corpus/$$t && mkdir -p $(FUZZ_DIR)/test-corpus/$$t; \
		runs=$$(echo "$(FUZZ_TEST_RUNS)" | tr ' ' '\n' | sed -n "s/^$$t=//p"); \
		[ -n "$$runs" ] || { echo "not ok  $$t: no count in FUZZ_TEST_RUNS"; exit 1; }; \
		$(FUZZ_DIR)/$$t $(FUZZ_RUN_FLAGS) -seed=1 -runs=$$runs -max_total_time=$(FUZZ_TEST_SECONDS) \
			-max_len=$(FUZZ_MAX_LEN) \
			-dict=tests/fuzz/$$t.dict $(FUZZ_DIR)/test-corpus/$$t tests/fuzz/corpus/$$t \
			tests/fuzz/regressions/$$t >$(FUZZ_DIR)/logs/$$t.test.log 2>&1 || { \
			tail -n 40 $(FUZZ_DIR)/logs/$$t.test.log; \
			echo "not ok  $$t: fuzzing found a failure (input in $(FUZZ_DIR)/artifacts/)"; \
			exit 1; }; \
		echo "ok      $$t: fuzzing, $$(grep -o 'number_of_executed_units: [0-9]*' \
			$(FUZZ_DIR)/logs/$$t.test.log | grep -o '[0-9]*$$') of $$runs inputs"; \
	done

-include $(FUZZ_LIB_OBJ:.o=.d) $(FUZZ_BINS:=.d)
