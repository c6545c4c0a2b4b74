"""What the chapters ask of the notebook they run in: cells that need an optional package.

The book's route (``pip install -e ".[notebooks]"``) installs no PyTorch: a learner without a GPU should not
download several gigabytes of CUDA libraries to read chapter 5. The cells that need PyTorch start with a line of
this extension's cell magic, and a chapter loads it once::

    %load_ext fa2edu.notebook

    %%needs torch
    import torch
    ...

With the package installed, ``%%needs torch`` runs the cell as if the line were not there (an error in it still
fails the cell); without it, the cell prints one line saying what was skipped and how to install the package, and
runs nothing. Later cells that use what a skipped cell defined carry the same line.
"""

from __future__ import annotations

import importlib.util
import textwrap

__all__ = ["INSTALL", "missing", "needs", "load_ipython_extension"]

#: How to install each optional package the chapters use (PyTorch: its CPU-only build, no CUDA libraries).
INSTALL = {
    "torch": "pip install torch --index-url https://download.pytorch.org/whl/cpu "
             "(the CPU-only build; on a machine with a GPU: pip install torch)",
}


def missing(packages: list[str]) -> list[str]:
    """The packages of ``packages`` that cannot be imported here."""
    return [name for name in packages if importlib.util.find_spec(name) is None]


def needs(line: str, cell: str):
    """Cell magic ``%%needs pkg [pkg …]``: run the cell if every package imports, else print why it is skipped."""
    from IPython import get_ipython

    packages = line.split()
    if not packages:
        raise ValueError("%%needs takes the packages the cell needs, e.g. %%needs torch")
    absent = missing(packages)
    if absent:
        how = "; ".join(INSTALL.get(name, f"pip install {name}") for name in absent)
        print("\n".join(textwrap.wrap(f"Skipped: this cell needs {', '.join(absent)}, which is not installed. "
                                      f"To run it: {how}.", 88)))
        return None
    result = get_ipython().run_cell(cell, store_history=False)
    result.raise_error()       # an error in the cell fails it, as it would without the magic
    return None


def load_ipython_extension(ipython) -> None:
    """``%load_ext fa2edu.notebook``: register ``%%needs``."""
    ipython.register_magic_function(needs, magic_kind="cell", magic_name="needs")
