"""Sphinx configuration: the fa2edu book (chapters/ as MyST notebooks, executed by myst-nb) and its API reference.

Build offline with ``bash scripts/build_docs.sh`` (or ``python -m sphinx -b html docs docs/_build/html``).
``docs/chapters`` is a link to the repository's ``chapters/``, so the notebooks are the single source of the book;
they execute with their working directory in ``chapters/``, as the chapter test runs them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# No GPU needed: numba's CUDA simulator, for autodoc's imports of kernels_gpu and for the executed chapters (the
# notebook kernels inherit this environment). A machine with a GPU can override it with NUMBA_ENABLE_CUDASIM=0.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")

import fa2edu  # noqa: E402  (after the environment is set)

project = "fa2edu"
author = "the fa2edu authors"
copyright = "fa2edu authors, MIT licence"
release = version = fa2edu.__version__

extensions = [
    "myst_nb",                     # MyST Markdown + notebook execution (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",      # a local copy of MathJax: the built book renders its maths with no network
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]
html_static_path = ["_static"]

# -- the chapters: MyST notebooks (jupytext format), executed at build time -------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "html_image"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("FA2EDU_DOCS_EXECUTE", "cache")   # "cache", "force" or "off"
nb_execution_timeout = 600         # seconds per cell: the simulator chapters are slow on one core
nb_execution_raise_on_error = True # a chapter that fails to execute fails the build
nb_execution_show_tb = True
nb_merge_streams = True
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")

# -- the API reference -------------------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False   # torch.autograd.Function's inherited docstrings point at PyTorch's own labels
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = True

# -- HTML --------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"fa2edu {release}: FlashAttention you can run"
html_theme_options = {"navigation_with_keys": True}
