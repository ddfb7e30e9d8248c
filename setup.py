"""Build tagps and its C++ core `tagps._core` through CMake (after pybind11's cmake_example)."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

VERSION = "0.1.0"
ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build with CMake; honours DEBUG, CMAKE_ARGS and CMAKE_BUILD_PARALLEL_LEVEL."""

    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        config = "Debug" if os.environ.get("DEBUG", "0") == "1" else "Release"
        # A build folder that survives between installs keeps rebuilds incremental.
        build_temp = ROOT / "build" / f"cmake-{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        build_temp.mkdir(parents=True, exist_ok=True)
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DTAGPS_VERSION_INFO={VERSION}",
        ]
        cmake_args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]
        build_args = ["--config", config]
        if "CMAKE_BUILD_PARALLEL_LEVEL" not in os.environ:
            build_args += [f"-j{os.cpu_count() or 1}"]
        subprocess.run(["cmake", str(ROOT), *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)


STRATEGY = ["pymetis>=2023.1", "cvxpy>=1.5", "highspy>=1.7", "torch-geometric>=2.5", "matplotlib>=3.7"]
TEST = ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.100", "ruff>=0.6", "psutil>=5.9"]

setup(
    name="tagps",
    version=VERSION,
    description="Topology-aware graph deployment (TAG) on a BytePS-style communication runtime",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["tagps", "tagps.*"]),
    package_data={
        "tagps": ["py.typed", "strategy/weights/*.pt", "strategy/weights/*.json", "strategy/profiles/*.json"]
    },
    ext_modules=[CMakeExtension("tagps._core")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["numpy>=1.24", "torch==2.13.0", "pyzmq>=25", "pyyaml>=6", "tqdm>=4.60"],
    extras_require={"strategy": STRATEGY, "test": STRATEGY + TEST},
    entry_points={
        "console_scripts": ["bpslaunch=tagps.launcher:main", "tagps=tagps.cli:main"],
    },
    zip_safe=False,
)
