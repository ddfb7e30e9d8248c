# `make demo` and `make test` work on a fresh machine: they create (or reuse) .venv, install tagps with
# its test extras through requirements/constraints.txt (torch pinned to the 2.13.0 CPU build), build the
# C++ core, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch 2.13.0 CPU wheel lies in /opt/wheels on these machines; elsewhere pip finds it on PyPI.
WHEELS := $(wildcard /opt/wheels)
PIP := $(PY) -m pip install --disable-pip-version-check -c requirements/constraints.txt $(if $(WHEELS),--find-links $(WHEELS))
STAMP := $(VENV)/.tagps-installed
# The C++ communication engine links libzmq (Debian: libzmq3-dev). As root without it, install it; otherwise
# the core builds without the engine and says so.
SYSTEM_DEPS := if ! pkg-config --exists libzmq 2>/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libzmq3-dev pkg-config; fi
PYTEST_ARGS ?=

.PHONY: all install build demo test lint bench bench-deps compat-deps compat clean

all: test

$(STAMP): setup.py pyproject.toml requirements/constraints.txt
	$(SYSTEM_DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) setuptools wheel pybind11==3.1.0 cmake ninja
	$(PIP) --no-build-isolation -e '.[test]'
	touch $@

install: $(STAMP)

# Incremental rebuild of tagps._core after a change under csrc/ (CMake keeps its folder under build/).
build: $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace

demo: build
	$(PY) -m tagps.cli demo

test: build
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: build
	$(PY) bench/kernels.py

# Horovod 0.28.1 (gloo, CPU) built from its sdist into the venv, so that bench/e2e_local.py and
# bench/e2e_cluster.py measure it beside tagps (bench/build_horovod.sh says what it patches and why).
# Through the constraints, so torch stays the pinned build; skipped when horovod.torch already imports.
# CMAKE_POLICY_VERSION_MINIMUM: the venv's CMake 4 refuses third_party/gloo's cmake_minimum_required(2.8.12)
# without it. MAKEFLAGS=-j2 replaces horovod's -j8 (two cores here).
HOROVOD_ENV := HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
	HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo HOROVOD_CMAKE=$(abspath $(VENV))/bin/cmake \
	CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2
bench-deps: $(STAMP)
	if $(PY) -c 'import horovod.torch' 2>/dev/null; then echo 'horovod.torch already imports'; else \
	  src=$$(bench/build_horovod.sh $(PY) build/horovod) && \
	  $(HOROVOD_ENV) $(PIP) --no-build-isolation "$$src" && $(PY) -c 'import horovod.torch'; fi

# Horovod's and BytePS's public PyTorch examples, run unchanged but for their imports (bench/public_scripts.py).
# They need torchvision, hence a second venv with torch 2.13.0's CUDA build (requirements/compat.txt says
# why); tagps comes from this checkout through PYTHONPATH. SCRIPTS: a folder holding the four scripts,
# which this repo does not ship.
COMPAT_VENV ?= .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.tagps-compat-installed
$(COMPAT_STAMP): requirements/compat.txt
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip --isolated install --disable-pip-version-check -r requirements/compat.txt
	touch $@
compat-deps: $(COMPAT_STAMP)

compat: build $(COMPAT_STAMP)
	test -n "$(SCRIPTS)" || { echo 'make compat SCRIPTS=DIR: DIR holds the four public scripts (bench/public_scripts.py)'; exit 2; }
	$(COMPAT_VENV)/bin/python bench/public_scripts.py --scripts "$(SCRIPTS)"

clean:
	rm -rf build $(VENV) $(COMPAT_VENV) tagps/_core*.so *.egg-info
