# The two commands a newcomer needs: `make serve` and `make test`.
VENV   ?= .venv
PYTHON ?= python3.11
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

serve: install
	$(VENV)/bin/meshserve serve $(ARGS)

# the layering check (pyproject.toml [tool.importlinter]) and lint first: both take seconds
test: install
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(VENV)/bin/ruff check meshserve tests
	$(VENV)/bin/python -m pytest -q -ra tests $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
