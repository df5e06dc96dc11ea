#!/bin/sh
# CI entry point: lint, then run the unit tests.
set -eu
PYTHON="${PYTHON:-python3}"
export PYTHON
make check
echo "ci: all checks passed"
