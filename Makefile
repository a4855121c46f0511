# make run   - set up .venv if needed, then train the built-in default job (MiniLM on the sample set, CPU)
# make test  - set up .venv if needed, then run the whole test suite (slow tests included)
# make lint  - ruff: lint rules and the formatting check (what CI runs before the tests)
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# make test runs test files on this many pytest-xdist workers, one file per worker at a time (module fixtures are
# built once); 2 fills a 2-core machine, where one process leaves a core idle 40% of the time. 0 = one process
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup run test test-fast lint clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml launch/setup_env.sh
	bash launch/setup_env.sh $(VENV)

run: setup
	$(PY) -m lychee_exp.run $(ARGS)

test: setup
	$(PY) -m pytest $(XDIST) $(ARGS)

test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs multirun
