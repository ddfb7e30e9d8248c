#!/usr/bin/env bash
# The GPU check of tagps (issue 13), for a GPU machine without internet; about 3 minutes on one H200.
#
#   bench/gpu.sh [WHEEL_DIR]        PYTHON=python3 by default
#
# 1. Installs the wheels in WHEEL_DIR (--no-index --no-deps, into /tmp/tagps-site) when a module tagps
#    needs is missing (pyzmq and pymetis usually are on the GPU machine).
# 2. Builds tagps._core in place and puts the repository on PYTHONPATH.
# 3. Runs tests/torch/test_gpu.py (the gpu tests and the CPU checks beside them); output in
#    bench/results/gpu-tests.log.
# 4. Runs bench/gpu.py, which writes bench/results/gpu.json (it runs even when a test failed).
#
# Exit status: 3 when the host has no usable CUDA (checked first; nothing built, run or written); 2 when
# modules are missing and no wheel folder provides them, or the build fails; otherwise bench/gpu.py's
# status when it failed, else pytest's (0: every gpu test passed or skipped and the JSON is written).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${1:-}
NEEDED="zmq pymetis numpy pytest pytest_timeout pybind11"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
    echo "bench/gpu.sh: no CUDA on this host ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1)): nothing run" >&2
    exit 3
fi
missing=$("$PY" - $NEEDED <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    if [ -z "$WHEELS" ]; then
        echo "bench/gpu.sh: missing Python modules: $missing; pass a folder of wheels: bench/gpu.sh DIR" >&2
        exit 2
    fi
    echo "installing wheels from $WHEELS for: $missing"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tagps-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/tagps-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
"$PY" setup.py --quiet build_ext --inplace || exit 2

mkdir -p bench/results
"$PY" -m pytest -q -p no:cacheprovider -rs tests/torch/test_gpu.py 2>&1 | tee bench/results/gpu-tests.log
tests=${PIPESTATUS[0]}
"$PY" bench/gpu.py --tests-log bench/results/gpu-tests.log
bench=$?
[ "$bench" -ne 0 ] && exit "$bench"
exit "$tests"
