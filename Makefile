# The two commands of a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs. torch is installed first, pinned to the
# CPU build this project targets, so nothing pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
NPROC  ?= 2
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup test demo plan bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The main job: a 2-process CPU SFT run of a tiny Qwen3 on builtin:arithmetic (a few minutes).
demo: $(STAMP)
	$(VENV)/bin/shardwise plan examples/sft_arithmetic.yaml --world-size $(NPROC)
	$(VENV)/bin/shardwise train examples/sft_arithmetic.yaml --nproc $(NPROC)

plan: $(STAMP)
	$(VENV)/bin/shardwise plan examples/tiny_qwen3.yaml --world-size $(NPROC)

clean:
	rm -rf $(VENV) runs results
