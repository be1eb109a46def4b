# The README's commands: `make quickstart`, `make test` (and `make test-slow`, which CI adds). Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch comes first, pinned, so pip never pulls a fresh multi-GB build to satisfy another package.
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# PyPI's Linux torch is the CUDA build (about 4 GB of nvidia and triton wheels). On a CPU-only machine that reaches
# PyTorch's own index, `make quickstart TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU build.
TORCH_INDEX ?=

.PHONY: quickstart test test-slow test-shuffled test-gpu fault-injection lint install install-test clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# The runtime: what `make quickstart` needs (matplotlib draws its curves.png).
$(VENV)/.installed: $(BIN)/activate pyproject.toml
	$(BIN)/pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PINS)
	$(BIN)/pip install -e '.[plot]'
	touch $@

# The test extras on top, for `make test` and `make lint` only.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

QUICKSTART_DATA := data/quickstart

$(QUICKSTART_DATA)/train/index.json: | install
	$(BIN)/foundry data convert --builtin-corpus --out $(QUICKSTART_DATA) --concat-tokens 128 --vocab-size 4096 --overwrite

quickstart: install $(QUICKSTART_DATA)/train/index.json
	$(BIN)/foundry train yamls/quickstart.yaml

# `make test` is the change loop: every test but those marked slow (they kill and relaunch `foundry train`
# processes or train full-size configs), each file in order. `make test-slow` runs those; CI runs both, then
# `make test-shuffled` (.ci/run).
# PYTEST_ARGS adds pytest options, e.g. PYTEST_ARGS='-x tests/checkpoint' (later paths narrow it).
# TEST_WORKERS: pytest-xdist processes, one a core by default (TEST_WORKERS=0: one process); each module's tests
# stay in one worker (--dist loadfile), so its shared fixtures are built once.
PYTEST_ARGS ?=
TEST_WORKERS ?= auto
test: install-test
	$(BIN)/python -m pytest tests -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-slow: install-test
	$(BIN)/python -m pytest tests -m slow $(PYTEST_ARGS)

# `make test` in one shuffled order of the whole suite (pytest-random-order): a test that passes only after, or
# only before, another fails here. The order is new each run and its seed printed first; SEED=N repeats one.
SEED ?=
test-shuffled: install-test
	seed=$(SEED); seed=$${seed:-$$($(BIN)/python -c 'import random; print(random.randrange(10**6))')}; \
	echo "test-shuffled: seed $$seed (make test-shuffled SEED=$$seed repeats this order)"; \
	$(BIN)/python -m pytest tests -m "not slow" -p random_order --random-order-bucket=global \
		--random-order-seed=$$seed $(PYTEST_ARGS)

# The whole suite on a GPU machine whose Python already has a CUDA torch (no .venv, nothing installed):
# kernel tests then run compiled on the GPU, and it stops at once if torch sees no GPU. Where pytest-xdist
# imports, it runs in GPU_WORKERS processes (the tiny tests share the GPUs; inductor compiles with one
# thread each, and each worker's CPU ops get cores / workers threads, so the workers do not oversubscribe
# the cores: each torch would otherwise start one thread per core): 433 s with 20 on a 32-core, 2-GPU host.
GPU_PYTHON ?= python3
GPU_WORKERS ?= 16
test-gpu:
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: torch sees no GPU')"
	threads=$$(nproc); if $(GPU_PYTHON) -c "import xdist" 2>/dev/null; then \
		workers="-n $(GPU_WORKERS)"; threads=$$(( threads / $(GPU_WORKERS) > 0 ? threads / $(GPU_WORKERS) : 1 )); fi; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$threads} TORCHINDUCTOR_COMPILE_THREADS=1 \
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m pytest tests $$workers $(PYTEST_ARGS)

# kill -9 trials and the damaged-file matrix behind docs/CHECKPOINTS.md's Reliability section (about 40 min on 2 cores).
fault-injection: install-test
	$(BIN)/python benchmarks/fault_injection.py --out benchmarks/results

lint: install-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) runs
