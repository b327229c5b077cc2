# Two commands on a fresh machine with only Python: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The newest torch below 2.14 is the CPU build where pip has one at hand (our CI); elsewhere it is
# PyPI's default build. Set TORCH to pick another, e.g. TORCH="torch==2.11.0".
TORCH ?= torch>=2.11,<2.14

.PHONY: setup serve test lint typecheck tiny soak parity-newest

$(BIN)/omnistage: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev,test,ray]"
	touch $@

setup: $(BIN)/omnistage

serve: setup
	$(BIN)/omnistage serve $(ARGS)

tiny: setup
	$(BIN)/omnistage make-tiny $(or $(DIR),tiny-qwen3-omni)

# The suite in four pytest processes, two at a time, sharing the run's tiny checkpoints; ARGS naming tests/...
# runs one pytest over those (tests/run_groups.sh).
test: setup
	@PYTHON=$(BIN)/python ARGS='$(ARGS)' bash tests/run_groups.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over omnistage/ as pyproject's [tool.mypy] has it; .mypy_cache makes a second run take seconds.
typecheck: setup
	$(BIN)/mypy

# Mixed requests against a tiny-model server it starts (or ARGS="--url ..."); see benchmarks/soak.py.
soak: setup
	$(BIN)/python benchmarks/soak.py $(ARGS)

# The parity suite against the newest transformers our dependency range admits, in a venv of its own (the dev
# extra pins the GPU machine's version, which `make test` runs); transformers is upgraded on every run. Not in CI:
# about 5 minutes on 2 cores, past CI's budget (README, Testing).
NEWEST ?= .venv-newest

$(NEWEST)/bin/omnistage: pyproject.toml
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q "$(TORCH)"
	$(NEWEST)/bin/python -m pip install -q -e ".[dev,test,ray]"
	touch $@

parity-newest: $(NEWEST)/bin/omnistage
	$(NEWEST)/bin/python -m pip install -q --upgrade "transformers<6"
	$(NEWEST)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(NEWEST)/bin/python -m pytest -q tests/parity $(ARGS)
