#!/usr/bin/env bash
# Build the book (chapters/, executed by myst-nb) and the API reference as a static site: docs/_build/html/index.html.
#
#   bash scripts/build_docs.sh            # executes the chapters that changed since the last build (cache)
#   FA2EDU_DOCS_EXECUTE=force bash scripts/build_docs.sh     # re-execute every chapter
#   FA2EDU_DOCS_EXECUTE=off bash scripts/build_docs.sh       # no execution: the API reference and the text only
#   bash scripts/build_docs.sh -W         # extra arguments go to sphinx-build (here: warnings are errors)
#
# Warnings are printed but do not fail the build unless -W is given. The internal links of the built site are
# checked afterwards (docs/check_links.py): a link to a missing page or anchor fails the script.
#
# Offline once the `docs` extra is installed; if it is missing, this script installs it (that step needs PyPI).
# No GPU is needed: the GPU chapters run in numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 unless you set it).
# No PyTorch is needed either (the `docs` extra installs none): the API pages of the modules that need it are built
# against a stand-in (docs/conf.py), and the chapters' cells that need it print one line and are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import importlib, sphinx, myst_nb, furo, jupytext, ipykernel, fa2edu; importlib.import_module('sphinx-mathjax-offline')" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check -e ".[docs]"
fi
export NUMBA_ENABLE_CUDASIM="${NUMBA_ENABLE_CUDASIM:-1}"
python3 -m sphinx -b html docs docs/_build/html "$@"
python3 docs/check_links.py docs/_build/html
echo "The book is in docs/_build/html/index.html (open it in a browser)."
