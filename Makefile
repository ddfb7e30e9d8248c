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

.PHONY: all install build demo test lint bench clean

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

clean:
	rm -rf build $(VENV) tagps/_core*.so *.egg-info
