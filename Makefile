# The commands a newcomer needs: `make serve`, `make test` and, while working, `make test-quick`.
VENV   ?= .venv
PYTHON ?= python3.11
STAMP  := $(VENV)/.installed
ARGS   ?=
# pytest-xdist workers: `make test` gives each a whole module at a time (a module's engines and servers start
# once), the costliest tiers first (tests/conftest.py orders them; xdist's own reorder is off); `make
# test-quick` spreads the unit tier's tests over all of them
WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -q -ra -n $(WORKERS)

.PHONY: install serve lint test test-quick bench clean vidur

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@# the native CPU kernels, compiled now rather than by the first engine (cached per CPU model; where they
	@# cannot be built the torch path serves and this says why)
	$(VENV)/bin/python -m meshserve.layers.cpu_kernels
	@touch $(STAMP)

serve: install
	$(VENV)/bin/meshserve serve $(ARGS)

# the layering check (pyproject.toml [tool.importlinter]) and lint: both take seconds
lint: install
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(VENV)/bin/ruff check meshserve tests

# every tier (CI: .ci/run); the slowest tests are listed at the end
test: lint
	$(PYTEST) --dist loadscope --no-loadscope-reorder --durations=25 tests $(ARGS)

# the unit tier (docs/testing.md): no process started, no model built; a few minutes at most
test-quick: lint
	$(PYTEST) -m unit tests $(ARGS)

# Vidur in an environment of its own, for `meshserve simulate vidur` (docs/simulate.md): its dependencies are not
# meshserve's, and nothing else uses it
VIDUR_VENV ?= .venv-vidur
vidur: $(VIDUR_VENV)/.installed

$(VIDUR_VENV)/.installed: requirements-vidur.lock
	$(PYTHON) -m venv $(VIDUR_VENV)
	$(VIDUR_VENV)/bin/pip install -q -r requirements-vidur.lock
	@touch $@

clean:
	rm -rf $(VENV) $(VIDUR_VENV) .pytest_cache
