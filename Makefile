# k3 build. `make` builds bin/k3; `make test` builds everything (release and
# ASan+UBSan) and runs the whole suite, ending with "N passed, N failed".
#
# Sources are discovered by wildcard: every src/**/*.c except src/cli/main.c is
# library code linked into both the k3 binary and the test runner; every
# tests/test_*.c is part of the unit-test runner.

CC      ?= cc
# -ffp-contract=off: the determinism contract. FMA is used only where a kernel
# asks for it explicitly (fmaf / _mm512_fmadd_ps), identically on every path.
# No -march: the binaries target baseline x86-64 so they run on any x86-64
# CPU. Wider instruction sets (AVX2+FMA, AVX-512, AVX512_BF16) appear only in
# functions with a target attribute, reached after a CPUID check
# (src/kernels/kernels.c, K3_ISA; tests/cli/test_portable.sh checks the
# machine code). Do not add -march=native here: it would let the compiler use
# AVX-512 anywhere and the binary would die with SIGILL on older CPUs.
BASE    := -std=gnu11 -Wall -Wextra -Werror -Wvla -fopenmp -ffp-contract=off \
           -D_GNU_SOURCE -Isrc -MMD -MP
RELFLAGS:= -O3
# K3_CHECKED: invariants too costly or too strict for a user's run (a
# workspace estimate falling short) stop the sanitizer build instead.
ASNFLAGS:= -O1 -g -fsanitize=address,undefined \
           -fno-sanitize-recover=all -fno-omit-frame-pointer -DK3_CHECKED
LIBS    := -ljansson -lpcre2-8 -lmicrohttpd -luring -lnettle -lm
# Where objects and programs go; scripts/test-arm64 cross-builds into
# BUILD=build/arm64 BIN=bin/arm64 beside the native build.
BUILD   ?= build
BIN     ?= bin
# Open MPI (expert-parallel `k3 run` under mpirun, src/dist/): the flags its
# mpicc wrapper would add. Without it the build still works and k3 runs as one
# process (under mpirun with several ranks it refuses, saying why).
MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell mpicc --showme:link 2>/dev/null)
ifeq ($(strip $(MPI_LIBS)),)
MPI_CFLAGS := -DK3_NO_MPI
endif
BASE    += $(MPI_CFLAGS)
LIBS    += $(MPI_LIBS)

LIB_SRC  := $(shell find src -name '*.c' ! -path 'src/cli/main.c' | sort)
# Generated at build time (never committed): the web pages as C arrays.
GEN_SRC  := build/gen/web_assets.c
LIB_SRC  += $(GEN_SRC)
TEST_SRC := $(sort $(wildcard tests/test_*.c)) tests/harness.c tests/tjson.c tests/tengine.c

REL_LIB  := $(LIB_SRC:%.c=$(BUILD)/rel/%.o)
ASN_LIB  := $(LIB_SRC:%.c=$(BUILD)/asan/%.o)
REL_TEST := $(TEST_SRC:%.c=$(BUILD)/rel/%.o)
ASN_TEST := $(TEST_SRC:%.c=$(BUILD)/asan/%.o)

.PHONY: all test clean setup bench bench-report fuzz install uninstall
all: $(BIN)/k3

$(BIN)/k3: $(BUILD)/rel/src/cli/main.o $(REL_LIB) | $(BIN)
	$(CC) $(BASE) $(RELFLAGS) -o $@ $^ $(LIBS)
$(BIN)/k3-asan: $(BUILD)/asan/src/cli/main.o $(ASN_LIB) | $(BIN)
	$(CC) $(BASE) $(ASNFLAGS) -o $@ $^ $(LIBS)
$(BIN)/k3-test: $(REL_TEST) $(REL_LIB) | $(BIN)
	$(CC) $(BASE) $(RELFLAGS) -o $@ $^ $(LIBS)
$(BIN)/k3-test-asan: $(ASN_TEST) $(ASN_LIB) | $(BIN)
	$(CC) $(BASE) $(ASNFLAGS) -o $@ $^ $(LIBS)

# Objects also depend on this Makefile, so a change of flags rebuilds them.
$(BUILD)/rel/%.o: %.c Makefile
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(RELFLAGS) -c -o $@ $<
$(BUILD)/asan/%.o: %.c Makefile
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(ASNFLAGS) -c -o $@ $<

$(BIN):
	@mkdir -p $(BIN)

# The chat page's Markdown libraries, from Debian's libjs-marked and
# node-dompurify (optional: without them it shows plain text). The stamp
# changes when they appear or go, so installing them regenerates the assets.
MARKED_JS ?= /usr/share/javascript/marked/marked.umd.min.js
PURIFY_JS ?= /usr/share/nodejs/dompurify/dist/purify.min.js
WEB_LIBS := $(wildcard $(MARKED_JS) $(PURIFY_JS))
build/gen/web_libs: FORCE
	@mkdir -p $(dir $@)
	@echo '$(WEB_LIBS)' | cmp -s - $@ || echo '$(WEB_LIBS)' >$@
FORCE:

build/gen/web_assets.c: scripts/embed-web-assets.sh build/gen/web_libs $(WEB_LIBS) $(sort $(wildcard src/web/assets/* src/web/assets/chat/*))
	MARKED_JS='$(MARKED_JS)' PURIFY_JS='$(PURIFY_JS)' bash scripts/embed-web-assets.sh $@

setup:
	bash scripts/setup.sh --test

# bin/bench_layers: tests/cli/test_bench_layers.sh runs it at tiny dimensions, so
# the per-layer benchmark keeps building and running.
test: bin/k3 bin/k3-asan bin/k3-test bin/k3-test-asan bin/serve_scripted bin/serve_scripted-asan bin/bench_layers
	bash tests/run.sh

# k3 serve's HTTP server in front of a scripted test double of the model, for
# tests/cli/test_serve_e2e.sh (not part of k3).
$(BIN)/serve_scripted: $(BUILD)/rel/tests/serve/scripted_server.o $(REL_LIB) | $(BIN)
	$(CC) $(BASE) $(RELFLAGS) -o $@ $^ $(LIBS)
$(BIN)/serve_scripted-asan: $(BUILD)/asan/tests/serve/scripted_server.o $(ASN_LIB) | $(BIN)
	$(CC) $(BASE) $(ASNFLAGS) -o $@ $^ $(LIBS)

# `make install` puts the k3 program in $(PREFIX)/bin, the shipped models in
# $(PREFIX)/share/k3/models/{default,chat} and the docs in $(PREFIX)/share/doc/k3 (laid
# out as in the tree, so the README's links to docs/ resolve);
# DESTDIR stages the tree for a package. Nothing else is needed at run time:
# the web pages are compiled into the program.
PREFIX  ?= /usr/local
DATADIR := $(DESTDIR)$(PREFIX)/share/k3
install: $(BIN)/k3
	install -d $(DESTDIR)$(PREFIX)/bin $(DATADIR)/models/default $(DATADIR)/models/chat $(DESTDIR)$(PREFIX)/share/doc/k3/docs
	install -m 755 $(BIN)/k3 $(DESTDIR)$(PREFIX)/bin/k3
	install -m 644 models/default/* $(DATADIR)/models/default/
	install -m 644 models/chat/* $(DATADIR)/models/chat/
	install -m 644 README.md $(DESTDIR)$(PREFIX)/share/doc/k3/
	install -m 644 $(wildcard docs/*.md docs/*.svg docs/*.png) $(DESTDIR)$(PREFIX)/share/doc/k3/docs/
uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/k3
	rm -rf $(DATADIR) $(DESTDIR)$(PREFIX)/share/doc/k3

clean:
	rm -rf build bin

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

# Benchmarks: every bench/<name>.c is a program bin/bench_<name> (not a test).
BENCH_SRC := $(sort $(wildcard bench/*.c))
bench: $(BENCH_SRC:bench/%.c=bin/bench_%)
$(BIN)/bench_%: $(BUILD)/rel/bench/%.o $(REL_LIB) | $(BIN)
	$(CC) $(BASE) $(RELFLAGS) -o $@ $^ $(LIBS)
# the performance summary table in one run (docs/performance.md, "The summary table");
# e.g. make bench-report ARGS=--quick
bench-report: bin/k3 bin/bench_decode bin/bench_stream bin/bench_train bin/bench_index
	bash bench/report.sh $(ARGS)

# Fuzzing (libFuzzer; needs clang): bin/fuzz_safetensors, bin/fuzz_index, bin/fuzz_config,
# bin/fuzz_tokenizer.
# Only the parsers' sources are compiled, without OpenMP (its pragmas are
# ignored), under ASan+UBSan. tests/cli/test_fuzz.sh runs each for a bounded
# time; run longer by hand: bin/fuzz_config -max_total_time=600 fuzz/corpus/config
FUZZ_CC    ?= clang
FUZZ_FLAGS := -std=gnu11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
              -Wall -Wextra -Werror -Wno-unknown-pragmas -D_GNU_SOURCE -Isrc
FUZZ_SRC   := src/formats/safetensors.c src/formats/safetensors_header.c src/formats/config.c src/util/common.c src/util/checksum.c \
              src/util/mapguard.c src/util/dio.c src/tokenizer/tokenizer.c src/tokenizer/pretok.c fuzz/omp_stub.c
FUZZ_HDR   := src/formats/safetensors.h src/formats/st_internal.h src/formats/config.h src/util/common.h src/util/mapguard.h \
              src/util/dio.h \
              src/tokenizer/tokenizer.h src/tokenizer/unicode_delta.h
fuzz: $(patsubst fuzz/%.c,bin/%,$(wildcard fuzz/fuzz_*.c))
bin/fuzz_%: fuzz/fuzz_%.c $(FUZZ_SRC) $(FUZZ_HDR) | bin
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ $< $(FUZZ_SRC) -ljansson -lpcre2-8 -lpthread -lm
