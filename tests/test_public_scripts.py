"""bench/public_scripts.py: the public examples are ported by their import lines alone, and the synthetic
MNIST is in the idx format torchvision reads (checked here against the format itself: torchvision does not
import beside this project's torch)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def public_scripts() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the benchmarks import benchlib from their own folder
    try:
        spec = importlib.util.spec_from_file_location("public_scripts", BENCH / "public_scripts.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["public_scripts"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("public_scripts", None)
        sys.path.remove(str(BENCH))


def test_only_the_framework_imports_change(public_scripts: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "train.py"
    source.write_text(
        "import horovod\nimport horovod.torch as hvd\n"
        "import horovod.torch as hvd  # a comment keeps the line as it is\n"
        "x = 'import byteps.torch as bps'\n    import byteps.torch as bps\nimport byteps.torch as bps\n"
    )
    ported = tmp_path / "out" / "train.py"
    ported.parent.mkdir()
    diff = public_scripts.port_script(source, ported)
    assert ported.read_text().splitlines() == [
        "import tagps as horovod",
        "import tagps.torch as hvd",
        "import horovod.torch as hvd  # a comment keeps the line as it is",
        "x = 'import byteps.torch as bps'",
        "    import byteps.torch as bps",
        "import tagps.torch as bps",
    ]
    assert sorted(line[1:] for line in diff if line.startswith("-")) == [
        "import byteps.torch as bps",
        "import horovod",
        "import horovod.torch as hvd",
    ]


def _read_idx(path: Path) -> np.ndarray:
    """The idx format as MNIST documents it: two zero bytes, type 0x08 (uint8), rank, big-endian dims."""
    data = path.read_bytes()
    assert data[:3] == b"\x00\x00\x08"
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def test_synthetic_mnist_is_idx_and_learnable(public_scripts: ModuleType, tmp_path: Path) -> None:
    public_scripts.write_synthetic_mnist(tmp_path, train=500, test=100, seed=3)
    raw = tmp_path / "MNIST" / "raw"
    images = _read_idx(raw / "train-images-idx3-ubyte")
    labels = _read_idx(raw / "train-labels-idx1-ubyte")
    assert images.shape == (500, 28, 28) and labels.shape == (500,)
    assert _read_idx(raw / "t10k-images-idx3-ubyte").shape == (100, 28, 28)
    assert set(labels.tolist()) == set(range(10))
    # Nearest class mean classifies the test set far above the 10 % of a guess: there is something to learn.
    means = np.stack([images[labels == k].mean(0) for k in range(10)]).reshape(10, -1)
    test = _read_idx(raw / "t10k-images-idx3-ubyte").reshape(100, -1).astype(float)
    guess = ((test[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (guess == _read_idx(raw / "t10k-labels-idx1-ubyte")).mean() > 0.9
