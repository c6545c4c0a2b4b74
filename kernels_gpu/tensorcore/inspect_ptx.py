"""Compile a tensor-core rung to PTX and ask ptxas for its resource report — no GPU needed (numba's NVVM and the
CUDA toolkit's ptxas only). ``python -m kernels_gpu.tensorcore.inspect_ptx v1 --d 64 128`` prints registers,
spills and shared memory per configuration: the first thing to read before a GPU run (GPU.md, "Method")."""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

from numba import cuda, types

SIGNATURE = (types.uint32[:, :, :, ::1], types.uint32[:, :, :, ::1], types.uint32[:, :, :, ::1],
             types.uint32[:, :, :, ::1], types.float32[:, :, ::1], types.int32, types.int32, types.int32,
             types.float32)

#: the backward rungs' kernels (``bwd_v1`` …): Q, K, V, dO words, the row statistics, dQ's float32 accumulator, dK,
#: dV words, N_q, N_k, G, τ, τ·log₂e
BACKWARD_SIGNATURE = ((types.uint32[:, :, :, ::1],) * 4 + (types.float32[:, :, :, ::1],) * 2 +
                      (types.uint32[:, :, :, ::1],) * 2 + (types.int32,) * 3 + (types.float32,) * 2)


class _Hopper:
    """Stands in for the current device when there is none: numba compiles device functions for the current
    device's compute capability, and this machine may have no GPU."""

    compute_capability = (9, 0)


def _compile_without_gpu() -> None:
    from numba.cuda import dispatcher
    try:
        cuda.get_current_device()
    except Exception:  # noqa: BLE001 (no driver, no GPU: compile for sm_90 anyway)
        dispatcher.get_current_device = lambda: _Hopper()


def report(version: str, d: int, dtype: str = "float16", causal: bool = False, **options) -> dict:
    """Registers, spill bytes, stack frame of ``version``'s kernel at head dimension ``d`` (ptxas -v, sm_90).
    ``version``: a forward rung ("v6") or a backward rung ("bwd_v1"; its register cap, if any, is passed on; a
    rung with a separate dQ kernel names it "bwd_v3_dq"). A module's ``PTX_SIGNATURE`` (``DQ_PTX_SIGNATURE``)
    overrides the default argument types."""
    _compile_without_gpu()
    backward = version.startswith("bwd_")
    dq = backward and version.endswith("_dq")
    name = f"flash2_backward_{version[4:].removesuffix('_dq')}" if backward else f"flash2_forward_{version}"
    module = importlib.import_module(f"kernels_gpu.tensorcore.{name}")
    cfg = module.config_for(d, dtype, causal, False, **options)
    kernel = (module.make_dq_kernel if dq else module.make_kernel)(cfg)
    signature = getattr(module, "DQ_PTX_SIGNATURE" if dq else "PTX_SIGNATURE",
                        BACKWARD_SIGNATURE if backward else SIGNATURE)
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    cap = getattr(cfg, "max_registers_dq" if dq else "max_registers", None)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")] +
                             ([f"--maxrregcount={cap}"] if cap else []),
                             capture_output=True, text=True, check=True).stderr
    nums = {key: int(m.group(1)) if (m := re.search(pat, out)) else None for key, pat in
            (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
             ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame"))}
    nums.update(version=version, d=d, dtype=dtype, causal=causal, B_r=cfg.B_r, B_c=cfg.B_c, max_registers=cap,
                shared_bytes=4 * (module.dq_shared_words if dq else module.shared_words)(cfg),
                mma=ptx.count("mma.sync"),
                ldmatrix=ptx.count("ldmatrix"), local_ld=len(re.findall(r"ld\.local", ptx)))
    return nums


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    for v in args.versions:
        for d in args.d:
            print(report(v, d, args.dtype, args.causal))


if __name__ == "__main__":
    main()
