# edgefeed: `make help` lists the targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgefeed-installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: help install demo demo-sites lab test test-unit lint bench bench-peers-serving bench-peers-pipeline faults faults-short security-scan up down clean

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	@touch $@

install: $(STAMP) ## Install system packages (if missing), the venv and the project

demo: $(STAMP) ## Bring up the local stack and run the end-to-end demo
	$(BIN)/edgefeed --settings examples/edgefeed.yaml demo run

demo-sites: $(STAMP) ## Sites behind WAN links: cut central<->eu-west, heal, watch it catch up
	$(BIN)/edgefeed --settings examples/edgefeed-sites.yaml demo sites

lab: $(STAMP) ## The latency lab on the local stack: central vs edge, every term (docs/latency-lab.md)
	$(BIN)/edgefeed --settings examples/edgefeed.yaml lab run

test: $(STAMP) ## Lint, type-check, then run the whole test suite (starts the real services itself)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --durations=30 $(PYTEST_ARGS)

test-unit: $(STAMP) ## Run the unit tests only (no services)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP) ## ruff and mypy on the packages
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP) ## Run every benchmark in benchmarks/ (peers: bench-peers-*; see docs/benchmarks.md)
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

bench-peers-serving: $(STAMP) ## Model workers vs LitServe and Triton (makes their venvs when missing)
	bash benchmarks/peers/setup.sh litserve pytriton
	$(BIN)/python benchmarks/peers/serving.py $(BENCH_ARGS)

QUIX_VENV := benchmarks/peers/.venv-quix

$(QUIX_VENV)/bin/python: benchmarks/peers/quix_venv.sh
	bash benchmarks/peers/quix_venv.sh $(QUIX_VENV)

bench-peers-pipeline: $(STAMP) $(QUIX_VENV)/bin/python ## edgefeed's pipeline vs Quix Streams (own venv, made if missing)
	$(BIN)/python benchmarks/peers/quix_pipeline.py $(BENCH_ARGS)

faults: $(STAMP) ## Run the fault suite on its own local stack (see docs/operations.md)
	$(BIN)/python scripts/fault_suite.py

faults-short: $(STAMP) ## The fault suite's four-fault variant (~2 min on a quiet machine)
	$(BIN)/python scripts/fault_suite.py --short

security-scan: ## checkov on the deployment files, in its own venv (.venv-checkov)
	bash scripts/security-scan.sh

up: $(STAMP) ## Start the local stack (edgefeed dev up)
	$(BIN)/edgefeed --settings examples/edgefeed.yaml dev up

down: ## Stop the local stack (edgefeed dev down)
	$(BIN)/edgefeed --settings examples/edgefeed.yaml dev down

clean: down ## Stop the stack and remove its state folder
	rm -rf .edgefeed
