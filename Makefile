# FastHorovod: the two commands of the README, and a few helpers.
#   make test   installs everything (apt, .venv, torch, horovod, fasthorovod) and runs the suite
#   make bench  installs everything and runs the main benchmark
#   make cpp-test  builds and runs the C++ unit tests (tests/cpp) alone; make test runs them first
PY := .venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup test test-fast cpp-test bench clean

setup:
	@scripts/setup_env.sh

test: setup cpp-test
	$(PY) -m pytest -q --durations=60 tests

# The C++ core's own tests (no Python): one executable over loopback TCP, built with CMake.
cpp-test:
	/usr/bin/cmake -S . -B build/cpp-tests -DFASTHOROVOD_BUILD_TESTS=ON -DFASTHOROVOD_BUILD_PYTHON=OFF \
	    -DCMAKE_BUILD_TYPE=Release
	/usr/bin/cmake --build build/cpp-tests --target fasthorovod_cpp_tests -j $$(nproc)
	build/cpp-tests/fasthorovod_cpp_tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow"

bench: setup
	scripts/bench.sh

clean:
	rm -rf build *.egg-info fasthorovod/_C*.so
