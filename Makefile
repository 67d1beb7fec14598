# aie — AI engineering from scratch. `make lab` to learn, `make test` to check everything.
# Every target sets itself up: a fresh clone needs only Python 3.10+ and network access to PyPI.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
AIE    := $(VENV)/bin/aie
MODEL  := data/models/smollm2-135m-instruct/aie-source.json
STAMP  := $(VENV)/.installed
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with solutions/sanitize.cfg -p aie_lessons.course.nbval_plugin

.PHONY: lab test test-fast notebooks bench bench-throughput model venv clean

venv: $(STAMP)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

model: $(MODEL)
$(MODEL): | $(STAMP)
	$(AIE) fetch-model

## lab: set up everything, then serve the learner notebooks in JupyterLab
# (as root, e.g. in a container, Jupyter refuses to start without --allow-root)
lab: venv model
	@echo "JupyterLab starts below: open the http://127.0.0.1:…/lab?token=… URL it prints (the browser may open it for you). Stop the server with Ctrl-C, twice."
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

## test: every test — unit, oracle (vs transformers), derived files in sync, nbval of the
## solution notebooks; then the grader on the solutions, which runs every notebook a second time
## against its reference outputs (proving them deterministic) and must give 100%
test: venv model
	@t0=$$(date +%s); \
	$(PY) -m pytest tests solutions/*.ipynb $(NBVAL) && t1=$$(date +%s) && \
	$(AIE) grade solutions && t2=$$(date +%s) && \
	echo "make test: pytest and nbval $$((t1 - t0)) s, grading (every notebook again) $$((t2 - t1)) s, total $$((t2 - t0)) s"

## test-fast: unit tests on the tiny random models: no model download, no network, under a minute
test-fast: venv
	$(PY) -m pytest tests -m "not oracle and not slow" -q

## notebooks: regenerate modules, learner notebooks and executed solutions from solutions/*.py
notebooks: venv model
	$(PY) -m aie_lessons.course.build

## bench: decode speed of our engine vs transformers vs the memory roofline (ratios, one run)
bench: venv model
	$(PY) benchmarks/decode.py

## bench-throughput: continuous vs static batching vs transformers, paged KV vs slots, prefix caching (ratios, one run)
bench-throughput: venv model
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) data/cache .pytest_cache
