# Fresh machine: `make demo` (default experiment) or `make test` (whole suite).
# Both create .venv if missing and install pfljax with its extras into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKDIR ?= runs/demo

.PHONY: venv demo test bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,tfds,experiments]'
	touch $(STAMP)

venv: $(STAMP)

# FedAvg vs Local on Fashion-MNIST (or the FedFac simulation without its files): runs/demo/results.md.
demo: $(STAMP)
	$(PY) -m experiments.compare --config=experiments/configs/default.py --algorithms=fedavg,local \
		--seeds=0 --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m experiments.bench --json

lint: $(STAMP)
	$(PY) -m ruff check pfljax experiments tests

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache runs
