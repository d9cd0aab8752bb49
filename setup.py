"""Builds fasthorovod and its native modules with CMake (pybind11 cmake_example style): fasthorovod._C,
the production module, and fasthorovod._C_testing, the test-only entry points."""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def extras_require() -> dict:
    """The extras table of fasthorovod/extras.py (read without importing the package)."""
    namespace: dict = {}
    exec(compile((ROOT / "fasthorovod" / "extras.py").read_text(), "extras.py", "exec"), namespace)
    return {extra: list(packages) for extra, packages in namespace["EXTRAS"].items()}


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"  # one tree: the core is built once
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if os.environ.get("DEBUG") else "Release"
        cmake = os.environ.get("CMAKE", "cmake")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
        ] + os.environ.get("CMAKE_ARGS", "").split()
        subprocess.run([cmake, str(ROOT), *args], cwd=build_dir, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        target = ext.name.split(".")[-1]
        subprocess.run([cmake, "--build", ".", "--target", target, "-j", jobs], cwd=build_dir, check=True)


setup(
    name="fasthorovod",
    version="0.1.0",
    description="Horovod for PyTorch over k parallel TCP flows per worker (CPU proxy data plane)",
    packages=find_packages(include=["fasthorovod", "fasthorovod.*"]),
    package_data={"fasthorovod": ["_C.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("fasthorovod._C"), CMakeExtension("fasthorovod._C_testing")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    # numpy: the trace analysis (fasthorovod-trace) reads the proxies' records with it; torch does
    # not install it. Optional packages are extras (fasthorovod/extras.py says what needs which).
    install_requires=["horovod==0.28.1", "torch", "psutil", "numpy"],
    extras_require=extras_require(),
    entry_points={"console_scripts": ["fasthorovodrun = fasthorovod.runner.launch:main",
                                     "fasthorovod-trace = fasthorovod.trace.cli:main"]},
)
