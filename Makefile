# vllm-hawk: the two commands a newcomer needs are `make demo` and `make test`.
# Environments are cached outside the repository under $(HAWK_CACHE) and rebuilt only
# when their requirements change (scripts/ensure_env.sh).
HAWK_CACHE ?= $(HOME)/.cache/vllm-hawk
export HAWK_CACHE
# The cached venv does not contain the project: every command runs this checkout's code.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
PY := $(shell bash scripts/ensure_env.sh path main)
# Triton for the GPU transform kernel under its interpreter (tests/transform/test_triton_kernel.py):
# a side folder, never on the vLLM venv's path (requirements/triton.txt).
export HAWK_TRITON_DIR := $(shell bash scripts/ensure_env.sh path triton)
PYTEST_ARGS ?=


# Each stage prints its wall time: "[stage] NAME: N s".
STAGE := bash scripts/stage.sh
# Under CI=true no test starts later than 85 min after make started (CI kills the job at 90 min;
# tests/conftest.py stops the run early so its log still ends with failures and timings).
ifneq ($(filter true 1,$(CI)),)
ifeq ($(HAWK_SUITE_DEADLINE),)
HAWK_SUITE_DEADLINE := $(shell echo $$(( $$(date +%s) + 5100 )))
endif
export HAWK_SUITE_DEADLINE
endif

.PHONY: demo compose-demo layout config-doc test test-fast test-security test-ttsim test-tt-decode test-amx-refused lint env ttnn-env triton-env tt-env tt-env-background ttsim-env kernel-deps which-python bench-transform bench-serve clean-env

which-python:  ## the interpreter every target uses
	@echo $(PY)

env:
	@$(STAGE) env bash scripts/ensure_env.sh main >/dev/null

ttnn-env:
	@$(STAGE) ttnn-env bash scripts/ensure_env.sh ttnn >/dev/null

triton-env: env
	@$(STAGE) triton-env bash scripts/ensure_env.sh triton >/dev/null

# The Tenstorrent decode node (CPython 3.12: vLLM 0.25.1 from its sdist, vllm-tt-plugin from
# ../shared/vllm-tt-plugin, ttnn, torch; requirements/tt-decode.txt) and ttnn on ttsim in it.
TT_PY = $(shell bash scripts/ensure_env.sh path tt 2>/dev/null)
tt-env-background:
	@bash scripts/ensure_env.sh tt-background

tt-env:
	@$(STAGE) tt-env bash scripts/ensure_env.sh tt >/dev/null
	@$(STAGE) tt-ttsim-env bash scripts/ttsim_env.sh --env tt >/dev/null || echo "[hawk-ttsim] no simulator runtime: tests/tt_decode fail under CI=true, skip otherwise" >&2

kernel-deps:
	@$(STAGE) kernel-deps bash scripts/kernel_deps.sh

# ttnn on Tenstorrent's simulator (HAWK_TTSIM_DIR, default ../shared/ttsim). Without it the
# tests/ttsim group fails under CI=true (and skips locally); the rest of the suite runs.
ttsim-env: ttnn-env
	@$(STAGE) ttsim-env bash scripts/ttsim_env.sh >/dev/null || echo "[hawk-ttsim] no simulator runtime: tests/ttsim fail under CI=true, skip otherwise" >&2

demo: env  ## the main job: prefill vLLM + decode vLLM + proxy on this machine, a few requests
	$(PY) examples/pd_local/run_demo.py

# The same GN-HAWK pair in Docker, one container per node on a user-defined network (examples/compose/):
# builds what it needs (cached under $(HAWK_CACHE)/compose and $(HAWK_CACHE)/docker), runs the
# checking client, tears everything down. Root: it installs docker.io and starts its own dockerd.
compose-demo: env
	bash scripts/compose_demo.sh demo

layout: env  ## how a Llama-3.1-70B request maps onto a p150a's DRAM banks
	$(PY) -m vllm_hawk.cli layout

config-doc: env  ## regenerate docs/configuration.md's field table from vllm_hawk/connector/config.py
	$(PY) -m vllm_hawk.connector.config_doc --write

lint: env  ## ruff format --check and ruff check, configured in pyproject.toml
	@$(STAGE) lint bash -c '$(dir $(PY))ruff format --check . && $(dir $(PY))ruff check .'

# Two pytest stages, each with its own time: the docker-compose two-node run (tests/twohost,
# marker `compose`), then everything else; the last closing line counts the main suite.
# The tt decode environment builds in the background from the start (mostly downloads), while
# the other environments and the compose stage run; the tt-env stage then waits for it.
test: tt-env-background env ttnn-env triton-env kernel-deps ttsim-env lint  ## the whole suite, as CI runs it
	@$(STAGE) compose $(PY) -m pytest -q -p no:cacheprovider -m compose $(PYTEST_ARGS) tests/twohost
	@$(MAKE) --no-print-directory tt-env
	@$(STAGE) tt-decode $(MAKE) --no-print-directory test-tt-decode
	@$(STAGE) pytest $(PY) -m pytest -q -p no:cacheprovider -m "not compose" --durations=25 $(PYTEST_ARGS) tests

# vLLM 0.25.1 + vllm-tt-plugin + the HAWK decode worker on simulated Tenstorrent chips, fed by a
# vLLM 0.32 CPU prefill (HAWK_MAIN_PYTHON): tests/tt_decode, run by the tt environment's Python.
test-tt-decode: env tt-env
	HAWK_MAIN_PYTHON=$(PY) $(TT_PY) -m pytest -q -p no:cacheprovider -m tt_decode --durations=0 $(PYTEST_ARGS) tests/tt_decode

# The pure tests: no vLLM engine, no simulator, no kernel build, no Docker, no root or apt (markers
# are set per folder in tests/conftest.py).
test-fast: env triton-env lint  ## minutes, not tens of minutes
	@$(STAGE) pytest-fast $(PY) -m pytest -q -p no:cacheprovider -m "not (vllm or ttnn or ttsim or kernel or guest or compose or netns)" $(PYTEST_ARGS) tests

test-security: env  ## the attacker tests (tests/security): floods, fuzzing, each attack on real components
	@$(STAGE) pytest-security $(PY) -m pytest -q -p no:cacheprovider --durations=0 $(PYTEST_ARGS) tests/security

test-ttsim: env ttsim-env  ## only tt-metal-on-ttsim vs the emulated device, timed
	$(PY) -m pytest -q -p no:cacheprovider --durations=0 $(PYTEST_ARGS) tests/ttsim

# The engine tests as on a CI machine that advertises AMX but dies with SIGILL on it: everything
# under scripts/amx_refused.c is refused the AMX tile state (seccomp). `make test` itself runs one
# TP=2 engine that way (tests/test_vllm_launcher.py); this runs the rest (AMX_TESTS to choose).
AMX_TESTS ?= tests/e2e tests/tt_plugin tests/test_vllm_kv_layouts.py tests/test_vllm_launcher.py
test-amx-refused: env
	@command -v gcc >/dev/null || { echo "test-amx-refused: needs gcc (apt-get install gcc)" >&2; exit 2; }
	@mkdir -p $(HAWK_CACHE) && gcc -O2 -o $(HAWK_CACHE)/amx_refused scripts/amx_refused.c
	$(HAWK_CACHE)/amx_refused $(PY) -m pytest -q -p no:cacheprovider -m "not compose" $(PYTEST_ARGS) $(AMX_TESTS)

bench-transform: env
	$(PY) -m vllm_hawk.cli bench transform

# Serving under load (the paper's SLO sweep): all configurations + collocated, both workloads;
# BENCH_ARGS=--quick for the < 5 min smoke sweep.
bench-serve: env
	$(PY) -m vllm_hawk.cli bench serve $(BENCH_ARGS)

clean-env:
	rm -rf $(HAWK_CACHE)
