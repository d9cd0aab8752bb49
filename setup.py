"""Builds fasthorovod's native module fasthorovod._C with CMake (pybind11 cmake_example style).

The project's metadata is in pyproject.toml; this file adds what setuptools cannot declare there:
the CMake-built extension and the extras table of fasthorovod/extras.py. The test-only module
fasthorovod_testing is not built here (``make testing-module``): it is never installed.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def extras_require() -> dict:
    """The extras table of fasthorovod/extras.py (read without importing the package)."""
    namespace: dict = {}
    exec(compile((ROOT / "fasthorovod" / "extras.py").read_text(), "extras.py", "exec"), namespace)
    return {extra: list(packages) for extra, packages in namespace["EXTRAS"].items()}


class CMakeExtension(Extension):
    """An extension whose sources CMakeLists.txt lists (the sdist carries them: MANIFEST.in)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if os.environ.get("DEBUG") else "Release"
        cmake = os.environ.get("CMAKE", "cmake")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            "-DFASTHOROVOD_BUILD_PYTHON=ON",
            "-DFASTHOROVOD_BUILD_TESTS=OFF",
            "-DFASTHOROVOD_BUILD_TESTING_MODULE=OFF",
        ] + os.environ.get("CMAKE_ARGS", "").split()
        subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        target = ext.name.split(".")[-1]
        subprocess.run([cmake, "--build", str(build_dir), "--target", target, "-j", jobs], check=True)


setup(
    ext_modules=[CMakeExtension("fasthorovod._C")],
    cmdclass={"build_ext": CMakeBuild},
    extras_require=extras_require(),
)
