# Everything sets itself up: a fresh machine needs only Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format setup clean

setup: $(STAMP)

# torch is pinned in requirements-cpu.txt so that a CPU machine takes the local CPU wheel.
$(STAMP): requirements-cpu.txt setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/grpo_needle.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
