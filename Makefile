# Two commands for a new user: `make bench` (the main job) and `make test`.
# Everything installs into .venv from pyproject.toml; nothing is installed by hand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A CPU build of torch; pinned so pip does not pull the CUDA build (gigabytes).
TORCH_SPEC ?= torch==2.13.0
# Which kernel libraries `make kernels` (re)builds; default: CPU, plus CUDA when nvcc exists.
TARGETS ?=
DTYPES ?=
# Worker processes compiling them (default: the machine's cores, at most 8).
JOBS ?=
# Extra arguments for the benchmark, e.g. BENCH_ARGS="--seq-lens 512,1024 --out /tmp/quick".
BENCH_ARGS ?=

.PHONY: setup kernels test lint bench info wheel gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[build,test,bench,lint]"
	touch $@

kernels: setup
	cmake -S . -B build/cmake -DPython3_EXECUTABLE=$(abspath $(PY)) \
		-DKERNEL_TARGETS="$(TARGETS)" -DKERNEL_DTYPES="$(DTYPES)" -DKERNEL_JOBS="$(JOBS)" > /dev/null
	cmake --build build/cmake --target kernels -- --no-print-directory

# A worker per core (pytest-xdist; conftest gives each one intra-op thread).
test: setup
	$(PY) -m pytest -n auto

# ruff's lint and format check (configured in pyproject.toml) and mypy on the public API's modules.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: kernels
	$(PY) -m bench $(BENCH_ARGS)

info: setup
	$(PY) -m longformer_ops.info

# A platform wheel of longformer_ops carrying prebuilt/ (refused if prebuilt/ is stale: run `make kernels`).
# build/lib* goes first: setuptools would package whatever an earlier build left there.
wheel: setup
	rm -rf build/lib* build/bdist.*
	$(PY) -m pip wheel --no-deps -w dist .

# On a machine with a CUDA GPU (and a CUDA build of torch: TORCH_SPEC=torch): the tests marked
# `gpu`, then every kernel under compute-sanitizer's memcheck and racecheck.
gpu-check: setup
	$(PY) -m pytest tests -m gpu
	compute-sanitizer --tool memcheck --error-exitcode 1 $(PY) tools/sanitize_cuda_kernels.py
	compute-sanitizer --tool racecheck --error-exitcode 1 $(PY) tools/sanitize_cuda_kernels.py

clean:
	rm -rf build dist $(VENV) .pytest_cache
