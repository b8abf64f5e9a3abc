# arserve build. `make run` and `make test` are all a newcomer types: both
# install what they need first (`make deps`). `make help` lists the targets.
# `make run` serves MODEL (default models/shapes, the shipped demo model);
# `make eval` scores MODEL on the ShapesEval prompts (EVAL_ARGS="--limit 48"
# for a quick look); `make bench-kv` compares the KV policies on it.
#
# Switches (validated): CUDA=0|1, SANITIZER=address|undefined|address,undefined|thread,
# DEBUG=0|1, KIT=0|1, V=0|1 (make run: every command and its output).
# CI=true adds -Werror. CUDA=1 builds arserve with the CUDA backend too (nvcc
# from CUDA_HOME, GPU architectures CUDA_ARCHS) into build-cuda/. KIT=1 (with
# CUDA=1; `make gpu-kit` sets both) links binaries for the GPU kit: the CUDA
# runtime static, and the shared libraries looked up in ../lib beside the
# binary before anywhere else.

comma     := ,
CUDA      ?= 0
DEBUG     ?= 0
SANITIZER ?=
ifeq ($(CUDA),1)
BUILD     ?= build-cuda
else
BUILD     ?= build
endif
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
# Compute capabilities to build for (A100: 80, H100/H200: 90); PTX of the
# last one is embedded too, so newer GPUs can JIT it.
CUDA_ARCHS ?= 80 90
PYTHON    ?= python3
VENV      := .venv
# torch for the CPU alone: make bench's torch side with BENCH_TORCH=cpu
# (test-bench-smoke)
BENCH_CPU_VENV := .venv-bench
PORT      ?= 8080
HOST      ?= 127.0.0.1
# `make run` shows a line per stage, not the commands: V=1 shows them all,
# with every tool's output, as the other targets always do. QUIET=1 is what
# make run hands its stages (see run).
V         ?= 0
QUIET     ?= 0

ifeq ($(filter $(CUDA),0 1),)
$(error CUDA must be 0 or 1, not '$(CUDA)')
endif
ifeq ($(strip $(CUDA_ARCHS)),)
$(error CUDA_ARCHS is empty; give compute capabilities such as 80 90)
endif
$(foreach a,$(CUDA_ARCHS),$(if $(shell echo '$(a)' | grep -Ex '[0-9]{2,3}[af]?'),,\
  $(error CUDA_ARCHS: '$(a)' is not a compute capability such as 80, 90 or 90a)))
KIT ?= 0
ifeq ($(filter $(KIT),0 1),)
$(error KIT must be 0 or 1, not '$(KIT)')
endif
ifeq ($(KIT)$(CUDA),10)
$(error KIT=1 builds the GPU kit's binaries and needs CUDA=1 (make gpu-kit sets both))
endif
ifeq ($(filter $(DEBUG),0 1),)
$(error DEBUG must be 0 or 1, not '$(DEBUG)')
endif
ifeq ($(filter $(V),0 1),)
$(error V must be 0 or 1, not '$(V)')
endif
ifeq ($(filter $(QUIET),0 1),)
$(error QUIET must be 0 or 1, not '$(QUIET)')
endif
ifneq ($(SANITIZER),)
ifeq ($(filter $(SANITIZER),address undefined address$(comma)undefined thread),)
$(error SANITIZER must be address, undefined, address$(comma)undefined or thread, not '$(SANITIZER)')
endif
endif

# Non-empty when the build has AddressSanitizer (address or address,undefined).
WITH_ASAN := $(filter address,$(subst $(comma), ,$(SANITIZER)))

CC      ?= cc
CFLAGS  := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wpointer-arith -Wno-unused-parameter -fopenmp \
           -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread -MMD -MP
LDLIBS  := -lopenblas -lcjson -lpng -lpcre2-8 -lm -lpthread
# The daemon allocates through jemalloc, except in sanitizer builds, which
# need libc's malloc.
SERVER_LIBS := -lmicrohttpd
LDFLAGS := -fopenmp
# DEBUG=1: no optimisation, asserts on, and ARSERVE_DEBUG (a KV plan overrun
# aborts the daemon). A release build turns the asserts off (NDEBUG), as
# engine/backend/backend.h says; sanitizer builds, which are test builds, keep them.
ifeq ($(DEBUG),1)
CFLAGS  += -O0 -g -DARSERVE_DEBUG
ASSERTS := on
else ifneq ($(SANITIZER),)
CFLAGS  += -O2 -g
ASSERTS := on
else
CFLAGS  += -O2 -g -DNDEBUG
ASSERTS := off
endif
ifeq ($(SANITIZER),)
CFLAGS      += -DARSERVE_JEMALLOC
SERVER_LIBS += -ljemalloc
endif
ifneq ($(SANITIZER),)
CFLAGS  += -fsanitize=$(SANITIZER) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SANITIZER)
endif
ifeq ($(CI),true)
CFLAGS  += -Werror
endif
# ThreadSanitizer leaves the CPU kernels (kernels/cpu/) uninstrumented: they
# are arithmetic on buffers the engine hands them, one OpenMP thread each in
# the TSan pass (a race inside one cannot happen there), and instrumenting
# every load and store of the GEMMs made a generation 1.8 times slower (2.5
# on the slow model), the TSan integration pass 154 s against 81 s. The
# engine, server and scheduler code that hands the buffers between threads
# stays instrumented.
ifeq ($(SANITIZER),thread)
$(BUILD)/kernels/cpu/%.o: CFLAGS += -fno-sanitize=thread
endif
# AddressSanitizer checks the CPU kernels for overflows (in the unit tests:
# the daemon links them plain, DAEMON_ENGINE_LIB below) but not for a stack
# variable used after its block ends (-fsanitize-address-use-after-scope, on
# by default, marks a block's locals live and dead in the shadow each time
# the block is entered and left; the kernels' blocks are their inner loops).
# That check alone made an image 2-2.5x slower under AddressSanitizer
# (models/shapes 3.6 s against 1.4-1.9 s, `arserve generate --threads 1`),
# the sanitizer pass's daemon suite 526 s against 236 s on one worker, and
# gemm_packed.c's compile 103 s of CPU against 47. No kernel hands out a
# pointer to one of its locals; the engine, server and scheduler code keeps
# the check.
ifneq ($(WITH_ASAN),)
$(BUILD)/kernels/cpu/%.o: CFLAGS += -fno-sanitize-address-use-after-scope
endif

# The engine's archive: base/ (what every floor uses), the CPU kernels
# (kernels/cpu/) and the engine's rooms (engine/ and its folders).
ENGINE_DIRS := base kernels/cpu engine engine/backend engine/family engine/format engine/kv engine/policy
ENGINE_SRC := $(foreach d,$(ENGINE_DIRS),$(wildcard $(d)/*.c))
SERVER_SRC := $(wildcard server/*.c)
CLI_SRC    := $(wildcard cli/*.c)
ENGINE_OBJ := $(filter-out $(BUILD)/engine/backend/backend_cuda.o,$(ENGINE_SRC:%.c=$(BUILD)/%.o))
SERVER_OBJ := $(SERVER_SRC:%.c=$(BUILD)/%.o) $(BUILD)/server/playground.o
CLI_OBJ    := $(CLI_SRC:%.c=$(BUILD)/%.o)
KERNEL_SRC := $(wildcard kernels/cuda/*.cu)
KERNEL_HDR := $(wildcard kernels/cuda/*.h kernels/cuda/*.cuh)

# The CUDA backend: engine/backend/backend_cuda.c (C, gcc) and kernels/cuda/*.cu (nvcc).
NVCC_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
NVCCFLAGS := -std=c++17 -O2 -g -lineinfo -I. $(NVCC_GENCODE) --threads 0 \
             -Xcompiler -Wall,-Wextra,-Wshadow,-Wno-unused-parameter
ifeq ($(CI),true)
NVCCFLAGS += -Werror all-warnings -Xcompiler -Werror
endif
# arserve links these objects directly, not through the engine archive, so
# that all of them and everything they call must link.
CUDA_OBJ :=
ifeq ($(CUDA),1)
CUDA_OBJ   := $(BUILD)/engine/backend/backend_cuda.o $(KERNEL_SRC:%.cu=$(BUILD)/%.o)
CFLAGS     += -DARSERVE_CUDA -I$(CUDA_HOME)/include
ifeq ($(KIT),1)
# DT_RPATH (not RUNPATH): it serves the libraries' own dependencies too.
# cuBLAS is the GPU machine's (tests/gpu/run.sh finds it and links it in).
LDFLAGS    += -Wl,-rpath,'$$ORIGIN/../lib' -Wl,--disable-new-dtags
LDLIBS     += -L$(CUDA_HOME)/lib64 -lcublas -lcudart_static -ldl -lrt -lstdc++
else
LDLIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++
endif
endif

# The same backend and kernels built against the CPU emulator of CUDA
# (tests/cuda_emu) for the conformance tests; never linked into arserve.
EMU       := $(BUILD)/emu
CXX       ?= g++
EMU_FLAGS := -O2 -g -Wall -Wextra -Wshadow -Wno-unused-parameter -fopenmp -MMD -MP \
             -Itests/cuda_emu/include -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread
ifeq ($(CI),true)
EMU_FLAGS += -Werror
endif
EMU_OBJ   := $(EMU)/cuda_emu.o $(EMU)/backend_cuda.o $(KERNEL_SRC:kernels/cuda/%.cu=$(EMU)/kernels/%.o)
ENGINE_LIB := $(BUILD)/libarengine.a
SERVER_LIB := $(BUILD)/libarserver.a
# cli/ without main(): the unit tests of the load client's and the
# simulator's parts link it.
CLI_LIB    := $(BUILD)/libarcli.a
UNIT_SRC   := $(wildcard tests/unit/test_*.c)
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
TINY_MODEL := $(BUILD)/tiny-model
SLOW_MODEL := $(BUILD)/slow-model
# The ThreadSanitizer pass's slow model: the same grid, 3 s an image under
# ThreadSanitizer where the slow model took 75 (37 s of CPU, the other core busy).
SANITIZER_SLOW_MODEL := $(BUILD)/slow-sanitizer-model
# The slow model's grid at a third of its work, for the AddressSanitizer
# pass: there it takes about what the slow model takes in a plain build.
ASAN_SLOW_MODEL := $(BUILD)/slow-asan-model
VAR_TINY_MODEL := $(BUILD)/var-tiny-model
# The next-scale model the daemon's integration tests serve: the shipped
# multiscale demo model.
VAR_MODEL  := models/shapes-var
# The text-to-image next-scale demo model (Infinity architecture).
INF_MODEL  := models/shapes-inf

.PHONY: all deps deps-debian build-and-venv venv-beside-build build-for-tests test test-parallel test-unit test-cli test-integration test-integration-release test-integration-tsan test-python \
        test-integration-asan test-sanitizers test-backend \
        test-gpu-kit gpu-kit test-dockerfile gpu-tests run eval expected-png examples clean tools-deps golden \
        format format-check info bench bench-kv bench-scale bench-serve bench-real bench-8bit bench-gemm bench-conv bench-launches help \
        playground-screenshot test-bench-smoke bench-smoke-emu bench-smoke-torch bench-smoke-targets \
        test-train-pipeline

all: info $(BUILD)/arserve

help:
	@echo "make run              build and serve MODEL (default models/shapes, the demo model) on http://HOST:PORT"
	@echo "                      (a line per stage; V=1 shows every command and its output)"
	@echo "make test             build and run every suite (format-check, test-unit, test-cli,"
	@echo "                      test-integration, test-integration-tsan, test-python, test-backend,"
	@echo "                      test-gpu-kit, test-dockerfile, test-sanitizers, test-fuzz,"
	@echo "                      test-bench-smoke: every bench target and make eval for seconds)"
	@echo "make fuzz             every libFuzzer target for FUZZ_SECONDS (600) each, then a table"
	@echo "                      of execs and coverage (tests/fuzz/); not part of make test"
	@echo "make all              build $(BUILD)/arserve (CUDA=1, SANITIZER=..., DEBUG=1, CI=true)"
	@echo "make bench            arserve against PyTorch on the same weights: images/s at batch 1"
	@echo "                      and BENCH_BATCH on 1 and 2 threads, peak RSS, the decode step's"
	@echo "                      share of the memory roofline, the daemon at concurrency 1..64;"
	@echo "                      about ten minutes, not part of make test"
	@echo "make bench-scale      images/s at batch 1 and SCALE_BENCH_BATCH on SCALE_BENCH_MODEL"
	@echo "                      ($(SCALE_BENCH_MODEL)), side by side in one run"
	@echo "make bench-kv         the KV policies side by side on KV_BENCH_MODEL ($(KV_BENCH_MODEL)):"
	@echo "                      peak KV bytes measured and planned, images admitted into one pool"
	@echo "                      and images/s (ratios to full), PSNR against full, ShapesEval"
	@echo "                      (KV_BENCH_PER_CATEGORY, KV_BENCH_THREADS, KV_BENCH_POOL_IMAGES,"
	@echo "                      KV_BENCH_WAVES); KV_BENCH_MODEL=tests/golden/llamagen_tiny (or a converted"
	@echo "                      LlamaGen c2i model) runs the raster rows on LlamaGen; a few minutes,"
	@echo "                      not part of make test"
	@echo "make bench-gemm       the Linear GEMM on packed weights against OpenBLAS and gemm_rows at"
	@echo "                      1 to 576 rows, side by side, on each instruction set (AVX2 forced"
	@echo "                      too), and the row counts where it wins on every shape"
	@echo "make bench-8bit       a Janus-Pro-1B decode step with int8 and fp8 weights against bf16,"
	@echo "                      side by side at batch 1 and 8, on AVX-512 and AVX2"
	@echo "make bench-conv       the 3x3 convolution, direct against Winograd, on the decoders' channel"
	@echo "                      counts and image sides, on each instruction set, and the crossover"
	@echo "make bench-launches   kernel launches, uploads and waits a step costs the CUDA backend"
	@echo "                      (emulator): per layer at Janus-Pro-1B's depth, per scale at VAR-d16's"
	@echo "make bench-serve      the serving sweep: arserve bench at Poisson rates against a daemon,"
	@echo "                      full, a compressed policy, an elastic range, the range with an"
	@echo "                      SLO; the simulator checked, a plot (docs/capacity.md); ten"
	@echo "                      minutes a sweep (SWEEP_ARGS=\"--sweeps 3\"), not part of make test"
	@echo "make bench-real       real sizes end to end: each released model's files at their real"
	@echo "                      shapes, converted, served; KV planned vs measured, RSS, s/image"
	@echo "                      (docs/real-scale.md; REAL_MODELS, REAL_ARGS); hours, resumable"
	@echo "make test-train-pipeline  the demo models' training pipeline at its tiny size, stopped"
	@echo "                      and resumed (tools/train/pipeline.py; part of make test)"
	@echo "make eval             ShapesEval of MODEL: the 300 standard prompts generated and scored"
	@echo "                      (EVAL_ARGS, e.g. EVAL_ARGS=\"--limit 48\"; images in $(BUILD)/eval)"
	@echo "make expected-png     remake the PNG the shipped-model test expects (after retraining)"
	@echo "make examples         remake the README's pictures of the demo models (docs/examples/)"
	@echo "                      and print how many of seeds 1..8 ShapesEval counts right"
	@echo "make playground-screenshot  remake docs/playground.png, the README's picture of GET /"
	@echo "                      (the playground test's compare mode in headless Chromium)"
	@echo "make deps             install the Debian packages and the .venv the build and tests need"
	@echo "make golden           regenerate the golden data (torch, in .venv-tools)"
	@echo "make gpu-kit          the GPU kit in $(KIT_DIR) (.tar.xz): prebuilt CUDA binaries, their"
	@echo "                      libraries and test models for tests/gpu/run.sh --kit on a bare GPU machine"
	@echo "make format           clang-format the C, CUDA and headers (format-check: only check)"
	@echo "make clean            remove the build folders"

info:
	@echo "arserve build: backends cpu$(if $(filter 1,$(CUDA)),+cuda ($(NVCC)$(comma) archs $(CUDA_ARCHS)),), DEBUG=$(DEBUG), SANITIZER=$(if $(SANITIZER),$(SANITIZER),none), asserts $(ASSERTS)$(if $(filter true,$(CI)), -Werror,), in $(BUILD)/"

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# The SiLU loops vectorise only where a float comparison may be evaluated
# for every lane: nothing here reads the floating-point exception flags.
%kernels/cpu/vec_math.o: CFLAGS += -fno-trapping-math

# The Winograd transforms are loops over a panel's 16 tiles, which -O2's
# cheap vectoriser leaves scalar.
%kernels/cpu/conv_winograd.o: CFLAGS += -O3

# The playground page GET / serves, built into the binary: the assembler
# includes server/playground.html (server/playground.S).
$(BUILD)/server/playground.o: server/playground.S server/playground.html
	@mkdir -p $(dir $@)
	$(CC) -I. -c $< -o $@

$(BUILD)/kernels/cuda/%.o: kernels/cuda/%.cu $(KERNEL_HDR)
	@mkdir -p $(dir $@)
	@[ -x "$(NVCC)" ] || command -v "$(NVCC)" >/dev/null || { \
		echo "CUDA=1: nvcc not found at $(NVCC); install the CUDA 13 toolkit or set CUDA_HOME or NVCC"; exit 1; }
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(EMU)/cuda_emu.o: tests/cuda_emu/cuda_emu.cpp
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(EMU_FLAGS) -c $< -o $@

$(EMU)/kernels/%.o: kernels/cuda/%.cu
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(EMU_FLAGS) -x c++ -c $< -o $@

$(EMU)/backend_cuda.o: engine/backend/backend_cuda.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE $(EMU_FLAGS) -c $< -o $@

$(ENGINE_LIB): $(ENGINE_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SERVER_LIB): $(SERVER_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(CLI_LIB): $(filter-out $(BUILD)/cli/main.o,$(CLI_OBJ))
	@rm -f $@
	ar rcs $@ $^

# The unit tests are where AddressSanitizer checks the kernels (their own
# tests, the backend's on edge shapes, every family's goldens): an
# AddressSanitizer build's arserve, kv_bench and speed_bench, which the daemon
# suite and test-cli run on the demo models, link DAEMON_ENGINE_LIB, the
# engine with the CPU kernels built without the sanitizers (PLAIN_KERNEL_OBJ,
# in $(BUILD)/plain/); the engine, server and scheduler code around them stays
# instrumented (tests/cli/test_asan_kernels.sh reads both kinds off the
# binaries). An image of models/shapes took 1.7-2.3 s with the kernels
# instrumented, 1.42 s with UndefinedBehaviorSanitizer alone in them, 0.77 s
# with them plain (0.44 s on the release build; `arserve generate --threads
# 1`); the daemon suite alone 128 s (219 s of CPU) against 81 s (121 s),
# test-cli 80 s against 47 s. Every other build links ENGINE_LIB.
PLAIN_KERNEL_OBJ  :=
DAEMON_ENGINE_LIB := $(ENGINE_LIB)
ifneq ($(WITH_ASAN),)
PLAIN_KERNEL_OBJ  := $(patsubst %.c,$(BUILD)/plain/%.o,$(wildcard kernels/cpu/*.c))
DAEMON_ENGINE_LIB := $(BUILD)/libarengine-plain-kernels.a
$(BUILD)/plain/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -fsanitize=%,$(CFLAGS)) -c $< -o $@

$(DAEMON_ENGINE_LIB): $(filter-out $(BUILD)/kernels/cpu/%,$(ENGINE_OBJ)) $(PLAIN_KERNEL_OBJ)
	@rm -f $@
	ar rcs $@ $^
endif
# Unit tests whose kernels test-cli checks are instrumented, beside the
# binaries whose kernels must not be (tests/cli/test_asan_kernels.sh).
ASAN_KERNEL_TESTS := $(if $(PLAIN_KERNEL_OBJ),$(addprefix $(BUILD)/tests/,test_gemm_packed test_backend_cpu \
                                                                          test_golden_infinity))

# The binary: cli/ (the subcommands) over server/ over engine/.
$(BUILD)/arserve: $(CLI_OBJ) $(CUDA_OBJ) $(SERVER_LIB) $(DAEMON_ENGINE_LIB)
	$(CC) $(LDFLAGS) -o $@ $^ $(SERVER_LIBS) $(LDLIBS)

# The daemon with a deliberate leak: the same objects as arserve, plus
# tests/integration/arserve_leaky.c, which wraps sched_job_release (the
# linker's --wrap) to lose TEST_LEAK_BYTES per generation. The soak test runs
# its RSS-growth check on it too, and the check must fail it.
TEST_LEAK_BYTES := 262144
$(BUILD)/leaky/arserve_leaky.o: tests/integration/arserve_leaky.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DARSERVE_TEST_LEAK_BYTES=$(TEST_LEAK_BYTES) -c -o $@ $<

$(BUILD)/arserve-leaky: LDFLAGS += -Wl,--wrap=sched_job_release
$(BUILD)/arserve-leaky: $(CLI_OBJ) $(BUILD)/leaky/arserve_leaky.o $(SERVER_LIB) $(ENGINE_LIB)
	$(CC) $(LDFLAGS) -o $@ $^ $(SERVER_LIBS) $(LDLIBS)

# test_step_allocs counts the engine's allocations through the linker's wraps.
$(BUILD)/tests/test_step_allocs: LDFLAGS += -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=aligned_alloc
# test_scheduler plants drawing failures through a wrap of gen_draw, and slows
# engine iterations through one of batcher_step.
$(BUILD)/tests/test_scheduler: LDFLAGS += -Wl,--wrap=gen_draw,--wrap=batcher_step
$(BUILD)/tests/%: tests/unit/%.c $(CLI_LIB) $(SERVER_LIB) $(ENGINE_LIB) tests/test.h tests/test_backend.h \
                  tests/unit/kv_plan_run.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(CLI_LIB) $(SERVER_LIB) $(ENGINE_LIB) $(SERVER_LIBS) $(LDLIBS)

# Debian packages the build and tests need; installed only when missing.
DEB_PKGS := gcc make libopenblas-dev libcjson-dev libpng-dev libmicrohttpd-dev libjemalloc-dev libpcre2-dev \
            python3 python3-venv prometheus curl clang-format systemd nginx wrk clang libclang-rt-14-dev \
            zzuf socat chromium chromium-driver
deps: $(VENV)/.stamp

# QUIET=1 (make run's stages): a stage's tools write into a log under
# $(BUILD)/, printed with the stage named only when the stage fails; its
# recipe lines read `$(log_open) COMMANDS $(call logged,STAGE,LOG)`. Without
# QUIET both are empty: the commands as they are, their output as it comes.
ifeq ($(QUIET),1)
log_open := {
logged    = ; } >>$(2) 2>&1 || { echo "make run: $(1) failed; its output ($(2)):"; cat $(2); exit 1; } >&2
else
log_open :=
logged   :=
endif
DEPS_LOG := $(BUILD)/deps-debian.log
VENV_LOG := $(BUILD)/venv.log

# The Debian packages alone (make test's first stage: the build needs them, the
# venv is made beside the build). One dpkg-query for all of them (10 ms; a
# dpkg -s each took 220).
deps-debian:
	@installed=" $$(dpkg-query -W -f='$${Package} $${db:Status-Status}\n' $(DEB_PKGS) 2>/dev/null | \
		awk '$$2 == "installed" { printf "%s ", $$1 }')"; \
	missing=$$(for p in $(DEB_PKGS); do case "$$installed" in *" $$p "*) ;; *) echo $$p;; esac; done); \
	if [ -n "$$missing" ]; then \
		echo "$(if $(filter 1,$(QUIET)),make run: installing Debian packages (apt-get$(comma) once):,installing Debian packages:)" $$missing; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$(if $(filter 1,$(QUIET)),mkdir -p $(BUILD) && rm -f $(DEPS_LOG);) \
		$(log_open) $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing \
		$(call logged,installing Debian packages,$(DEPS_LOG)); \
	$(if $(filter 1,$(QUIET)),else echo "make run: Debian packages: all $(words $(DEB_PKGS)) installed";) \
	fi

# The venvs install without compiling every module pip writes (--no-compile:
# torch alone has 9,000, 45 s of a 2-core machine's CPU; the test venv's 14 s);
# the warm-up import after it compiles, once, the modules the tests import,
# which PYTHONDONTWRITEBYTECODE (set on some machines) would otherwise have
# every run compile again.
PIP_INSTALL = pip install -q --disable-pip-version-check --no-compile
PY_WARM     = env -u PYTHONDONTWRITEBYTECODE
$(VENV)/.stamp: tests/requirements.txt | deps-debian
	$(if $(filter 1,$(QUIET)),@mkdir -p $(BUILD) && rm -f $(VENV_LOG))
	@$(log_open) [ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV) || { \
		echo "python3 -m venv failed; installing python3-venv"; \
		apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); } \
		$(call logged,the Python venv $(VENV),$(VENV_LOG))
	$(log_open) $(VENV)/bin/$(PIP_INSTALL) -r tests/requirements.txt$(call logged,pip install into $(VENV),$(VENV_LOG))
	$(log_open) $(PY_WARM) $(VENV)/bin/python -c 'import pytest, xdist, pytest_timeout, openai, httpx, numpy, PIL.Image, yaml, \
	    selenium.webdriver, locust.main, kubernetes_validate, jsonschema'$(call logged,importing $(VENV)'s packages,$(VENV_LOG))
	@touch $@

# The tiny random model used by tests, made from a fixed seed.
$(TINY_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --seed 1 --out $(TINY_MODEL)

# The tiny random next-scale model (VAR architecture, scales 1, 2, 3, 4),
# from a fixed seed: the planner's property test runs it too.
$(VAR_TINY_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset var-tiny --seed 1 --out $(VAR_TINY_MODEL)

# The same architecture, larger: a second or two per image, so the daemon's
# integration tests can catch requests while they run.
$(SLOW_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset slow --seed 1 --out $(SLOW_MODEL)

$(SANITIZER_SLOW_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset slow-sanitizer --seed 1 --out $(SANITIZER_SLOW_MODEL)

$(ASAN_SLOW_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset slow-asan --seed 1 --out $(ASAN_SLOW_MODEL)

# Every suite, one stage after another (tests/run_stages.sh stops at the
# first that fails and ends with each stage's seconds). The suites that bound
# no time (no daemon answering against the clock) run as one stage,
# test-parallel, beside each other under one make: one after another they
# left a core idle much of the time (one test binary, one script, one fuzzer
# at a time): 550 s in a fresh clone on a 2-core AVX2 machine, against 383 s
# beside each other with both cores busy (the fuzz build and the launch smoke
# trimmed too). The integration passes, whose time bounds are the machine's
# speed measured as they start (tests/machine_speed.py), each have the
# machine to themselves. Longest first, so that make starts them first.
TEST_PARALLEL := test-backend test-bench-smoke test-gpu-kit test-fuzz test-cli test-python test-unit \
                 test-dockerfile
TEST_STAGES   := deps-debian format-check build-and-venv test-parallel test-integration-release \
                 test-integration-tsan test-sanitizers
test-parallel: $(TEST_PARALLEL)
# The test venv (pip, one core, about a minute) beside the build of the
# daemon and of the suites' binaries (TEST_BINS, at the end of this file):
# the venv in a make of its own, which holds a job slot from its start. In
# the same make as the build, make reached the venv only once it had started
# every compile (the Debian check before it running, it went on to the next
# prerequisites), and a core then sat idle for the minute pip took.
build-and-venv: venv-beside-build build-for-tests
venv-beside-build:
	+@$(MAKE) --no-print-directory $(VENV)/.stamp
# OpenMP's threads sleep when they wait (libgomp spins first by default): with
# more threads than cores, a spinning thread takes the core another suite's
# thread is waiting for. The same in the stages whose daemons and tests run
# beside each other (two pytest workers, the sanitizer stage's three suites).
test-parallel test-integration-release test-sanitizers: export OMP_WAIT_POLICY = passive
test:
	@tests/run_stages.sh "$(MAKE)" $(TEST_STAGES)

# The CUDA emulator's own tests, then every op of the CUDA backend (under
# the emulator) against the CPU backend, the models end to end and the
# goldens, steps captured into graphs (the default); then the end-to-end
# suite again op by op (ARSERVE_TEST_GRAPHS=off; test_backend_ops compares
# a step as a graph with the same step op by op, and the rest of the suites
# pass either way, ARSERVE_TEST_GRAPHS=off make test-backend, at a minute
# more than make test should spend on it).
$(BUILD)/tests/test_emu: tests/cuda_emu/test_emu.cpp $(EMU)/cuda_emu.o $(EMU)/kernels/launch.o \
                        tests/test.h
	@mkdir -p $(dir $@)
	$(CXX) -std=c++17 $(EMU_FLAGS) -o $@ $< $(EMU)/cuda_emu.o $(EMU)/kernels/launch.o -lopenblas

$(BUILD)/tests/test_backend_ops: tests/backend/test_backend_ops.c $(EMU_OBJ) $(ENGINE_LIB) tests/test.h tests/test_backend.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(ENGINE_LIB) $(LDLIBS) -lstdc++

# The tiny model generating the same tokens on the CPU backend and on the
# CUDA backend under the emulator, for the full cache and every policy, K and
# V in f32, bf16, f16 and fp8, tie-tolerant (tests/lockstep.h); under the
# emulator (ARSERVE_TEST_CUDA_EMU) the guided logits' gap is held too.
# Passive OpenMP waits: the CPU backend's and the emulator's thread teams
# take turns thousands of times a second, and spinning idle threads made
# the end-to-end test 40x slower on a 2-core machine (2 min against 3 s).
$(BUILD)/tests/test_backend_e2e: tests/backend/test_backend_e2e.c $(EMU_OBJ) $(ENGINE_LIB) tests/test.h \
                                  tests/test_backend.h tests/lockstep.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DARSERVE_TEST_CUDA_EMU $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(ENGINE_LIB) $(LDLIBS) -lstdc++

# The shipped models (models/shapes, models/shapes-var) on the CUDA backend
# under the emulator against the CPU backend, tie-tolerant, and the largest
# pixel difference of their images. A GPU runs every policy of both; make
# test the full cache of models/shapes (the raster policies run on the tiny
# model in test_backend_e2e) and of models/shapes-var, HeatKV (compaction)
# and AMS-KV (key mass): 30 s on a 2-core AVX2 machine, 23 of them
# models/shapes, whose int8 weights the CUDA backend widens every step.
TEST_MODELS := models/shapes=full models/shapes-var=full,heatkv,amskv
$(BUILD)/tests/test_backend_models: tests/backend/test_backend_models.c $(EMU_OBJ) $(ENGINE_LIB) \
                                     tests/test.h tests/test_backend.h \
                                     tests/lockstep.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DARSERVE_TEST_CUDA_EMU $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(ENGINE_LIB) $(LDLIBS) -lstdc++

# The daemon's scheduler and HTTP front on loopback serving the tiny model on
# the CUDA backend under the emulator: a device fault planted in a launch
# turns /health and /ready to 503 with the CUDA error, and the health gauge to 0.
$(BUILD)/tests/test_backend_health: tests/backend/test_backend_health.c $(EMU_OBJ) $(CLI_LIB) \
                                    $(SERVER_LIB) $(ENGINE_LIB) tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(CLI_LIB) $(SERVER_LIB) $(ENGINE_LIB) \
	    $(SERVER_LIBS) $(LDLIBS) -lstdc++

# ARSERVE_CUDA_CHECK=1 naming the op where a fault planted in the emulator
# (as late as a GPU reports one) happened.
$(BUILD)/tests/test_backend_cuda_check: tests/backend/test_backend_cuda_check.c $(EMU_OBJ) \
                                        $(ENGINE_LIB) tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(ENGINE_LIB) $(LDLIBS) -lstdc++

# The golden tests of Janus, LlamaGen and VAR on the CUDA backend under the
# emulator (ARSERVE_TEST_BACKEND=cuda): the same sources as the unit tests,
# with ARSERVE_TEST_CUDA_EMU so that tests/test_backend.h opens the emulated
# backend.
EMU_GOLDEN := $(BUILD)/tests/emu/test_golden $(BUILD)/tests/emu/test_golden_llamagen \
              $(BUILD)/tests/emu/test_golden_var $(BUILD)/tests/emu/test_golden_infinity
$(EMU_GOLDEN): $(BUILD)/tests/emu/%: tests/unit/%.c $(EMU_OBJ) $(SERVER_LIB) $(ENGINE_LIB) tests/test.h \
               tests/test_backend.h tests/unit/kv_plan_run.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DARSERVE_TEST_CUDA_EMU $(LDFLAGS) -o $@ $< $(EMU_OBJ) $(SERVER_LIB) $(ENGINE_LIB) \
	    $(SERVER_LIBS) $(LDLIBS) -lstdc++

test-backend: $(BUILD)/tests/test_emu $(BUILD)/tests/test_backend_ops $(BUILD)/tests/test_backend_e2e \
              $(BUILD)/tests/test_backend_health $(BUILD)/tests/test_backend_cuda_check \
              $(BUILD)/tests/test_backend_models $(EMU_GOLDEN) $(TINY_MODEL)/arserve.json
	OMP_WAIT_POLICY=passive ARSERVE_TINY_MODEL=$(TINY_MODEL) ARSERVE_TEST_MODELS="$(TEST_MODELS)" tests/run_unit.sh \
	    $(filter-out $(EMU_GOLDEN),$(filter $(BUILD)/tests/%,$^))
	OMP_WAIT_POLICY=passive ARSERVE_TEST_BACKEND=cuda tests/run_unit.sh $(EMU_GOLDEN)
	OMP_WAIT_POLICY=passive ARSERVE_TINY_MODEL=$(TINY_MODEL) ARSERVE_TEST_GRAPHS=off tests/run_unit.sh \
	    $(BUILD)/tests/test_backend_e2e

# With CUDA=1: the conformance suite, the end-to-end test and the golden
# tests linked against the real kernels and CUDA runtime instead of the
# emulator (tests/gpu/run.sh runs them on a GPU).
GPU_GOLDEN := $(BUILD)/tests/gpu/test_golden $(BUILD)/tests/gpu/test_golden_llamagen \
              $(BUILD)/tests/gpu/test_golden_var $(BUILD)/tests/gpu/test_golden_infinity
GPU_TESTS := $(BUILD)/tests/gpu/test_backend_ops $(BUILD)/tests/gpu/test_backend_e2e \
             $(BUILD)/tests/gpu/test_backend_models $(GPU_GOLDEN)
$(BUILD)/tests/gpu/test_backend_%: tests/backend/test_backend_%.c $(CUDA_OBJ) $(ENGINE_LIB) tests/test.h tests/lockstep.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(CUDA_OBJ) $(ENGINE_LIB) $(LDLIBS)

$(GPU_GOLDEN): $(BUILD)/tests/gpu/%: tests/unit/%.c $(CUDA_OBJ) $(SERVER_LIB) $(ENGINE_LIB) tests/test.h \
        tests/test_backend.h tests/unit/kv_plan_run.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(CUDA_OBJ) $(SERVER_LIB) $(ENGINE_LIB) $(SERVER_LIBS) $(LDLIBS)

gpu-tests:
	@[ "$(CUDA)" = 1 ] || { echo "gpu-tests: build with CUDA=1"; exit 1; }
	$(MAKE) $(GPU_TESTS)

# The GPU kit: what `tests/gpu/run.sh --kit` runs on a GPU machine that has
# the NVIDIA driver, cuBLAS and python3 but none of our Debian libraries, no
# network and no time to build. arserve, the speed bench and the GPU test
# binaries built with CUDA=1 KIT=1 (stripped), the shared libraries they
# need, the tiny test models and a manifest with checksums, in $(KIT_DIR),
# packed into $(KIT_DIR).tar.xz, which is what travels
# (tests/gpu/make_kit.sh). Two makes one after the other: under -j,
# gpu-tests' own make would build the engine's archive beside the first
# goal's, two ar writing one file.
KIT_DIR   := $(BUILD)/gpu-kit
KIT_BUILD := $(BUILD)/gpu-kit-build
gpu-kit: $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json
	tests/gpu/seed_kit_objects.sh $(BUILD) $(KIT_BUILD)
	$(MAKE) CUDA=1 KIT=1 BUILD=$(KIT_BUILD) all
	$(MAKE) CUDA=1 KIT=1 BUILD=$(KIT_BUILD) gpu-tests $(KIT_BUILD)/speed_bench
	CUDA_ARCHS="$(CUDA_ARCHS)" tests/gpu/make_kit.sh $(KIT_BUILD) $(KIT_DIR) $(TINY_MODEL) $(VAR_TINY_MODEL)

# The kit built with warnings as errors (nvcc's included), so a CUDA change
# that does not compile or link fails here, on machines without a GPU too;
# then checked: self-contained (also run with this machine's copies of its
# libraries hidden), and `run.sh --kit` run here, where it must pass its
# preflight's library check and skip for want of a GPU (tests/gpu/test_kit.sh).
test-gpu-kit: $(BUILD)/arserve $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json
	$(MAKE) CI=true gpu-kit
	tests/gpu/test_kit.sh $(KIT_DIR) $(BUILD)/arserve

# The Dockerfile's structure and that everything it copies exists (Docker
# itself cannot run here).
test-dockerfile:
	tests/cli/test_dockerfile.sh Dockerfile

# The unit, CLI and integration tests again on one build with
# AddressSanitizer (leak checks included) and UndefinedBehaviorSanitizer.
ASAN_BUILD := $(BUILD)-asan
test-sanitizers:
	$(MAKE) SANITIZER=address,undefined BUILD=$(ASAN_BUILD) test-unit test-cli test-integration-asan

# The golden models' int8 and fp8 copies (tools/quantize.py) that
# test_weights_8bit holds to the originals' logits.
GOLDEN8        := $(BUILD)/golden8
GOLDEN8_MODELS := janus_tiny janus_tiny_bf16 llamagen_tiny var_tiny infinity_tiny
GOLDEN8_STAMPS := $(foreach m,$(GOLDEN8_MODELS),$(foreach t,int8 fp8,$(GOLDEN8)/$(m)-$(t)/arserve.json))
$(GOLDEN8)/%/arserve.json: tools/quantize.py tools/convert/quant.py tools/convert/ckpt.py $(VENV)/.stamp
	$(VENV)/bin/python tools/quantize.py tests/golden/$(call golden8_model,$*) $(@D) \
		--dtype $(lastword $(subst -, ,$*)) --force >/dev/null
golden8_model = $(patsubst %-int8,%,$(patsubst %-fp8,%,$(1)))

# tests/run_unit.sh runs the binaries UNIT_JOBS at a time (the cores by
# default): on a 2-core AVX2 machine the AddressSanitizer build's suite alone
# took 38 s against 68 s one at a time (72 s of CPU against 82).
test-unit: $(UNIT_BIN) $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json $(GOLDEN8_STAMPS)
	ARSERVE_TINY_MODEL=$(TINY_MODEL) ARSERVE_VAR_TINY_MODEL=$(VAR_TINY_MODEL) \
		ARSERVE_W8_GOLDEN=$(GOLDEN8) tests/run_unit.sh $(UNIT_BIN)


test-cli: $(BUILD)/arserve $(BUILD)/kv_bench $(BUILD)/speed_bench $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json \
          $(VENV)/.stamp $(ASAN_KERNEL_TESTS)
	tests/cli/test_cli.sh $(BUILD)/arserve $(TINY_MODEL)
	tests/cli/test_plan.sh $(BUILD)/arserve $(TINY_MODEL) $(VAR_TINY_MODEL)
	tests/cli/test_calibrate.sh $(BUILD)/arserve $(VAR_TINY_MODEL) $(TINY_MODEL) tests/golden/infinity_tiny
	tests/cli/test_simulate.sh $(BUILD)/arserve $(TINY_MODEL) $(VAR_TINY_MODEL) $(VENV)/bin/python
	tests/cli/test_kv_bench.sh $(BUILD)/kv_bench $(TINY_MODEL) $(VENV)/bin/python $(VAR_MODEL) \
		$(INF_MODEL) $(if $(SANITIZER),sanitizer)
	tests/cli/test_speed_bench.sh $(BUILD)/speed_bench $(TINY_MODEL) $(VAR_TINY_MODEL) $(VENV)/bin/python
	tests/cli/test_test_only_api.sh $(CC) $(filter-out -MMD -MP,$(CFLAGS))
	$(if $(ASAN_KERNEL_TESTS),tests/cli/test_asan_kernels.sh $(BUILD) $(ASAN_KERNEL_TESTS))

# Python tools' tests (numpy, Pillow; no torch): the shapes renderer, the
# ShapesEval scorer and runner, the shipped model (models/shapes) drawing
# its expected PNG and passing a small ShapesEval with build/arserve, the
# README's pictures of the demo models and their counts (make examples), the
# benches beside the official code without it (speed_bench for their batches), and
# deploy/ (manifests against Kubernetes' schemas, the model loader). A file
# to a worker (--dist loadfile): the ShapesEval run is a module's fixture, made
# on every worker that runs one of its tests (twice, 7 s each, with --dist load).
test-python: $(BUILD)/arserve $(BUILD)/speed_bench $(SLOW_MODEL)/arserve.json $(VENV)/.stamp
	ARSERVE_BIN=$(BUILD)/arserve ARSERVE_SLOW_MODEL=$(SLOW_MODEL) $(VENV)/bin/python -m pytest -q -rP -n 2 --dist loadfile tests/python

# Every bench target the suites above do not run, for seconds each, through its
# own recipe (tests/cli/test_bench_smoke.sh): make bench on the demo model, its
# torch side included (torch for the CPU, .venv-bench: about 50 s to install
# the first time), make bench-kv, bench-scale and bench-serve on the tiny
# models, bench-gemm, and make eval on six prompts; each one's table or JSON
# is checked. The torch side's sampler against the engine's rules too
# (tests/bench/test_sample_next.py), the speed bench on the CUDA backend
# under the emulator: launches, copies and peak device memory per step
# (tests/cli/test_speed_bench_emu.sh), and the GPU run's timing stage end to
# end at toy shapes on the CPU (tests/bench/test_gpu_bench.py:
# bench/gpu_bench.py --small --backend cpu, about 20 s), and the training
# pipeline at its tiny size (test-train-pipeline, below).
# make reaches the script through SMOKE_MAKE, not $(MAKE) in the recipe
# itself, so that `make -n` does not run the script (it runs any recipe line
# that names $(MAKE)).
# Three parts, which make -j runs beside each other: the emulator's (no torch)
# while the torch side's virtual environment installs (95 s on a 2-core AVX2
# machine, the first time), then the torch side's tests beside the bench
# targets' smoke runs.
SMOKE_MAKE = $(MAKE)
SMOKE_DEPS = $(BUILD)/arserve $(BUILD)/speed_bench $(BUILD)/kv_bench $(BUILD)/gemm_bench $(BUILD)/conv_bench \
             $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json $(VENV)/.stamp $(BENCH_CPU_VENV)/.stamp
test-bench-smoke: bench-smoke-emu bench-smoke-torch bench-smoke-targets
bench-smoke-emu: $(BUILD)/speed_bench-emu $(TINY_MODEL)/arserve.json $(VAR_TINY_MODEL)/arserve.json $(VENV)/.stamp
	tests/cli/test_speed_bench_emu.sh $(BUILD)/speed_bench-emu $(TINY_MODEL) $(VENV)/bin/python \
	    $(VAR_TINY_MODEL)
	$(SMOKE_MAKE) -s bench-launches LAUNCH_DEEP_MODEL=$(SMOKE_DEPTH_MODEL) \
	    LAUNCH_COUNTS_ARGS="--modes bf16 --graphs on --batch 2 \
	    --next-scale $(VAR_TINY_MODEL) --next-scale-batch 2"
bench-smoke-torch: $(SMOKE_DEPS)
	$(BENCH_CPU_VENV)/bin/python tests/bench/test_sample_next.py
	$(BENCH_CPU_VENV)/bin/python tests/bench/test_reference_dtype.py
	$(BENCH_CPU_VENV)/bin/python tests/bench/test_gpu_bench.py $(BUILD)
	OMP_NUM_THREADS=1 $(BENCH_CPU_VENV)/bin/python tests/python/test_train_pipeline.py $(BUILD)/arserve
	OMP_NUM_THREADS=1 $(BENCH_CPU_VENV)/bin/python tests/python/test_train_inf.py $(BUILD)/arserve
bench-smoke-targets: $(SMOKE_DEPS)
	tests/cli/test_bench_smoke.sh "$(SMOKE_MAKE)" $(TINY_MODEL) $(VAR_TINY_MODEL) $(VENV)/bin/python

# The demo models' training pipeline (tools/train/pipeline.py) at its --tiny
# size on the CPU, one thread: both models from nothing to a model directory,
# a run stopped by --max-minutes and run again resuming from its checkpoint to
# the same weights as an unbroken run, bad flags refused, each tiny model
# drawing an image with build/arserve. torch, so the bench venv; about 25 s on
# a busy 2-core machine. make test runs it in bench-smoke-torch.
test-train-pipeline: $(BUILD)/arserve $(BENCH_CPU_VENV)/.stamp
	OMP_NUM_THREADS=1 $(BENCH_CPU_VENV)/bin/python tests/python/test_train_pipeline.py $(BUILD)/arserve

# The daemon, started for real on loopback ports (tests/integration/, pytest):
# the OpenAI client, bad requests, batching, 429s, disconnects, drains,
# streaming, Prometheus scraping it, and `make run`. Its tests mostly wait on
# daemons, so INTEGRATION_WORKERS pytest-xdist workers run them, a file each
# at a time (the sanitizer passes too); every time bound is scaled by the
# machine's speed measured with that many generating at once.
INTEGRATION_WORKERS ?= 2
INTEGRATION_SELECT  ?=
test-integration: all $(BUILD)/arserve-leaky $(TINY_MODEL)/arserve.json $(SLOW_MODEL)/arserve.json \
                  $(VENV)/.stamp
	ARSERVE_BIN=$(BUILD)/arserve ARSERVE_LEAKY_BIN=$(BUILD)/arserve-leaky ARSERVE_TINY_MODEL=$(TINY_MODEL) \
		ARSERVE_SLOW_MODEL=$(SLOW_MODEL) ARSERVE_VAR_MODEL=$(VAR_MODEL) \
		$(VENV)/bin/python -m pytest -q tests/integration -n $(INTEGRATION_WORKERS) --dist loadfile \
		$(INTEGRATION_SELECT)

# make test's release pass: what the sanitizer passes below leave out (the
# soak, the external clients, the release_build suites; 80 s against 145 s for
# the whole suite on a 2-core machine). Every other integration test runs on
# the AddressSanitizer + UndefinedBehaviorSanitizer build (test-sanitizers),
# which answers for the same code paths and more; `make test-integration`
# still runs all of them on this build.
test-integration-release:
	$(MAKE) INTEGRATION_SELECT='-m "soak or clients or release_build"' test-integration

# The README's picture of the playground page (GET /): the browser test's
# compare-mode screenshot, in headless Chromium against the demo model.
playground-screenshot: all deps
	ARSERVE_BIN=$(BUILD)/arserve ARSERVE_SCREENSHOT=$(CURDIR)/docs/playground.png \
		$(VENV)/bin/python -m pytest -q tests/integration/test_playground.py -k compare_mode
	@echo "wrote docs/playground.png"

# The same suite on a ThreadSanitizer build of the daemon: conftest.py fails
# a test whose daemon reported anything (and TSan's exit status fails its
# teardown too). The engine runs on one OpenMP thread (OMP_NUM_THREADS=1;
# tests that pass --threads pass 1): libgomp is not built with TSan, and its
# own synchronisation would show up as races. test_make_run.py is left out:
# `make run` builds and serves the ordinary binary, which the pass above
# has already tested. The nginx test is left out: it adds a proxy, not a code
# path the other drain tests miss, and costs a minute and a half under TSAN.
TSAN_BUILD := $(BUILD)-tsan
# The integration suite under a sanitizer: without the soak tests (RSS under a
# sanitizer means nothing), the external clients (locust, wrk, Chromium: the
# routes they drive are covered by the rest, and they cost a minute), and the
# release_build suites (make run's build, the nginx proxy, the load client, the
# docs' tables: tests/integration/pytest.ini): 80 s under ThreadSanitizer on a
# 2-core AVX2 machine for no daemon path the rest miss. The ThreadSanitizer pass leaves out the
# models' and the KV policies' suites too (TSAN_SKIP; test_model_cards runs each
# policy on each demo model, 28 s of the pass's test time): the engine runs on one
# thread there, beside the same scheduler and HTTP threads whichever model or
# policy it runs, and the AddressSanitizer pass runs them.
# Time bounds are the machine's measured speed's (tests/machine_speed.py), as
# in every pass. The ThreadSanitizer pass
# serves the sanitizer builds' slow model (the slow model's grid: 0.9 s an
# image there, the CPU kernels uninstrumented, against 0.7 s for the slow
# model on the release build); the AddressSanitizer one the slow model itself (4.5 s an
# image there; the small one's 0.8 s, its eight images in a batch 0.8 s
# together, is too quick for the tests that need a request still running).
TSAN_SKIP      = test_infinity_model test_scale_model test_llamagen_model test_token_counter \
                 test_kv_policies test_heatkv_admission test_elastic_budget test_model_cards
SANITIZED_SUITE = ARSERVE_TINY_MODEL=$(TINY_MODEL) ARSERVE_VAR_MODEL=$(VAR_MODEL) \
	$(VENV)/bin/python -m pytest -q tests/integration \
	-n $(INTEGRATION_WORKERS) --dist loadfile -m "not soak and not clients and not release_build"
# Its daemons generate on one thread and its tests mostly wait on them, so
# TSAN_WORKERS pytest workers, three: on a 2-core AVX2 machine the pass took
# 83-84 s with three against 95-99 s with two (the same CPU time) and 108 s
# with four. The other passes keep two: their daemons use every core (three
# workers: the release pass 85 s against 78, the AddressSanitizer one alone
# 126 s against 124-132).
TSAN_WORKERS ?= 3
test-integration-tsan: INTEGRATION_WORKERS = $(TSAN_WORKERS)
test-integration-tsan: $(TINY_MODEL)/arserve.json $(SANITIZER_SLOW_MODEL)/arserve.json $(VENV)/.stamp
	$(MAKE) SANITIZER=thread BUILD=$(TSAN_BUILD) all
	OMP_NUM_THREADS=1 TSAN_OPTIONS="second_deadlock_stack=1" ARSERVE_BIN=$(TSAN_BUILD)/arserve \
		ARSERVE_SLOW_MODEL=$(SANITIZER_SLOW_MODEL) $(SANITIZED_SUITE) \
		$(foreach t,$(TSAN_SKIP),--ignore=tests/integration/$(t).py)

# The suite on this build when it is a sanitizer build (test-sanitizers runs
# it on the AddressSanitizer + UndefinedBehaviorSanitizer one); conftest.py
# fails a test whose daemon wrote a report.
test-integration-asan: all $(TINY_MODEL)/arserve.json $(ASAN_SLOW_MODEL)/arserve.json $(VENV)/.stamp
	@[ -n "$(SANITIZER)" ] || { echo "test-integration-asan: run it through make test-sanitizers"; exit 1; }
	ASAN_OPTIONS="detect_leaks=1" ARSERVE_BIN=$(BUILD)/arserve ARSERVE_SLOW_MODEL=$(ASAN_SLOW_MODEL) \
		$(SANITIZED_SUITE)

# The KV policies side by side on the demo model, in one run (bench/kv_bench.py
# says what each column is): peak KV bytes per image measured and planned
# (must be equal), images admitted into one fixed pool and images/s at that
# concurrency (ratios to the full cache), PSNR against the full-cache image
# and ShapesEval accuracy, for full, streaming, linear and headkv at 1/4,
# 1/6 and 1/8 on a raster model; for full, amskv, streaming, heatkv,
# heatkv_binary and scalekv at 1/25, 1/10 and 1/5 on a next-scale one
# (KV_BENCH_MODEL=models/shapes-var); the raster rows on a LlamaGen model too, classes spread
# over its labels, no ShapesEval (KV_BENCH_MODEL=tests/golden/llamagen_tiny, or a converted
# c2i model). Not part of `make test` (test-cli runs bench/kv_bench.py on the
# tiny models, test-bench-smoke this recipe on one). KV_BENCH_PER_CATEGORY prompts of
# each ShapesEval category (6 categories); KV_BENCH_THREADS CPU threads (0:
# every core; 1 by default, steady on a shared machine, and the ratios are
# what the table is for); KV_BENCH_POOL_IMAGES full-cache images the pool
# holds; KV_BENCH_WAVES fills of the pool timed per row; KV_BENCH_OUT where
# the table, results.json and the images go; KV_BENCH_ROWS other rows than
# the defaults, POLICY:BUDGET joined by commas (docs/capacity.md's quality
# per budget: linear:1/4,linear:1/2,linear:3/4).
KV_BENCH_ROWS         ?=
KV_BENCH_MODEL        ?= models/shapes
KV_BENCH_PER_CATEGORY ?= 4
KV_BENCH_THREADS      ?= 1
KV_BENCH_POOL_IMAGES  ?= 2
KV_BENCH_WAVES        ?= 2
KV_BENCH_OUT          ?= $(BUILD)/bench-kv
$(BUILD)/kv_bench: bench/kv_bench.c $(BUILD)/cli/flags.o $(DAEMON_ENGINE_LIB)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/cli/flags.o $(DAEMON_ENGINE_LIB) $(LDLIBS)

# With CUDA=1 it links the CUDA backend, for --backend cuda on a GPU.
$(BUILD)/speed_bench: bench/speed_bench.c $(BUILD)/cli/flags.o $(CUDA_OBJ) $(DAEMON_ENGINE_LIB)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/cli/flags.o $(CUDA_OBJ) $(DAEMON_ENGINE_LIB) $(LDLIBS)

# The speed bench with the CUDA backend under the emulator (tests/cuda_emu),
# for --backend cuda without a GPU: its launches and copies per step are a
# GPU's, its times are not. backend_open is built again with the CUDA
# backend in it, ahead of the engine's archive. A test tool, like the
# emulator: not for CUDA=1 builds, which link the real runtime.
$(EMU)/backend_open.o: engine/backend/backend_open.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -DARSERVE_CUDA -c $< -o $@

$(BUILD)/speed_bench-emu: bench/speed_bench.c $(BUILD)/cli/flags.o $(EMU)/backend_open.o $(EMU_OBJ) \
                          $(ENGINE_LIB)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/cli/flags.o $(EMU)/backend_open.o $(EMU_OBJ) \
	    $(ENGINE_LIB) $(LDLIBS) -lstdc++

$(BUILD)/gemm_bench: bench/gemm_bench.c $(BUILD)/cli/flags.o $(ENGINE_LIB)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/cli/flags.o $(ENGINE_LIB) $(LDLIBS)

$(BUILD)/conv_bench: bench/conv_bench.c $(BUILD)/cli/flags.o $(ENGINE_LIB)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/cli/flags.o $(ENGINE_LIB) $(LDLIBS)

# The CPU backend's Linear GEMM on packed weights (kernels/cpu/gemm_packed.c)
# against OpenBLAS and gemm_rows at 1 to 576 rows on the served models'
# Linear shapes, side by side, on every instruction set this machine runs
# (AVX2 forced on an AVX-512 machine), and the crossovers
# (bench/gemm_bench.c). GEMM_BENCH_ARGS adds flags (--reps, --min-ms, --isa,
# --dtype bf16, --rows 576,2048 for next-scale steps' row counts). Not part
# of `make test` (test-bench-smoke runs it for seconds).
GEMM_BENCH_ARGS ?=
bench-gemm: $(BUILD)/gemm_bench
	$(BUILD)/gemm_bench $(GEMM_BENCH_ARGS)

# The CPU backend's 3x3 convolution, direct against Winograd F(2x2, 3x3), on
# the VQ decoders' channel counts and image sides, side by side, on every
# instruction set this machine runs, and the channel count from which
# Winograd wins (bench/conv_bench.c). CONV_BENCH_ARGS adds flags (--reps,
# --min-ms, --isa, --max-side). Not part of `make test` (test-bench-smoke
# runs it for seconds).
CONV_BENCH_ARGS ?=
bench-conv: $(BUILD)/conv_bench
	$(BUILD)/conv_bench $(CONV_BENCH_ARGS)

# What a step costs the CUDA backend in kernel launches, uploads and waits,
# counted under the emulator (the counts depend on the ops issued, not the
# device): the raster decode step at Janus-Pro-1B's depth against the tiny
# model's (the launches one layer adds) in both GPU activation modes, and a
# next-scale step at VAR-d16's depth and scales with batch invariance on and
# off (bench/launch_counts.py). A few minutes; test-bench-smoke runs the
# raster half in bf16 for seconds and holds a layer to 12 launches.
JANUS_DEPTH_MODEL := $(BUILD)/janus-1b-depth
VAR_DEPTH_MODEL   := $(BUILD)/var-d16-depth
$(JANUS_DEPTH_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset janus-1b-depth --seed 1 --out $(JANUS_DEPTH_MODEL)
$(VAR_DEPTH_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset var-d16-depth --seed 1 --out $(VAR_DEPTH_MODEL)
LAUNCH_COUNTS_ARGS ?= --next-scale $(VAR_DEPTH_MODEL)
# LAUNCH_DEEP_MODEL: the deep model (test-bench-smoke's is six layers deep).
LAUNCH_DEEP_MODEL ?= $(JANUS_DEPTH_MODEL)
SMOKE_DEPTH_MODEL := $(BUILD)/depth-6
$(SMOKE_DEPTH_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset depth-6 --seed 1 --out $(SMOKE_DEPTH_MODEL)
bench-launches: $(BUILD)/speed_bench-emu $(TINY_MODEL)/arserve.json $(LAUNCH_DEEP_MODEL)/arserve.json \
                $(VAR_DEPTH_MODEL)/arserve.json $(VENV)/.stamp
	$(VENV)/bin/python bench/launch_counts.py --bench $(BUILD)/speed_bench-emu \
	    --shallow $(TINY_MODEL) --deep $(LAUNCH_DEEP_MODEL) --max-per-layer 12 $(LAUNCH_COUNTS_ARGS)

# Images/s of a next-scale model at batch 1 and SCALE_BENCH_BATCH, side by
# side in one run (bench/speed_bench.c), with each scale's seconds and the
# decoder's, once per SCALE_BENCH_ACTIVATIONS (the CPU's cpu_activations:
# bf16 takes AMX tiles where the CPU has them; bf16 weights only). Not part
# of `make test` (test-bench-smoke runs it on the tiny next-scale model).
# docs/cpu-kernels.md has it on the mid-size Infinity of issue 62
# (`tools/release_shapes infinity-mid`, converted with --pn 0.25M --dtype bf16).
SCALE_BENCH_MODEL ?= models/shapes-var
SCALE_BENCH_BATCH ?= 16
SCALE_BENCH_ACTIVATIONS ?= f32 bf16
bench-scale: $(BUILD)/speed_bench
	@for a in $(SCALE_BENCH_ACTIVATIONS); do echo "cpu_activations $$a:"; \
	    $(BUILD)/speed_bench --model $(SCALE_BENCH_MODEL) --batch $(SCALE_BENCH_BATCH) \
		--images $$(( 2 * $(SCALE_BENCH_BATCH) )) --threads 1 --cpu-activations $$a || exit 1; \
	done

# arserve against PyTorch (bench/speed_bench.py says what each column is):
# images/s at batch 1 and BENCH_BATCH on BENCH_THREADS threads, the decode
# step, the VQ decode, peak RSS, the step's shares of the memory and compute rooflines,
# and the daemon on loopback at BENCH_CONCURRENCY clients, on the demo model
# and a 60M-parameter random one (against tools/train's JanusLM); then real
# architectures at reduced depth with bf16 weights and bf16 KV against their
# own PyTorch code: a Janus-Pro-shaped model against transformers' Janus
# (bench/ref_janus.py) and, when LLAMAGEN_SRC names a checkout of
# FoundationVision/LlamaGen, a LlamaGen-shaped one against its official
# classes (bench/ref_llamagen.py). About an hour on two cores. Not part of
# `make test` (test-bench-smoke runs it on the demo model for seconds).
# BENCH_TORCH=tools (the default) takes torch from .venv-tools (make
# tools-deps, transformers too); BENCH_TORCH=cpu from .venv-bench, torch
# without its CUDA wheels (below): enough for the models of tools/train.
MID_MODEL            := $(BUILD)/mid-model
JANUS_BENCH_MODEL    := $(BUILD)/bench-janus-pro
LLAMAGEN_BENCH_MODEL := $(BUILD)/bench-llamagen
LLAMAGEN_SRC         ?=
BENCH_MODELS      ?= models/shapes $(MID_MODEL) $(JANUS_BENCH_MODEL) $(if $(LLAMAGEN_SRC),$(LLAMAGEN_BENCH_MODEL))
BENCH_THREADS     ?= 1,2
BENCH_BATCH       ?= 8
BENCH_CONCURRENCY ?= 1,4,16,64
# Instruction sets, comma-separated (avx512, avx2): each row run held to one
# (bench/speed_bench.py --isa); empty, the machine's best.
BENCH_ISA         ?=
BENCH_ARGS        ?=
BENCH_JSON        ?= $(BUILD)/bench.json
BENCH_TORCH       ?= tools
ifeq ($(filter $(BENCH_TORCH),tools cpu),)
$(error BENCH_TORCH must be tools or cpu, not '$(BENCH_TORCH)')
endif
BENCH_TORCH_VENV  := $(if $(filter cpu,$(BENCH_TORCH)),$(BENCH_CPU_VENV),.venv-tools)
BENCH_TORCH_DEPS  := $(if $(filter cpu,$(BENCH_TORCH)),$(BENCH_CPU_VENV)/.stamp,tools-deps)
$(MID_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset mid --seed 1 --out $(MID_MODEL)

$(JANUS_BENCH_MODEL)/arserve.json: bench/ref_janus.py tools/convert/janus.py tests/golden/gen_golden.py | tools-deps
	.venv-tools/bin/python bench/ref_janus.py build $(JANUS_BENCH_MODEL)

$(LLAMAGEN_BENCH_MODEL)/arserve.json: bench/ref_llamagen.py tools/convert/llamagen.py | tools-deps
	LLAMAGEN_SRC=$(LLAMAGEN_SRC) .venv-tools/bin/python bench/ref_llamagen.py build $(LLAMAGEN_BENCH_MODEL)

bench: $(BENCH_TORCH_DEPS) $(BUILD)/speed_bench $(BUILD)/arserve $(filter $(BUILD)/%,$(addsuffix /arserve.json,$(BENCH_MODELS)))
	$(if $(LLAMAGEN_SRC),,@echo "bench: no LlamaGen rows: LLAMAGEN_SRC does not name a checkout of https://github.com/FoundationVision/LlamaGen")
	LLAMAGEN_SRC=$(LLAMAGEN_SRC) $(BENCH_TORCH_VENV)/bin/python bench/speed_bench.py --bin $(BUILD)/speed_bench --arserve $(BUILD)/arserve \
		$(foreach m,$(BENCH_MODELS),--model $(m)) --threads $(BENCH_THREADS) --batch $(BENCH_BATCH) \
		--images $(BENCH_BATCH) --concurrency $(BENCH_CONCURRENCY) --json $(BENCH_JSON) \
		$(if $(BENCH_ISA),--isa $(BENCH_ISA)) $(BENCH_ARGS)

# torch for the CPU (BENCH_TORCH=cpu): the PyPI wheel of torch is built for
# CUDA and pulls in 4 GB of CUDA wheels (make tools-deps: 110 to 145 s and
# 5.6 GB here, all of it downloaded each time: pip caches nothing from this
# mirror); bench/requirements-torch-cpu.txt installs it without them but for
# the four libraries it links that the CUDA toolkit lacks (about 50 s, 2.1 GB).
# Where torch does not load even so (no CUDA toolkit on the loader's path),
# pip adds the rest of its dependencies (80 s in all, the toolkit hidden).
$(BENCH_CPU_VENV)/.stamp: bench/requirements-torch-cpu.txt
	@[ -x $(BENCH_CPU_VENV)/bin/python ] || $(PYTHON) -m venv $(BENCH_CPU_VENV)
	$(BENCH_CPU_VENV)/bin/$(PIP_INSTALL) --no-deps -r bench/requirements-torch-cpu.txt
	@$(PY_WARM) $(BENCH_CPU_VENV)/bin/python -c 'import torch; torch.ones(2) @ torch.ones(2)' 2>/dev/null || { \
		echo "$(BENCH_CPU_VENV): torch does not load with this machine's CUDA libraries; installing its CUDA wheels"; \
		$(BENCH_CPU_VENV)/bin/$(PIP_INSTALL) -r bench/requirements-torch-cpu.txt; }
	$(PY_WARM) $(BENCH_CPU_VENV)/bin/python -c 'import numpy, PIL.Image, torch, safetensors.torch; \
	    from transformers import JanusForConditionalGeneration; torch.ones(2) @ torch.ones(2)'
	@touch $@

bench-kv: $(BUILD)/kv_bench $(VENV)/.stamp
	$(VENV)/bin/python bench/kv_bench.py --bin $(BUILD)/kv_bench --model $(KV_BENCH_MODEL) \
		--per-category $(KV_BENCH_PER_CATEGORY) --threads $(KV_BENCH_THREADS) \
		--pool-images $(KV_BENCH_POOL_IMAGES) --waves $(KV_BENCH_WAVES) --out $(KV_BENCH_OUT) \
		$(if $(KV_BENCH_ROWS),--rows $(KV_BENCH_ROWS))

# The serving sweep of docs/capacity.md (bench/serving_sweep.py): the cost
# table fitted on this machine, `arserve bench` over a sweep of Poisson rates
# against a daemon on loopback, in one KV pool: the full cache, a compressed
# policy, an elastic range, and the range with the SLO as each request's
# objective; the simulator checked against the compressed runs' traces, and
# the plot (docs/serving-sweep.png). About ten minutes a sweep on two cores
# (--sweeps N: N of them, medians and ranges); not part of `make test`
# (test-bench-smoke runs two sweeps on the tiny model for seconds).
# SWEEP_ARGS adds flags (python bench/serving_sweep.py --help); SWEEP_OUT and
# SWEEP_PNG say where the runs and the plot go.
SWEEP_ARGS ?=
SWEEP_OUT  ?= $(BUILD)/sweep
SWEEP_PNG  ?= docs/serving-sweep.png
bench-serve: $(BUILD)/arserve $(VENV)/.stamp
	@$(VENV)/bin/python -c 'import matplotlib' 2>/dev/null || \
		$(VENV)/bin/pip install -q --disable-pip-version-check matplotlib==3.11.2
	$(VENV)/bin/python bench/serving_sweep.py --arserve $(BUILD)/arserve --model $(MODEL) \
		--out $(SWEEP_OUT) --png $(SWEEP_PNG) $(SWEEP_ARGS)

# Real sizes end to end (bench/real_scale.py, docs/real-scale.md): each
# released model's files written at their real shapes (tools/release_shapes,
# random weights), converted in bounded memory, served at its default sizes
# with the full cache and a compressed policy; planned KV against measured,
# peak RSS against weights + pool, seconds per image. Hours on this CPU (the
# 1024 px Infinity images most), one thread, resumable: each stage's result
# is kept in REAL_WORK/results.json and a rerun goes on from there. Not part
# of make test (test-bench-smoke runs REAL_ARGS=--tiny on every model).
REAL_MODELS ?= ALL
REAL_ARGS   ?=
REAL_WORK   ?= $(BUILD)/real
REAL_DOC    ?= docs/real-scale.md
bench-real: $(BUILD)/arserve $(VENV)/.stamp
	$(VENV)/bin/python bench/real_scale.py run $(REAL_MODELS) --work $(REAL_WORK) \
		--doc $(REAL_DOC) --arserve $(BUILD)/arserve $(REAL_ARGS)

# 8-bit weights against 16-bit (bench/weights8.py): a Janus-Pro-1B release
# (random weights) converted with --dtype bf16, int8 and fp8, each model's
# decode step timed by speed_bench at batch 1 and W8_BATCH, W8_STEPS steps a
# wave, the three alternating W8_REPS times on each of W8_ISA; medians and
# speed over bf16 in a table. About 40 minutes here (the conversions 15 of
# them, kept in W8_WORK for the next run). test-bench-smoke runs W8_ARGS=--tiny.
W8_WORK    ?= $(BUILD)/weights8
W8_BATCH   ?= 8
W8_STEPS   ?= 24
W8_REPS    ?= 3
W8_THREADS ?= 1
W8_ISA     ?= avx512,avx2
W8_ARGS    ?=
bench-8bit: $(BUILD)/speed_bench $(VENV)/.stamp
	$(VENV)/bin/python bench/weights8.py --work $(W8_WORK) --bin $(BUILD)/speed_bench \
		--batch $(W8_BATCH) --steps $(W8_STEPS) --reps $(W8_REPS) --threads $(W8_THREADS) \
		$(if $(W8_ISA),--isa $(W8_ISA)) $(W8_ARGS)

# Serves MODEL on HOST:PORT: the shipped demo model unless told otherwise
# (MODEL=build/tiny-model makes and serves the tiny random one). Its screen is
# a line per stage (the Debian packages, the venv, the build, the serve
# command), then the daemon's log: the stages' makes run silent (-s: no
# command lines; the compiler's errors and warnings still show as they come)
# and QUIET=1 (apt-get's and pip's output, Python's warnings among it, into
# $(DEPS_LOG) and $(VENV_LOG), printed with the stage named when it fails).
# `make V=1 run` shows every command and all the output.
MODEL ?= models/shapes
RUN_MAKE     = $(MAKE) --no-print-directory $(if $(filter 1,$(V)),,-s QUIET=1)
RUN_MODEL   := $(if $(filter $(TINY_MODEL),$(MODEL)),$(TINY_MODEL)/arserve.json)
RUN_TARGETS := $(BUILD)/arserve $(RUN_MODEL)
RUN_SRCS    := $(words $(CLI_OBJ) $(SERVER_OBJ) $(ENGINE_OBJ) $(CUDA_OBJ))
RUN_BUILT   := $(BUILD)/arserve$(if $(RUN_MODEL), and $(TINY_MODEL))
run:
	@$(RUN_MAKE) deps-debian
	@if $(MAKE) --no-print-directory -q -o deps-debian $(VENV)/.stamp 2>/dev/null; then \
		echo "make run: Python venv $(VENV): up to date"; \
	else \
		echo "make run: Python venv $(VENV) (pip$(comma) once)..."; \
		$(RUN_MAKE) -o deps-debian $(VENV)/.stamp; \
	fi
	@plan=$$($(MAKE) --no-print-directory -s -n -o deps-debian -o $(VENV)/.stamp $(RUN_TARGETS)) || exit 1; \
	if [ -z "$$plan" ]; then \
		echo "make run: $(RUN_BUILT): up to date"; \
	else \
		n=$$(printf '%s\n' "$$plan" | grep -c -- ' -c .* -o $(BUILD)/'); \
		echo "make run: building $(RUN_BUILT) (compiling $$n of $(RUN_SRCS) files)..."; \
	fi; \
	$(RUN_MAKE) -o deps-debian -o $(VENV)/.stamp $(if $(filter 1,$(V)),all $(RUN_MODEL),$(RUN_TARGETS)) || { \
		echo "make run: building $(RUN_BUILT) failed: its errors are above (make V=1 run shows the commands)" >&2; \
		exit 1; }
	@echo "make run: serving $(MODEL): $(BUILD)/arserve serve --model $(MODEL) --host $(HOST) --port $(PORT)"
	$(if $(filter 1,$(V)),,@)exec $(BUILD)/arserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# ShapesEval of MODEL: all 300 prompts of tools/shapes_eval/prompts.jsonl
# through `arserve generate` (one process per core), then scored; images and
# numbers in EVAL_OUT ($(BUILD)/eval/). EVAL_ARGS adds runner flags, e.g.
# EVAL_ARGS='--limit 48 --images-per-prompt 2 --arserve-arg="--cfg 3"'
# (python -m tools.shapes_eval run --help).
EVAL_ARGS ?=
EVAL_OUT  ?= $(BUILD)/eval
eval: $(BUILD)/arserve $(VENV)/.stamp
	$(VENV)/bin/python -m tools.shapes_eval run --arserve $(BUILD)/arserve --model $(MODEL) \
		--out $(EVAL_OUT) --json $(EVAL_OUT)/shapes_eval.json $(EVAL_ARGS)

# The PNG tests/python/test_shipped_model.py expects models/shapes to draw;
# remake it (and commit it) when the model files change.
expected-png: $(BUILD)/arserve $(VENV)/.stamp
	$(VENV)/bin/python tools/shapes_eval/make_expected.py --arserve $(BUILD)/arserve

# The README's pictures of the demo models (docs/examples/) and the counts of
# right seeds beside them (tools/shapes_eval/examples.py); remake them when a
# model changes, then bring the README's table to the counts it prints
# (tests/python/test_readme_examples.py checks both).
examples: $(BUILD)/arserve $(VENV)/.stamp
	$(VENV)/bin/python tools/shapes_eval/examples.py --arserve $(BUILD)/arserve

# Tools that need torch/transformers (golden data, converters) live in their own venv.
tools-deps:
	@[ -x .venv-tools/bin/python ] || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/pip install -q -r tools/requirements.txt

golden: tools-deps all
	.venv-tools/bin/python tests/golden/gen_golden.py --out tests/golden

# Every C, C++ and CUDA source and header of ours, formatted by the
# repository's .clang-format; `make format-check` (part of `make test`)
# fails on any file clang-format would change.
FORMAT_SRC := $(sort $(wildcard cli/*.c cli/*.h server/*.c server/*.h \
                $(foreach d,$(ENGINE_DIRS),$(d)/*.c $(d)/*.h) \
                kernels/cuda/*.cu kernels/cuda/*.h kernels/cuda/*.cuh bench/*.c tests/*.h tests/unit/*.c \
                tests/backend/*.c tests/integration/*.c tests/fuzz/*.c tests/fuzz/*.h tests/cuda_emu/*.h tests/cuda_emu/*.cpp \
                tests/cuda_emu/include/*.h))
format:
	clang-format -i $(FORMAT_SRC)

format-check:
	@command -v clang-format >/dev/null || { echo "format-check: clang-format is missing (make deps installs it)"; exit 1; }
	clang-format --dry-run -Werror $(FORMAT_SRC)
	@echo "format-check: $(words $(FORMAT_SRC)) files formatted as .clang-format says"

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-ubsan $(BUILD)-tsan build-cuda

# libFuzzer targets (make fuzz, make test-fuzz): tests/fuzz/fuzz.mk.
include tests/fuzz/fuzz.mk

# What make test's later stages compile in $(BUILD), built in build-and-venv
# (here, once every variable it names is set).
TEST_BINS := $(UNIT_BIN) $(BUILD)/tests/test_emu $(BUILD)/tests/test_backend_ops \
             $(BUILD)/tests/test_backend_e2e $(BUILD)/tests/test_backend_health \
             $(BUILD)/tests/test_backend_cuda_check $(BUILD)/tests/test_backend_models $(EMU_GOLDEN) \
             $(BUILD)/speed_bench $(BUILD)/speed_bench-emu $(BUILD)/kv_bench $(BUILD)/gemm_bench \
             $(BUILD)/conv_bench $(BUILD)/arserve-leaky $(FUZZ_BINS)
build-for-tests: all $(TEST_BINS)

-include $(ENGINE_OBJ:.o=.d) $(PLAIN_KERNEL_OBJ:.o=.d) $(SERVER_OBJ:.o=.d) $(BUILD)/leaky/arserve_leaky.d $(CLI_OBJ:.o=.d) $(EMU_OBJ:.o=.d) $(BUILD)/engine/backend/backend_cuda.d \
         $(BUILD)/kv_bench.d $(BUILD)/speed_bench.d $(BUILD)/gemm_bench.d $(BUILD)/conv_bench.d \
         $(BUILD)/speed_bench-emu.d $(EMU)/backend_open.d
