"""The docs build as the README's command runs it (``bash scripts/build_docs.sh``), without executing the chapters.

Sphinx builds docs/ into a temporary folder with ``FA2EDU_DOCS_EXECUTE=off`` (the API reference and the chapters'
text; the executed build takes far longer), then docs/check_links.py checks the built site's internal links. The
build must exit 0 with no docutils ERROR (an ``|x|`` in a docstring reads as an undefined substitution, say) and no
broken link. It builds with PyTorch hidden from the build, as on the book's route, which installs none (conf.py then
mocks torch for autodoc, and the torch modules' pages must still describe every function); a build with PyTorch
installed differs only in that nothing is mocked, which a cheap test below checks instead of a second build (each
build costs half a minute of the suite's time). ``FA2EDU_DOCS_BOTH=1`` builds both ways.

Skipped where the ``docs`` extra is not installed. Builds take turns on a lock: autosummary writes the API pages
into docs/generated, inside the source tree, whatever the output folder.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("sphinx", "myst_nb", "furo", "sphinx-mathjax-offline"):
    pytest.importorskip(_module)

ROOT = Path(__file__).resolve().parent.parent

# sphinx-build in a process where `import torch` fails, as on the book's route: conf.py falls back to autodoc's mock
# (which sits in front of this finder on sys.meta_path, as it must to stand in for a missing package).
_NO_TORCH = """
import importlib.util, sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name == "torch" or name.startswith("torch.") else _find_spec(name, package))
from sphinx.cmd.build import main
sys.exit(main(sys.argv[1:]))
"""


def _build(out: Path, hide_torch: bool) -> str:
    """sphinx-build -b html docs OUT/html, then the link check: their output; fails the test on a non-zero exit."""
    env = dict(os.environ, FA2EDU_DOCS_EXECUTE="off")
    env.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    sphinx = [sys.executable, "-c", _NO_TORCH] if hide_torch else [sys.executable, "-m", "sphinx"]
    html = out / "html"
    lock = ROOT / "docs" / "_build" / "test_docs_build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        build = subprocess.run([*sphinx, "-b", "html", "-d", str(out / "doctrees"), "docs", str(html)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    output = build.stdout + build.stderr
    assert build.returncode == 0, f"sphinx-build exited {build.returncode}:\n{output[-6000:]}"
    errors = [line for line in output.splitlines() if "ERROR" in line or "Undefined substitution" in line]
    assert not errors, "docutils errors in the docs build:\n" + "\n".join(errors[:40])
    links = subprocess.run([sys.executable, "docs/check_links.py", str(html)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert links.returncode == 0, f"broken internal links in the built site:\n{links.stdout[-6000:]}"
    return output


def _api_page(html: Path, module: str) -> str:
    page = html / "generated" / f"{module}.html"
    assert page.exists(), f"no API page for {module}"
    return page.read_text(encoding="utf-8")


BUILDS = ["hidden", "installed"] if os.environ.get("FA2EDU_DOCS_BOTH") == "1" else ["hidden"]


def test_conf_mocks_torch_only_where_it_is_missing():
    """With PyTorch importable, conf.py mocks nothing: the API pages come from the real modules."""
    pytest.importorskip("torch")
    probe = subprocess.run([sys.executable, "-c", "import runpy; c = runpy.run_path('docs/conf.py'); "
                            "print(c['HAVE_TORCH'], c['autodoc_mock_imports'])"],
                           cwd=ROOT, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split("\n")[-2] == "True []"


@pytest.mark.parametrize("torch", BUILDS)
def test_docs_build_without_executing_the_chapters(tmp_path, torch):
    if torch == "installed":
        pytest.importorskip("torch")
    _build(tmp_path, hide_torch=torch == "hidden")
    html = tmp_path / "html"
    # The torch modules are documented with or without PyTorch: every public function with its description.
    for module, names in {"fa2edu.torch": ["flash_attention", "Flash2Attention"],
                          "fa2edu.distributed": ["ring_attention", "shard", "unshard", "trace"]}.items():
        page = _api_page(html, module)
        for name in names:
            assert f'id="{module}.{name}"' in page, f"{module}.{name} is not described on its API page"
        # no "Return type: Any" from the mock's signature on the classes derived from torch.autograd.Function
        assert not re.search(r"Return type:\s*Any\b", re.sub(r"<[^>]+>", "", page))
    # The chapters before the lab notebooks (appendices), each under its own caption of the table of contents.
    index = (html / "index.html").read_text(encoding="utf-8")
    index = index[index.find("<article"):index.find("</article>")]      # the page's own tables, not the sidebar's
    book, notebooks = index.find(">The book<"), index.find(">Lab notebooks (appendices)<")
    assert 0 <= book < notebooks
    chapters = sorted(path.stem for path in (ROOT / "chapters").glob("[0-9]*.md"))
    appendices = sorted(path.stem for path in (ROOT / "chapters").glob("appendix_*.md"))
    for stem in chapters:
        assert book < index.find(f'href="chapters/{stem}.html"') < notebooks, f"{stem} is not under 'The book'"
    for stem in appendices:
        assert index.find(f'href="chapters/{stem}.html"') > notebooks, f"{stem} is not under 'Lab notebooks'"
