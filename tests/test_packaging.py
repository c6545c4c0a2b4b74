"""The reading path works as the README says: ``pip install -e ".[notebooks]"``, then ``jupyter lab chapters/``.

The ``notebooks`` extra declares JupyterLab, jupytext and a Python kernel; in an environment where it is installed,
the ``jupyter-lab`` command exists and starts, jupytext's JupyterLab extension provides the "Jupytext Notebook"
viewer that ``scripts/lab.sh`` makes the default for ``.md`` files, and jupytext's contents manager (what the
JupyterLab server uses to read and save files) opens every chapter as a notebook and saves it back unchanged.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
CHAPTER_FILES = sorted(CHAPTERS.glob("[0-9][0-9]_*.md"))
LABCONFIG = ROOT / "scripts" / "jupyter" / "labconfig" / "default_setting_overrides.json"
VIEWER = "Jupytext Notebook"      # the widget factory jupytext's JupyterLab extension registers

needs_notebooks = pytest.mark.skipif(importlib.util.find_spec("jupytext") is None,
                                     reason='the notebooks extra is not installed: pip install -e ".[notebooks]"')


def notebooks_extra() -> list[Requirement]:
    """The ``notebooks`` extra as pyproject.toml declares it."""
    tomllib = pytest.importorskip("tomllib")      # Python ≥ 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [Requirement(text) for text in project["optional-dependencies"]["notebooks"]]


def test_notebooks_extra_declares_what_the_readme_promises():
    extra = {req.name.lower(): req for req in notebooks_extra()}
    assert {"jupyterlab", "jupytext", "ipykernel"} <= set(extra), sorted(extra)
    # JupyterLab 4: the version whose default-viewer setting scripts/jupyter/labconfig configures.
    lab = extra["jupyterlab"].specifier
    assert "4.2" in lab and "4.99" in lab and "3.6" not in lab and "5.0" not in lab, str(lab)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in ('pip install -e ".[notebooks]"', "jupyter lab chapters/", "bash scripts/lab.sh"):
        assert command in readme, f"the README no longer says {command!r}"


def test_installed_metadata_matches_pyproject():
    """The installed fa2edu declares the same notebooks extra as the checkout (else: reinstall, as test.sh does)."""
    try:
        requires = importlib.metadata.requires("fa2edu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fa2edu is not installed (running from the source tree)")
    installed = {str(Requirement(r.split(";")[0])) for r in requires if re.search(r"extra == .notebooks.", r)}
    declared = {str(Requirement(str(req))) for req in notebooks_extra()}
    assert installed == declared, 'the installed fa2edu is out of date: pip install -e ".[notebooks]"'


@needs_notebooks
def test_every_notebooks_requirement_is_installed_at_a_declared_version():
    for req in notebooks_extra():
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f'{req.name} is missing: pip install -e ".[notebooks]"')
        assert req.specifier.contains(version, prereleases=True), f"{req.name} {version} is not {req.specifier}"


@needs_notebooks
def test_jupyter_lab_command_exists_and_starts():
    names = {entry.name for entry in importlib.metadata.entry_points(group="console_scripts")}
    assert "jupyter-lab" in names, "no jupyter-lab entry point: JupyterLab is not installed"
    path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    command = shutil.which("jupyter-lab", path=path)
    assert command, "the jupyter-lab command is not in this environment's scripts folder nor on PATH"
    # scripts/lab.sh runs `jupyter lab` with the repository's labconfig; --version starts it and stops.
    done = subprocess.run(["bash", str(ROOT / "scripts" / "lab.sh"), "--version"], capture_output=True, text=True,
                          env={**os.environ, "PATH": str(Path(command).parent) + os.pathsep + path}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == importlib.metadata.version("jupyterlab")


@needs_notebooks
def test_labconfig_makes_the_jupytext_viewer_the_default_for_markdown(monkeypatch):
    viewers = json.loads(LABCONFIG.read_text())["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers["markdown"] == VIEWER                    # JupyterLab's file type of every .md file
    # jupytext's JupyterLab extension (installed with jupytext) registers a viewer of exactly that name.
    pytest.importorskip("jupyterlab")
    from jupyter_core.paths import jupyter_path
    extension = [Path(p) / "jupyterlab-jupytext" for p in jupyter_path("labextensions")]
    static = [f for folder in extension if folder.is_dir() for f in (folder / "static").glob("*.js")]
    assert static, f"jupytext's JupyterLab extension is not installed in {jupyter_path('labextensions')}"
    assert any(f'"{VIEWER}"' in f.read_text(encoding="utf-8", errors="replace") for f in static)
    # The JupyterLab server finds the setting on the JUPYTER_CONFIG_PATH that scripts/lab.sh sets.
    from jupyter_server.services.config.manager import ConfigManager
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(LABCONFIG.parent.parent))
    overrides = ConfigManager(config_dir_name="labconfig").get("default_setting_overrides")
    assert overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]["markdown"] == VIEWER
    assert 'JUPYTER_CONFIG_PATH="$root/scripts/jupyter' in (ROOT / "scripts" / "lab.sh").read_text()


@needs_notebooks
def test_jupytext_contents_manager_opens_every_chapter_as_a_notebook_and_saves_it_unchanged(tmp_path):
    """What JupyterLab's server does on opening a chapter and on saving it, on a copy of chapters/."""
    pytest.importorskip("jupyter_server")
    import jupytext

    assert CHAPTER_FILES, f"no chapters in {CHAPTERS}"
    for path in CHAPTER_FILES + [CHAPTERS / "jupytext.toml"]:
        shutil.copy(path, tmp_path / path.name)
    manager = jupytext.TextFileContentsManager(root_dir=str(tmp_path))
    for path in CHAPTER_FILES:
        model = manager.get(path.name)
        assert model["type"] == "notebook", f"{path.name} opens as {model['type']!r}, not as a notebook"
        notebook = model["content"]
        assert notebook.metadata["kernelspec"]["name"] == "python3"
        assert any(cell.cell_type == "code" for cell in notebook.cells), f"{path.name} has no code cell"
        manager.save(model, path.name)
        assert (tmp_path / path.name).read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), \
            f"saving {path.name} from JupyterLab would change it (see chapters/jupytext.toml)"
