"""Sphinx configuration: the fa2edu book (chapters/ as MyST notebooks, executed by myst-nb) and its API reference.

Build offline with ``bash scripts/build_docs.sh`` (or ``python -m sphinx -b html docs docs/_build/html``).
``docs/chapters`` is a link to the repository's ``chapters/``, so the notebooks are the single source of the book;
they execute with their working directory in ``chapters/``, as the chapter test runs them.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# No GPU needed: numba's CUDA simulator, for autodoc's imports of kernels_gpu and for the executed chapters (the
# notebook kernels inherit this environment). A machine with a GPU can override it with NUMBA_ENABLE_CUDASIM=0.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
# No progress bars of simulated launches in the executed chapters: the built page would keep their raw text.
os.environ.setdefault("FA2EDU_PROGRESS", "0")

import fa2edu  # noqa: E402  (after the environment is set)

# PyTorch is optional, and the book's route does not install it (a reader without a GPU should not download its CUDA
# build). Without it, autodoc imports the torch modules (fa2edu.torch, fa2edu.distributed, and the private
# fa2edu._torch_ops) against a stand-in ``torch`` (autodoc_mock_imports): their pages still list every function with
# its signature and docstring as with PyTorch installed (their module docstrings say that they need it). The
# chapters' torch cells skip themselves with a one-line note (``%%needs torch``, fa2edu/notebook.py). With torch
# installed nothing is mocked.
try:
    importlib.import_module("torch")
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
autodoc_mock_imports = [] if HAVE_TORCH else ["torch"]

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
nb_render_markdown_format = "myst"   # Markdown outputs (tables, highlighted listings) parse as the chapters do
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")

# -- the API reference -------------------------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_inherit_docstrings = False   # torch.autograd.Function's inherited docstrings point at PyTorch's own labels
autodoc_default_options = {"show-inheritance": True}
autodoc_typehints_description_target = "documented_params"   # types join the documented entries, no bare ones
napoleon_google_docstring = True
napoleon_numpy_docstring = True
napoleon_use_ivar = True             # "Attributes" as a field list: the fields are not described twice


def _reexports() -> dict[str, list[str]]:
    """Per module, the names in its ``__all__`` that are defined in another module of the two packages.

    kernels_gpu's modules re-export fa2edu's result types (``kernels_gpu.flash2.Flash2Forward`` *is*
    ``fa2edu.flash2.Flash2Forward``). Documented on both pages, one object would get two descriptions, and
    sphinx.ext.viewcode keeps one back-link per object: the source page's "[docs]" link would then pair one page
    with the other page's anchor. So each object is described once, where it is defined, and the module template
    lists a re-export as a link to it (``autosummary_context`` below).
    """
    import importlib
    import pkgutil

    from sphinx.ext.autodoc.mock import mock

    import kernels_gpu
    found = {}
    for package in (fa2edu, kernels_gpu):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            with mock(autodoc_mock_imports):      # as autodoc will import it: torch mocked where it is missing
                module = importlib.import_module(info.name)
            names = [name for name in getattr(module, "__all__", [])
                     if getattr(getattr(module, name, None), "__module__", module.__name__) != module.__name__]
            if names:
                found[info.name] = {name: f"{getattr(module, name).__module__}.{name}" for name in names}
    return found


autosummary_context = {"reexports": _reexports()}


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """A NamedTuple's fields are described in its docstring's Attributes; skip their "Alias for field" entries."""
    if isinstance(obj, property) or type(obj).__name__ == "_tuplegetter":
        if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
            return True
    return None

def _no_mock_return_type(app, what, name, obj, options, signature, return_annotation):
    """Without PyTorch, a class derived from a mocked ``torch.autograd.Function`` takes its signature from the mock's
    ``__new__(*args, **kwargs) -> Any``: drop the "Return type: Any" that would add to the class's description (with
    PyTorch the signature is the same and has no return type)."""
    if what == "class" and isinstance(obj, type) and any(getattr(base, "__sphinx_mock__", False)
                                                         for base in obj.__mro__[1:]):
        document = getattr(app.env, "current_document", None)      # Sphinx 8.2+; before: env.temp_data
        annotations = (document.autodoc_annotations if document is not None
                       else app.env.temp_data.get("annotations", {}))
        annotations.get(name, {}).pop("return", None)
    return None


def _chapter_links(app, doctree):
    """A chapter's Markdown link to another chapter, ``[Appendix 13](appendix_13_inference.md)``, as myst-parser
    resolves it: Sphinx resolves the path through the ``docs/chapters`` link to ``chapters/`` at the repository's
    root, outside the source directory, and the reference then names no document ("Unknown source document
    '/…/chapters/appendix_13_inference'"). Name the document through the link instead: ``chapters/appendix_13_…``.
    (The link as written is the one JupyterLab follows, so the chapters keep it.)"""
    from sphinx.addnodes import pending_xref

    chapters = (ROOT / "chapters").resolve()
    for node in doctree.findall(pending_xref):
        target = node.get("reftarget", "")
        if node.get("reftype") == "myst" and node.get("refdomain") == "doc" and Path(target).is_absolute():
            try:
                node["reftarget"] = "chapters/" + Path(target).relative_to(chapters).as_posix()
            except ValueError:
                pass


# -- HTML --------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"fa2edu {release}: FlashAttention you can run"
html_theme_options = {"navigation_with_keys": True}
html_css_files = ["fa2edu.css"]     # a content column wide enough for 88-character code lines (docs/_static)


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("doctree-read", _chapter_links)
    if autodoc_mock_imports:
        app.connect("autodoc-process-signature", _no_mock_return_type)
