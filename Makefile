# arserve build. `make run` and `make test` are all a newcomer types: both
# install what they need first (`make deps`).
#
# Switches (validated): CUDA=0|1, SANITIZER=address|undefined|thread, DEBUG=0|1.
# CI=true adds -Werror.

CUDA      ?= 0
DEBUG     ?= 0
SANITIZER ?=
BUILD     ?= build
PYTHON    ?= python3
VENV      := .venv
PORT      ?= 8080
HOST      ?= 127.0.0.1

ifeq ($(filter $(CUDA),0 1),)
$(error CUDA must be 0 or 1, not '$(CUDA)')
endif
ifeq ($(CUDA),1)
$(error CUDA=1 is reserved for the CUDA backend, which is not built yet; build without it)
endif
ifeq ($(filter $(DEBUG),0 1),)
$(error DEBUG must be 0 or 1, not '$(DEBUG)')
endif
ifneq ($(SANITIZER),)
ifeq ($(filter $(SANITIZER),address undefined thread),)
$(error SANITIZER must be address, undefined or thread, not '$(SANITIZER)')
endif
endif

CC      ?= cc
CFLAGS  := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wno-unused-parameter -fopenmp \
           -I. -I/usr/include/x86_64-linux-gnu/openblas-pthread -MMD -MP
LDLIBS  := -lopenblas -lcjson -lpng -lm -lpthread
# The daemon allocates through jemalloc, except in sanitizer builds, which
# need libc's malloc.
SERVER_LIBS := -lmicrohttpd
LDFLAGS := -fopenmp
ifeq ($(DEBUG),1)
CFLAGS  += -O0 -g
else
CFLAGS  += -O2 -g
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

ENGINE_SRC := $(wildcard engine/*.c)
SERVER_SRC := $(wildcard server/*.c)
ENGINE_OBJ := $(ENGINE_SRC:%.c=$(BUILD)/%.o)
SERVER_OBJ := $(SERVER_SRC:%.c=$(BUILD)/%.o)
ENGINE_LIB := $(BUILD)/libarengine.a
SERVER_LIB := $(BUILD)/libarserver.a
UNIT_SRC   := $(wildcard tests/unit/test_*.c)
UNIT_BIN   := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)
TINY_MODEL := $(BUILD)/tiny-model
SLOW_MODEL := $(BUILD)/slow-model

.PHONY: all deps test test-unit test-cli test-integration test-sanitizers run clean tools-deps golden format info

all: info $(BUILD)/arserve

info:
	@echo "arserve build: backend cpu, CUDA=$(CUDA), DEBUG=$(DEBUG), SANITIZER=$(if $(SANITIZER),$(SANITIZER),none)$(if $(filter true,$(CI)), -Werror,)"

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(ENGINE_LIB): $(ENGINE_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SERVER_LIB): $(filter-out $(BUILD)/server/main.o,$(SERVER_OBJ))
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/arserve: $(BUILD)/server/main.o $(SERVER_LIB) $(ENGINE_LIB)
	$(CC) $(LDFLAGS) -o $@ $^ $(SERVER_LIBS) $(LDLIBS)

$(BUILD)/tests/%: tests/unit/%.c $(SERVER_LIB) $(ENGINE_LIB) tests/test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(SERVER_LIB) $(ENGINE_LIB) $(SERVER_LIBS) $(LDLIBS)

# Debian packages the build and tests need; installed only when missing.
DEB_PKGS := gcc make libopenblas-dev libcjson-dev libpng-dev libmicrohttpd-dev libjemalloc-dev \
            python3 python3-venv prometheus curl
deps: $(VENV)/.stamp
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VENV)/.stamp: tests/requirements.txt
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV) || { \
		echo "python3 -m venv failed; installing python3-venv"; \
		apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(VENV)/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
	@touch $@

# The tiny random model used by tests, made from a fixed seed.
$(TINY_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --seed 1 --out $(TINY_MODEL)

# The same architecture, larger: a second or two per image, so the daemon's
# integration tests can catch requests while they run.
$(SLOW_MODEL)/arserve.json: tools/make_tiny_model.py tools/safetensors_write.py $(VENV)/.stamp
	$(VENV)/bin/python tools/make_tiny_model.py --preset slow --seed 1 --out $(SLOW_MODEL)

test: deps
	$(MAKE) all
	$(MAKE) test-unit
	$(MAKE) test-cli
	$(MAKE) test-integration
	$(MAKE) test-sanitizers

# The unit and CLI tests again under AddressSanitizer (with leak checks) and
# UndefinedBehaviorSanitizer, each in its own build folder.
test-sanitizers:
	$(MAKE) SANITIZER=address BUILD=$(BUILD)-asan test-unit test-cli
	$(MAKE) SANITIZER=undefined BUILD=$(BUILD)-ubsan test-unit test-cli

test-unit: $(UNIT_BIN) $(TINY_MODEL)/arserve.json
	ARSERVE_TINY_MODEL=$(TINY_MODEL) tests/run_unit.sh $(UNIT_BIN)

test-cli: $(BUILD)/arserve $(TINY_MODEL)/arserve.json
	tests/cli/test_cli.sh $(BUILD)/arserve $(TINY_MODEL)

# The daemon, started for real on loopback ports (tests/integration/, pytest):
# the OpenAI client, bad requests, batching, 429s, disconnects, drains,
# streaming, Prometheus scraping it, and `make run`.
test-integration: all $(TINY_MODEL)/arserve.json $(SLOW_MODEL)/arserve.json $(VENV)/.stamp
	ARSERVE_BIN=$(BUILD)/arserve ARSERVE_TINY_MODEL=$(TINY_MODEL) ARSERVE_SLOW_MODEL=$(SLOW_MODEL) \
		$(VENV)/bin/python -m pytest -q tests/integration

# Serves MODEL on HOST:PORT (the tiny random model until the demo model ships).
MODEL ?= $(TINY_MODEL)
run: deps
	$(MAKE) all $(TINY_MODEL)/arserve.json
	exec $(BUILD)/arserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Tools that need torch/transformers (golden data, converters) live in their own venv.
tools-deps:
	@[ -x .venv-tools/bin/python ] || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/pip install -q -r tools/requirements.txt

golden: tools-deps all
	.venv-tools/bin/python tools/gen_golden.py --out tests/golden

format:
	clang-format -i $(ENGINE_SRC) $(SERVER_SRC) $(wildcard engine/*.h server/*.h tests/*.h tests/unit/*.c)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-ubsan

-include $(ENGINE_OBJ:.o=.d) $(SERVER_OBJ:.o=.d)
