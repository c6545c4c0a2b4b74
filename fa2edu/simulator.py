"""Choosing numba's CUDA simulator on a machine without a GPU, before numba is imported.

numba reads ``NUMBA_ENABLE_CUDASIM`` once, when ``numba.cuda`` is first imported: ``1`` runs every kernel in its
CUDA simulator (Python threads on the CPU, slow but exact in its indexing), anything else needs a CUDA driver and
a GPU. A learner opening the book on a laptop should not have to know that: :func:`choose` sets the variable to
``1`` when it is unset and this machine has no CUDA driver, and leaves it alone otherwise. ``kernels_gpu`` and the
kernel exercises of :mod:`fa2edu.exercises` call it before they import numba; set ``NUMBA_ENABLE_CUDASIM=0`` (or
``1``) yourself to decide.

This module imports neither numba nor a CUDA library: it only asks the operating system whether the CUDA driver's
library can be found (``libcuda.so.1`` on Linux, ``nvcuda.dll`` on Windows; macOS has none). It does not initialise
the driver (``cuInit``), so a process that forks afterwards is unaffected.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

__all__ = ["choose", "driver_present"]

#: The variable numba reads when ``numba.cuda`` is first imported.
VARIABLE = "NUMBA_ENABLE_CUDASIM"

_NOTICE = ("fa2edu: no CUDA driver on this machine, so kernels_gpu runs in numba's CUDA simulator (slow: keep N "
           "small; set NUMBA_ENABLE_CUDASIM=0 to turn this off)")


def driver_present() -> bool:
    """True when the CUDA driver's library can be loaded here (a GPU may still be absent or busy)."""
    if sys.platform == "darwin":
        return False
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return ctypes.util.find_library("cuda") is not None


def choose(*, quiet: bool = False) -> bool:
    """Turn the simulator on when ``NUMBA_ENABLE_CUDASIM`` is unset and there is no CUDA driver; True if it is on.

    Has an effect only before ``numba.cuda`` is imported (numba reads the variable then; if only ``numba`` was
    imported, its settings are read again); afterwards it reports what numba chose. Prints one line to stderr when it
    turns the simulator on (``quiet=True``: nothing).
    """
    if VARIABLE not in os.environ and "numba.cuda" not in sys.modules and not driver_present():
        os.environ[VARIABLE] = "1"
        if "numba.core.config" in sys.modules:
            # numba itself was imported already and read its settings then: have it read them again.
            sys.modules["numba.core.config"].reload_config()
        if not quiet:
            print(_NOTICE, file=sys.stderr)
    if "numba.cuda" in sys.modules:
        from numba.cuda.core import config
        return bool(config.ENABLE_CUDASIM)
    return os.environ.get(VARIABLE, "0") == "1"
