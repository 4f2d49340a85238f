# `make demo` trains the demo config; `make test` runs the suite. Both build .venv from nothing: the demo
# installs disttrain and its own dependencies only, the suite adds the test tools, DeepSpeed, trackers, Ray and torchao.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
NPROC ?= auto
export OMP_NUM_THREADS ?= 1
# Python's default, whatever the environment says: compiled modules are cached beside their sources (with
# PYTHONDONTWRITEBYTECODE set, every process of the suite would compile disttrain and the tests again).
export PYTHONDONTWRITEBYTECODE =

.PHONY: demo test test-slow venv bench bench-env bench-compare clean

venv: $(STAMP)

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade -c constraints.txt pip setuptools wheel
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(DEMO_STAMP)

# One pip call: torch is in place from the demo's install, so DeepSpeed's setup (which imports it) builds
# without isolation beside the other extras.
$(STAMP): $(DEMO_STAMP)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt --no-build-isolation -e '.[test,deepspeed,trackers,ray,float8]'
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/disttrain train configs/demo.yaml --nproc-per-node $(NPROC)

# Three pytest workers, one test module each at a time, on a 2-core machine: a test that waits (a restart, a
# watchdog, a lease) or a process starting up leaves a core idle, which the third fills
# (docs/benchmarks/test-suite.md).
TEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

# The slow tests (`.ci/run` runs them after `make test`): elastic node loss and rejoin, the exit barrier, DeepSpeed
# under srun, and the longest layout matrices (listed in tests/conftest.py, SLOW_TIER). Two workers: the node tests
# time real restarts, which a third worker's load would stretch.
SLOW_WORKERS ?= 2
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n $(SLOW_WORKERS) --dist loadfile tests

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py --reps 3

# Accelerate and Lightning Fabric for side-by-side benchmarks: a separate venv that reuses .venv's torch.
bench-env: $(STAMP)
	test -x .bench-venv/bin/python || $(PYTHON) -m venv .bench-venv
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > "$$(.bench-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/disttrain_venv.pth"
	.bench-venv/bin/python -m pip install -q -c constraints.txt -r benchmarks/requirements-compare.txt

bench-compare: bench-env
	$(BIN)/python benchmarks/overhead.py --reps 3 --compare

clean:
	rm -rf $(VENV) .bench-venv runs .pytest_cache
