#!/usr/bin/env bash
# The whole test suite, with its set-up: installs fa2edu with its test, notebook and torch extras, then runs pytest.
# Extra arguments go to pytest. Kernels run in numba's CUDA simulator (tests/conftest.py selects it).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[test,notebooks,torch]" "torch==2.13.0"
python3 -m pytest -n 2 "$@"
