# Fresh-machine entry points: `make demo` and `make test` set up .venv and run.
PY := .venv/bin/python
STAMP := .venv/.poplar-installed

.PHONY: demo test test-fast setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned here (a CPU build is on disk); pyproject only declares a range.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m poplar demo

# two workers, a test file each at a time (a file's fixtures are built once): the multi-process
# tests spend much of their time waiting on sleeps and sockets, so two files share 2 cores well.
# Files go out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST), not
# reordered by their number of tests. The tests that bound real wall time (marked `timing`: the
# emulator's pacing) run after, alone, so the other worker's load is not in what they measure.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not timing"
	$(PY) -m pytest -m timing --durations=5

# the edit-test loop: every test that runs in this one process (no gloo ranks, no torchrun)
test-fast: $(STAMP)
	$(PY) -m pytest -m "not multiprocess"

clean:
	rm -rf .venv
