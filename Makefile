# lunar build. `make` builds build/lunar and build/liblunar.a; `make test` builds and runs the tests;
# `make SAN=1 test` does the same under AddressSanitizer + UndefinedBehaviorSanitizer in build-san/.
# CUDA sources are compiled when nvcc is found (NVCC= to disable); the backend is chosen at run time.

CC      ?= cc
SAN     ?= 0
NVCC    ?= $(shell command -v nvcc 2>/dev/null)
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a

ifeq ($(SAN),1)
BUILD   := build-san
OPT     := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
LDSAN   := -fsanitize=address,undefined
else
BUILD   := build
OPT     := -O2 -g
LDSAN   :=
endif

DEPS_CFLAGS := $(shell pkg-config --cflags jansson libpcre2-8 zlib libmicrohttpd)
DEPS_LIBS   := $(shell pkg-config --libs jansson libpcre2-8 zlib libmicrohttpd)

CFLAGS  := -std=c11 -D_GNU_SOURCE $(OPT) -Wall -Wextra -Werror -Wshadow -Wno-unused-parameter \
           -fopenmp -Iinclude -Isrc $(DEPS_CFLAGS) -MMD -MP
LDLIBS  := $(DEPS_LIBS) -lm -fopenmp $(LDSAN)

LIB_SRC := $(filter-out src/cli/%,$(shell find src -name '*.c' | sort))
# The server reaches the engine through src/server/backend_engine.c, which needs the lunar_engine_* symbols:
# it is built only when the engine is (src/engine/engine.c); otherwise backend_noengine.c stands in.
ifeq ($(wildcard src/engine/engine.c),)
LIB_SRC := $(filter-out src/server/backend_engine.c,$(LIB_SRC))
else
LIB_SRC := $(filter-out src/server/backend_noengine.c,$(LIB_SRC))
endif
CLI_SRC := $(shell find src/cli -name '*.c' | sort)
TEST_SRC := $(shell find tests -maxdepth 1 -name '*.c' | sort)
CU_SRC  := $(shell find src/backend/cuda -name '*.cu' 2>/dev/null | sort)

ifneq ($(NVCC),)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CFLAGS  += -DLUNAR_HAVE_CUDA
LDLIBS  += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart_static \
           -ldl -lrt -lpthread -lstdc++
CU_OBJ  := $(CU_SRC:%.cu=$(BUILD)/%.o)
# NCCL ships with the CUDA toolkit here; the collectives of src/parallel/comm_nccl.c need it
ifneq ($(wildcard $(CUDA_HOME)/include/nccl.h),)
CFLAGS  += -DLUNAR_HAVE_NCCL
LDLIBS  := -lnccl $(LDLIBS)
$(BUILD)/src/parallel/comm_nccl.o: CFLAGS += -isystem $(CUDA_HOME)/include
endif
NVFLAGS := -std=c++17 -O3 $(CUDA_ARCH) -Isrc -Iinclude -Xcompiler -Wall,-Werror -Werror all-warnings
else
CU_OBJ  :=
endif

LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o) $(CU_OBJ)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)

.PHONY: all test test-server clean fuzz deps run check fuzz-smoke bench-tokenizer bench-prefix bench-grammar
all: $(BUILD)/lunar $(BUILD)/lunar_tests

# rebuilt from scratch: `ar r` would keep members of deleted sources
$(BUILD)/liblunar.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@
	ar rcs $@ $^

$(BUILD)/lunar: $(CLI_OBJ) $(BUILD)/liblunar.a
	$(CC) -o $@ $(CLI_OBJ) $(BUILD)/liblunar.a $(LDLIBS)

# Tests link the CLI's command objects too (everything but main.c) so they can drive commands.
$(BUILD)/lunar_tests: $(TEST_OBJ) $(filter-out $(BUILD)/src/cli/main.o,$(CLI_OBJ)) $(BUILD)/liblunar.a
	$(CC) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -c $< -o $@

# nvcc writes no dependency files here: every CUDA object depends on the backend's headers.
$(CU_OBJ): $(wildcard src/backend/cuda/*.h src/backend/cuda/*.cuh) src/base/err.h

test: $(BUILD)/lunar $(BUILD)/lunar_tests
	./$(BUILD)/lunar_tests

deps:
	@scripts/install-deps.sh

# The quick start: generate from the bundled (random-weight) model on the CPU backend.
RUN_PROMPT ?= The capital of France is
run: deps
	$(MAKE) $(BUILD)/lunar
	./$(BUILD)/lunar generate models/kimi-linear-tiny --prompt "$(RUN_PROMPT)" --max-tokens 32

# The OpenAI-API tests: a live `lunar serve` on the bundled model, driven by the openai client.
# the constrained outputs of the random model that tests/server/test_grammar_samples.py validates
build/model_grammar_samples.jsonl: build/lunar_tests
	./build/lunar_tests engine_grammar

test-server: $(BUILD)/lunar build/model_grammar_samples.jsonl
	@scripts/install-py-deps.sh
	.venv/bin/python -m pytest -q tests/server

# Everything CI runs: tests, sanitizer tests, the server tests, a short fuzz of the parsers.
check: deps
	$(MAKE) test
	$(MAKE) SAN=1 test
	$(MAKE) test-server
	$(MAKE) fuzz-smoke

FUZZ_SECONDS ?= 20
fuzz-smoke: fuzz
	@for f in $(FUZZ_SRC:tests/fuzz/fuzz_%.c=%); do \
	  echo "fuzzing $$f for $(FUZZ_SECONDS) s"; \
	  mkdir -p build/fuzz-work/$$f; \
	  ./build/fuzz_$$f -max_total_time=$(FUZZ_SECONDS) build/fuzz-work/$$f tests/corpus/$$f \
	    > build/fuzz-work/$$f.log 2>&1 || { tail -40 build/fuzz-work/$$f.log; exit 1; }; \
	  tail -1 build/fuzz-work/$$f.log; \
	done

# Tokenizer throughput program (not a test): python3 tools/tokenizer/bench.py runs it next to tiktoken
bench-tokenizer: $(BUILD)/bench_tokenizer
$(BUILD)/bench_tokenizer: tools/tokenizer/bench_tokenizer.c $(BUILD)/liblunar.a
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/liblunar.a $(LDLIBS)

# Prefix-cache benchmark (multi-turn workload, cache on vs off)
bench-prefix: $(BUILD)/bench_prefix
$(BUILD)/bench_prefix: tools/bench/bench_prefix.c $(BUILD)/liblunar.a
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/liblunar.a $(LDLIBS)

# Grammar mask timing over the schema cases (not a test): build/bench_grammar [seeds] [-v]
bench-grammar: $(BUILD)/bench_grammar
$(BUILD)/bench_grammar: tools/grammar/bench_mask.c tests/grammar_util.h $(BUILD)/liblunar.a
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/liblunar.a $(LDLIBS)

# libFuzzer targets (clang): build/fuzz_<name>; run e.g. build/fuzz_safetensors tests/corpus/safetensors
FUZZ_SRC := $(shell find tests/fuzz -name 'fuzz_*.c' 2>/dev/null | sort)
fuzz: $(FUZZ_SRC:tests/fuzz/%.c=build/%)
build/fuzz_%: tests/fuzz/fuzz_%.c $(LIB_SRC)
	@mkdir -p build
	clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc \
	  $(DEPS_CFLAGS) $< $(filter-out src/backend/cuda/%,$(LIB_SRC)) -o $@ $(DEPS_LIBS) -lm

clean:
	rm -rf build build-san

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d)
