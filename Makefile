# Fresh-machine entry points: `make demo` and `make test` set up .venv and run.
PY := .venv/bin/python
STAMP := .venv/.poplar-installed

.PHONY: demo test test-fast gpu-checks setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned here (a CPU build is on disk); pyproject only declares a range.
	$(PY) -m pip install -q torch==2.13.0
	# no byte-compiling of every module of every extra here: the runs compile what they import
	# (PYTHONDONTWRITEBYTECODE is unexported below), most of transformers and Lightning they never do
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m poplar demo

# three workers, a test file each at a time (a file's fixtures are built once): the multi-process
# tests spend much of their time waiting on sleeps, rendezvous and sockets, so three files share 2
# cores well (fresh clones of one tree, the same hour: 628 and 694 s with three, 698 s with two).
# Files go out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST), not
# reordered by their number of tests. The tests that bound real wall time (marked `timing`: the
# emulator's pacing) run after, alone, so the other worker's load is not in what they measure.
# The suite starts some 250 Python interpreters (launchers, ranks, command lines) and forks some 550
# ranks that import their test module: where the machine sets PYTHONDONTWRITEBYTECODE each of them
# compiled the project's modules and the test modules it imports from source again, so every
# target here runs with the bytecode cache (__pycache__ is ignored by git).
# The timing pass collects only the files that hold `timing` tests (collecting the whole suite
# imports Lightning and transformers: seconds of the pass, which runs alone).
TIMING_FILES = $(shell grep -rl --include='*.py' 'mark\.timing' tests)
unexport PYTHONDONTWRITEBYTECODE
test: $(STAMP)
	$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder -m "not timing"
	$(PY) -m pytest -m timing --durations=5 $(TIMING_FILES)

# the edit-test loop: every test that runs in this one process (no gloo ranks, no torchrun) and bounds no
# wall time (the emulator's pacing tests need a machine to themselves: `make test` runs them alone)
test-fast: $(STAMP)
	$(PY) -m pytest -m "not multiprocess and not timing"

# on a machine with a CUDA GPU (torch with CUDA already there; not part of `make test`): every
# CUDA and NCCL test, then the engine against torch with collectives on the wire, each step bounded,
# logs and one trace under $(GPU_OUT). Ranks share the GPUs there are (poplar.emulation.gpu_ranks).
GPU_OUT ?= gpu-out
GPU_PY ?= python3
gpu-checks:
	mkdir -p $(GPU_OUT)
	-nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $(GPU_OUT)/env.txt
	-timeout 240 $(GPU_PY) -m pytest -p no:cacheprovider -k "cuda or nccl" tests/comm tests/zero tests/profiler \
		tests/engine > $(GPU_OUT)/tests.txt 2>&1; tail -3 $(GPU_OUT)/tests.txt
	-timeout 150 $(GPU_PY) bench/engine_vs_torch.py --device cuda --world 2 --zero0-only \
		--zero0-shapes 4x256,8x384,12x768 --trace $(GPU_OUT) > $(GPU_OUT)/zero0.txt 2>&1; tail -1 $(GPU_OUT)/zero0.txt
	-timeout 180 $(GPU_PY) bench/engine_vs_torch.py --device cuda --world 2 --layers 8 --repeats 3 --iters 2 \
		--zero0-shapes '' --zero1-shapes '' > $(GPU_OUT)/main.txt 2>&1; tail -1 $(GPU_OUT)/main.txt

clean:
	rm -rf .venv
