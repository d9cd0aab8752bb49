# FastHorovod: the two commands of the README, and a few helpers.
#   make test   installs everything (apt, .venv, torch, horovod, fasthorovod) and runs the suite
#   make bench  installs everything and runs the main benchmark
#   make test-fast  the C++ tests, the unit tests and a 2-rank smoke job through the proxies
#   make cpp-test  builds and runs the C++ unit tests (tests/cpp) alone; make test runs them first
#   make testing-module  builds the test-only module fasthorovod_testing into tests/native/
#   make setup-torchvision  a second environment, .venv-torchvision, for Horovod's own examples
#   make lab-test  the lab's tests (lab/tests), which make test leaves out
PY := .venv/bin/python
# One CMake tree for what only the tests use: the C++ test executable and fasthorovod_testing.
TEST_BUILD := build/tests
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup setup-torchvision test test-fast lab-test cpp-build cpp-test testing-module test-build bench clean

setup:
	@scripts/setup_env.sh

# A second environment with torchvision (torch 2.14.1, a CUDA build that runs on the CPU; about
# 5.5 GB) for Horovod's own examples: benchmarks/horovod_synthetic.py runs in it.
setup-torchvision:
	@FASTHOROVOD_VENV=$(CURDIR)/.venv-torchvision \
	    FASTHOROVOD_TORCH_PACKAGES="torch==2.14.1 torchvision==0.29.1" scripts/setup_env.sh

test: cpp-test testing-module
	$(PY) -m pytest -q --durations=60 tests

# The lab's own tests (lab/: the scale model and the placement planner, which no user runs).
lab-test: testing-module
	$(PY) -m pytest -q lab/tests

test-build: setup
	/usr/bin/cmake -S . -B $(TEST_BUILD) -DCMAKE_BUILD_TYPE=Release -DFASTHOROVOD_BUILD_TESTS=ON \
	    -DFASTHOROVOD_BUILD_PYTHON=OFF -DFASTHOROVOD_BUILD_TESTING_MODULE=ON \
	    -DPython_EXECUTABLE=$(abspath $(PY)) -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir)

# The C++ core's own tests (no Python): one executable over loopback TCP.
cpp-build: test-build
	/usr/bin/cmake --build $(TEST_BUILD) --target fasthorovod_cpp_tests -j $$(nproc)

cpp-test: cpp-build
	$(TEST_BUILD)/fasthorovod_cpp_tests

testing-module: test-build
	/usr/bin/cmake --build $(TEST_BUILD) --target fasthorovod_testing -j $$(nproc)

# The tier to run while developing: the C++ tests, the unit tests and one 2-rank job through the proxies.
test-fast: cpp-test testing-module
	$(PY) -m pytest -q tests/unit tests/multiproc/test_smoke.py

bench: setup
	scripts/bench.sh

clean:
	rm -rf build dist *.egg-info fasthorovod/_C*.so tests/native
