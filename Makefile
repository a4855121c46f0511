# make run   - set up .venv if needed, then train the built-in default job (MiniLM on the sample set, CPU)
# make test  - set up .venv if needed, then run the whole test suite (slow tests included)
# make test-fast - the tests not marked slow, on 2 pytest-xdist workers
# make lint  - ruff: lint rules and the formatting check (what CI runs before the tests)
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# make test-fast runs test files on this many pytest-xdist workers, a file per worker at a time (module fixtures
# built once); 0 = one process. make test runs serially: docs/development.md "The suite's time budget" says why
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup run test test-fast lint clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml launch/setup_env.sh
	bash launch/setup_env.sh $(VENV)

run: setup
	$(PY) -m lychee_exp.run $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs multirun
