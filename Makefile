# FastHorovod: the two commands of the README, and a few helpers.
#   make test   installs everything (apt, .venv, torch, horovod, fasthorovod) and runs the suite
#   make bench  installs everything and runs the main benchmark
PY := .venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup test test-fast bench clean

setup:
	@scripts/setup_env.sh

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not slow"

bench: setup
	scripts/bench.sh

clean:
	rm -rf build *.egg-info fasthorovod/_C*.so
