# Fresh machine: `make demo` (default experiment) or `make test` (whole suite).
# Both create .venv if missing and install pfljax with its extras into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demo's data: Fashion-MNIST where its IDX files are installed (apt-get install
# dataset-fashion-mnist), else the FedFac simulation; one workdir per data set, so installing
# the files later starts a new demo instead of meeting the other data's checkpoints.
FMNIST_FILE := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
DEMO_DATA := $(if $(wildcard $(FMNIST_FILE)),fashion_mnist,simulation)
WORKDIR ?= runs/demo/$(DEMO_DATA)

.PHONY: venv demo test bench lint docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,tfds,experiments,natural,docs]'
	touch $(STAMP)

venv: $(STAMP)

# FedAvg vs Local on Fashion-MNIST (or the FedFac simulation without its files): $(WORKDIR)/results.md.
demo: $(STAMP)
	@echo "demo on $(DEMO_DATA)$(if $(wildcard $(FMNIST_FILE)),, (Fashion-MNIST IDX files not in \
	/usr/share/datasets/fashion-mnist: apt-get install dataset-fashion-mnist for it)), outputs in $(WORKDIR)"
	$(PY) -m experiments.compare --config=experiments/configs/default.py --algorithms=fedavg,local \
		--seeds=0 --workdir=$(WORKDIR)

# The suite in parallel: one pytest-xdist worker per core, at most 4 (each holds its own JAX
# programs, a few GB); tests handed out one by one (worksteal): test_conformance.py alone is
# minutes, so whole files per worker would leave one worker idle.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

bench: $(STAMP)
	$(PY) -m experiments.bench.bench --json

lint: $(STAMP)
	$(PY) -m ruff check pfljax experiments tests

# The documentation, warnings as errors: HTML in docs/_build/html (the algorithm pages are
# generated from pfljax.algorithms at build time; tests/test_docs.py runs the same build).
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html -q docs docs/_build/html

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache runs docs/_build docs/algorithms
