# Two entry points, each creating .venv if it is missing:
#   make tune   set everything up and run the main job
#   make test   set everything up and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch 2.13.0 lies on disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error

.PHONY: setup tune test lint bench mutants clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

tune: $(STAMP)
	$(VENV)/bin/slapo-tune tune

# two workers, a test file each at a time: the suite's ranks and Ray leave half of 2 cores idle
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) -m benchmarks

mutants: $(STAMP)
	$(PY) tools/mutation.py named

clean:
	rm -rf $(VENV) build *.egg-info
