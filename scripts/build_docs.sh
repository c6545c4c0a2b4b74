#!/usr/bin/env bash
# Build the book (chapters/, executed by myst-nb) and the API reference as a static site: docs/_build/html/index.html.
#
#   bash scripts/build_docs.sh            # executes the chapters that changed since the last build (cache)
#   FA2EDU_DOCS_EXECUTE=force bash scripts/build_docs.sh     # re-execute every chapter
#   bash scripts/build_docs.sh -W         # extra arguments go to sphinx-build (here: warnings are errors)
#
# Offline once the `docs` extra is installed; if it is missing, this script installs it (that step needs PyPI).
# No GPU is needed: the GPU chapters run in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 unless you set it).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import importlib, sphinx, myst_nb, furo, jupytext, fa2edu; importlib.import_module('sphinx-mathjax-offline')" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check -e ".[docs]"
fi
export NUMBA_ENABLE_CUDASIM="${NUMBA_ENABLE_CUDASIM:-1}"
python3 -m sphinx -b html docs docs/_build/html "$@"
echo "The book is in docs/_build/html/index.html (open it in a browser)."
