# The project's entry points. Each target creates .venv when it is missing and
# installs what it needs, so on a fresh machine `make run` and `make test` are
# all the set-up there is.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python

.PHONY: run test test-fast lint typecheck fbs bench clean system-deps

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per set of extras; reinstalls when pyproject.toml changes.
$(VENV)/.installed-%: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[$*]"
	touch $@

system-deps:
	bash scripts/install-system-deps.sh

# The main job: a local cluster (PM + 3 data nodes, data under ./var) until Ctrl-C.
# `make run PORT_BASE=9000` when 7400 and the ports after it are taken.
run: $(VENV)/.installed-dev,tables,tiering
	$(BIN)/sbp-cluster $(if $(PORT_BASE),--port-base $(PORT_BASE))

# Byte-compiled first: the tests start hundreds of server and CLI processes,
# and an environment with PYTHONDONTWRITEBYTECODE would compile each from source.
PACKAGES := sbp storage net client datanode pm spark_jobs tables tiering bench tests

# Three workers on two cores, a test file each at a time (a module's shared
# cluster stays on one worker): the integration tests spend part of their
# time waiting on servers' timeouts, which a third worker fills.
test: $(VENV)/.installed-dev,spark,tables,tiering,bench system-deps
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) -m pytest -n 3 --dist loadfile

# The quick check after each change: unit, protocol and property tests (no
# server processes, no Spark, not the SIGKILL crash tests, which are marked
# slow), on two workers; `make test` (what CI runs) runs everything.
test-fast: $(VENV)/.installed-dev,spark,tables,tiering,bench
	$(PY) -m compileall -q $(PACKAGES)
	$(PY) -m pytest tests/unit -q -n 2 -m "not slow"

lint: $(VENV)/.installed-dev,spark,tables,tiering
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy sbp storage net client datanode pm spark_jobs tables tiering

# Regenerate the FlatBuffers Python code in sbp/_fbs from fbs/*.fbs.
fbs: $(VENV)/.installed-dev
	$(PY) fbs/generate.py sbp/_fbs

# The benchmark suite: results into docs/benchmarks/ (see docs/benchmarks.md).
bench: $(VENV)/.installed-dev,spark,tables,bench system-deps
	$(PY) -m bench all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
