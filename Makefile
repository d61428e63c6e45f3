# Set-up and entry points. Every target creates .venv from nothing when it is missing.
# torch is installed on its own first: TORCH_SPEC defaults to the CPU wheel that lies on this
# kind of machine; GPU users set e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.selfdraft-installed
# the CI machine has two cores; one intra-op thread per process avoids spinning on a busy core
THREADS ?= 1

.PHONY: setup test test-fast demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest

# the tests marked `fast` (pyproject.toml): greedy parity against generate on three families, the
# generate contract, the adapter format; a few minutes where the full suite takes much longer
test-fast: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest -m fast

demo: $(STAMP)
	$(BIN)/python benchmarks/demo.py

# the quick benchmark suite (docs/benchmarks.md): the peers table and the tree sweep (with the loop's own cost), a few minutes
bench: $(STAMP)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m benchmarks.run peers --quick --threads $(THREADS)
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m benchmarks.run trees --quick --threads $(THREADS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
