#!/usr/bin/env bash
# The whole test suite, with its set-up: installs fa2edu and the test extras, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[test,notebooks]"
python3 -m pytest -n 2 "$@"
