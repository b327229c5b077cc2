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

# pytest exits 5 when it collects nothing (e.g. a filtered run): that is not a failure. Without a path in ARGS the
# suite runs in four pytest processes, one after the other, so that what one part's engines, Ray and browsers
# leave in memory is given back before the next part starts (a process's heap does not shrink back: one process
# for all of it outgrew 24 GiB). The processes share a directory for the tiny checkpoints (tests/conftest.py),
# each made once per run.
UNIT_REST = tests/unit --ignore=tests/unit/bench --ignore=tests/unit/engine
TEST_GROUPS = "tests/browser tests/gpu tests/parity tests/replicas" "tests/server" \
	"tests/test_*.py tests/unit/bench tests/unit/engine" "$(UNIT_REST)"
test: setup
	@case "$(ARGS)" in *tests/*) groups='""';; *) groups='$(TEST_GROUPS)';; esac; \
	checkpoints=$$(mktemp -d); trap 'rm -rf "$$checkpoints"' EXIT; \
	rc=0; eval "set -- $$groups"; for group in "$$@"; do \
	  OMNISTAGE_TEST_CHECKPOINTS=$$checkpoints $(BIN)/python -m pytest -q $(ARGS) $$group; r=$$?; \
	  [ $$r -eq 5 ] && r=0; [ $$r -ne 0 ] && rc=$$r; \
	done; exit $$rc

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
