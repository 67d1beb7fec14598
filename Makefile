# aie — AI engineering from scratch. `make lab` to learn, `make test` to check everything.
# Every target sets itself up: a fresh clone needs only Python 3.10+ and network access to PyPI.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
AIE    := $(VENV)/bin/aie
MODEL  := data/models/smollm2-135m-instruct/aie-source.json
STAMP  := $(VENV)/.installed
# --nbval-cell-timeout: the grader's (DEFAULT_CELL_TIMEOUT_S), so a cell too slow for grading fails here
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with solutions/sanitize.cfg -p aie_lessons.course.nbval_plugin \
          --nbval-cell-timeout 300

.PHONY: lab test test-fast notebooks bench bench-gpu bench-throughput bench-serve model venv clean

venv: $(STAMP)
# pip byte-compiles every module it installs (about half of the install's time), and that must
# stay: where PYTHONDONTWRITEBYTECODE is set (as on the course machine), Python never writes the
# compiled modules itself, and every process would compile torch's from source at each import.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[dev,serve]"
	touch $(STAMP)

model: $(MODEL)
$(MODEL): | $(STAMP)
	$(AIE) fetch-model

## lab: set up everything, then serve the learner notebooks in JupyterLab (it prints the URL to
## open and how to stop it; the command line is aie_lessons/course/lab.py's, shared with the tests)
lab: venv model
	$(AIE) lab

## test: every test — unit, oracle (vs transformers), derived files in sync, the browser test of
## JupyterLab, nbval of the solution notebooks against their reference outputs, with the grader's
## cell timeout. `aie grade solutions` is not run: for the solutions, its two parts — nbval of each
## notebook and each stage's checks run sealed — are both here (tests/test_grade.py), so it would
## only run every notebook a second time (the longest phase of all); the grader itself is tested
## end to end on submissions of stage 02.
## Two pytest workers (pytest-xdist), a test file or notebook each at a time, one thread each: most
## tests are a fresh Python, a kernel or the model starting up, or small tensors — one core's work —
## so two side by side take far less than one after the other, while one thread each keeps them
## from fighting over the two cores (two processes of two threads each ran 2.4x slower here).
## The slowest tests and the time of each phase are printed at the end.
WORKERS ?= -n 2 --dist loadfile
test:
	@t0=$$(date +%s); \
	$(MAKE) --no-print-directory venv || exit $$?; t1=$$(date +%s); \
	$(MAKE) --no-print-directory model || exit $$?; t2=$$(date +%s); \
	OMP_NUM_THREADS=1 $(PY) -m pytest tests solutions/*.ipynb $(NBVAL) $(WORKERS) --durations=25; tests=$$?; t3=$$(date +%s); \
	echo "make test: install $$((t1 - t0)) s, model $$((t2 - t1)) s, pytest and nbval $$((t3 - t2)) s" \
	     "(exit $$tests), total $$((t3 - t0)) s"; \
	exit $$tests

## test-fast: unit tests on the tiny random models: no model download, no network, under a minute
test-fast: venv
	$(PY) -m pytest tests -m "not oracle and not slow" -q

## notebooks: regenerate modules, learner notebooks and executed solutions from solutions/*.py
notebooks: venv model
	$(PY) -m aie_lessons.course.build

## bench: decode speed of our decoders vs transformers, llama.cpp (the same weights) and the memory
## roofline, then the course's integer kernels vs PyTorch's on a step's quantized matrices, then the
## engine's compiled decode step vs the eager engine at 1, 4 and 16 requests, then
## `aie generate` from the outside (start-up and decode rate, compiled ahead of time vs the cached
## loop vs transformers); ratios, one run each. The first run builds llama-cpp-python from source.
LLAMA_CPP := $(VENV)/.llama-cpp
$(LLAMA_CPP): $(STAMP)
	$(PY) -m pip install -e ".[bench]" && touch $@ \
	    || echo "make bench: llama-cpp-python did not build; the benchmark runs without llama.cpp"

bench: venv model $(LLAMA_CPP)
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/int_kernels.py
	$(PY) benchmarks/engine_decode.py
	$(PY) benchmarks/cli_startup.py

## bench-gpu: on a machine with a CUDA GPU, stage 05's and stage 07's Triton kernels vs PyTorch's SDPA and
## the engine's decode step, eager vs compiled (each script says "skipped" without a GPU)
bench-gpu: venv model
	$(PY) benchmarks/flash_attention.py
	$(PY) benchmarks/paged_attention.py
	$(PY) benchmarks/engine_decode.py --device cuda --rows 1,16,64

## bench-throughput: continuous vs static batching vs transformers, paged KV vs slots, prefix caching (ratios, one run)
bench-throughput: venv model
	$(PY) benchmarks/throughput.py

## bench-serve: aie serve under load over loopback (a sweep of request rates, the saturated server vs the
## offline engine, a soak of 1,000 requests with disconnects); about 8 minutes
bench-serve: venv model
	$(PY) benchmarks/serve_load.py

clean:
	rm -rf $(VENV) data/cache .pytest_cache
