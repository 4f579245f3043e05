# One entry point per job. `make run` and `make test` install what is missing
# first, so a fresh machine needs nothing else.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= pipelines/configs/demo.yaml
PORT   ?= 8000
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast run serve bench lint format ui kfp manifests parent example clean

install: $(STAMP)

# Re-install when the dependency list or pins change; otherwise a no-op.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip check
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

run: install
	$(BIN)/star-elastic run $(CONFIG)

serve: install
	$(BIN)/star-elastic serve $(or $(MODEL),runs/demo/export/nested) --port $(PORT)

bench: install
	$(BIN)/python benchmarks/run_all.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Retrain the shipped demo parent (pipelines/assets/demo-parent) on the built-in task.
parent: install
	$(BIN)/star-elastic parent train --out pipelines/assets/demo-parent

# The bring-your-own example: make its inputs (tokenizer, chat/text JSONL, eval set), then run the
# pipeline on them (the parent is trained first and written by transformers' save_pretrained).
example: install
	$(BIN)/star-elastic example chat --out runs/chat-example/assets
	$(BIN)/star-elastic run pipelines/configs/chat-example.yaml

kfp: install
	$(BIN)/star-elastic kfp compile $(CONFIG) --out infra/kfp/demo-pipeline.yaml

# The KubeRay and MLflow manifests of infra/k8s, rendered from pipelines/kuberay/.
manifests: install
	$(BIN)/star-elastic kuberay render infra/k8s

ui: install
	$(BIN)/mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --artifacts-destination runs/mlartifacts --port 5000

clean:
	rm -rf runs mlruns .pytest_cache .ruff_cache
