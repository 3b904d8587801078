# Quick start:  make demo   (the main job)   ·   make test   (the test suite)
# Both create .venv on first use: CPU torch from requirements-cpu.txt, then looplm in editable mode with
# the dev, hf (transformers), lmeval (lm-evaluation-harness), hub (datasets) and tracking (tensorboard,
# wandb, trackio) extras, so the interop, corpus and tracking tests run too.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The shared data folder (brown/, wikitext-2-raw/, gpt2-tokenizer/, lambada/): $LOOPLM_DATA if set,
# else ../shared/data next to this checkout, else /work/shared/data.
export LOOPLM_DATA ?= $(firstword $(wildcard $(abspath ../shared/data) /work/shared/data))

.PHONY: demo test test-fast install bench clean

$(BIN)/looplm: pyproject.toml requirements-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-cpu.txt
	$(BIN)/pip install -q -e ".[dev,hf,lmeval,hub,tracking]"
	# the oldest transformers of the hf extra, beside the venv: tests load an export with it in a subprocess
	$(BIN)/pip install -q --no-deps --target $(VENV)/transformers-4.57 transformers==4.57.6 huggingface_hub==0.36.2 \
		tokenizers==0.22.2
	touch $(BIN)/looplm

install: $(BIN)/looplm

demo: $(BIN)/looplm
	$(BIN)/looplm demo --out results/demo

test: $(BIN)/looplm
	$(BIN)/python -m pytest tests

# the suite without the end-to-end tests marked @pytest.mark.slow (docs/testing.md)
test-fast: $(BIN)/looplm
	$(BIN)/python -m pytest tests -m "not slow"

clean:
	rm -rf $(VENV) results
