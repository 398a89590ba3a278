# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install gpu-check bench clean

$(STAMP): pyproject.toml requirements-pins.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements-pins.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/overdrive optimize minilm --overwrite

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --durations=20

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/minilm_cpu.py

# For a lent GPU machine: uses that machine's own python3 and packages, installs nothing.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf out .pytest_cache
