"""Compile the inference kernels to PTX and read ptxas's resource report — no GPU needed (numba's NVVM and the CUDA
toolkit's ptxas only)::

    python -m kernels_gpu.inference.decode_inspect    # the decode benchmark's shapes, and varlen at d = 64, 128

Prints, per kernel and configuration: registers, spill bytes, shared memory, and counts of the instructions the
design relies on (16-byte global loads, warp shuffles, local-memory loads: 0 means every per-thread array stayed in
registers); with ``cuobjdump`` on the PATH also the machine code's instruction count and the position of the first
``cp.async`` copy. The first thing to read before a GPU run (GPU.md, "Method").
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from numba import cuda, types


def _compile_without_gpu() -> None:
    """numba compiles device functions for the current device's compute capability; with no GPU, say sm_90."""
    from numba.cuda import dispatcher

    class _Hopper:
        compute_capability = (9, 0)
    try:
        cuda.get_current_device()
    except Exception:  # noqa: BLE001 (no driver, no GPU: compile for sm_90 anyway)
        dispatcher.get_current_device = lambda: _Hopper()


def _ptxas(ptx: str, max_registers: int | None = None) -> dict:
    exe = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    cap = [] if max_registers is None else [f"-maxrregcount={max_registers}"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cubin = Path(tmp) / "k.cubin"
        out = subprocess.run([exe, "-arch=sm_90", "-v", *cap, str(src), "-o", str(cubin)],
                             capture_output=True, text=True, check=True).stderr
        sass = _sass_counts(cubin)
    nums = {key: int(m.group(1)) if (m := re.search(pat, out)) else None for key, pat in
            (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
             ("spill_loads", r"(\d+) bytes spill loads"), ("static_smem", r"(\d+) bytes smem"))}
    nums.update(ldg128=len(re.findall(r"ld\.global\.nc\.v4", ptx)), shfl=ptx.count("shfl.sync"),
                local_ld=len(re.findall(r"ld\.local", ptx)), lds128=len(re.findall(r"ld\.shared\.v4", ptx)),
                **sass)
    return nums


def _sass_counts(cubin: Path) -> dict:
    """From the machine code (``cuobjdump -sass``, where the toolkit or the ``nvidia-cuda-cuobjdump`` wheel puts it
    on the PATH; else nothing): ``sass`` = the kernel's static instruction count, ``sass_first_copy`` = how many
    instructions precede its first global → shared copy (``LDGSTS``), None if it has none."""
    exe = shutil.which("cuobjdump")
    if exe is None:
        return {}
    text = subprocess.run([exe, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    first = next((i for i, op in enumerate(ops) if op.startswith("LDGSTS")), None)
    return dict(sass=len(ops), sass_first_copy=first)


def split_report(storage: str = "float16", d: int = 128, R: int = 4, page: int = 256, causal: bool = True,
                 index: str = "int32") -> dict:
    """The split program for (storage, d = d_v, R = G·N_new rows, page size; 0: contiguous)."""
    from kernels_gpu.inference import decode
    _compile_without_gpu()
    tiling = decode.decode_tiling(storage, d, d, R, 4, warps=4)
    kernel = decode.split_kernel(storage, d, d, tiling, page, causal, False)
    W = types.float32 if storage == "float32" else types.uint32
    I = getattr(types, index)
    sig = ((W[::1],) * 3 + (I[::1],) * 2 + (W[::1],) + (types.float32[::1],) * 3 + (types.int64,) * 16 +
           (types.float32,))
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    return dict(kernel="decode_split", storage=storage, d=d, R=R, page=page, tiling=tuple(tiling), **_ptxas(ptx))


def split_tc_report(storage: str = "float16", d: int = 128, page: int = 256, causal: bool = True,
                    index: str = "int32", warps: int = 4, copy: str | None = None) -> dict:
    """The tensor-core split program (:mod:`kernels_gpu.inference.decode_tc`) for (storage, d = d_v, page size; 0:
    contiguous; ``copy``: how whole tiles travel, default :data:`decode_tc.COPY`): ``ldsm`` and ``mma`` counts
    beside the resources (``cp_async``: 16-byte copies in the PTX, ``tensor_copies``: bulk tensor copies)."""
    from kernels_gpu.inference import decode_tc
    _compile_without_gpu()
    copy = decode_tc.COPY if copy is None else copy
    tile = decode_tc.tile_for(page)
    kernel = decode_tc.split_kernel_tc(storage, d, d, warps, page, causal, False, decode_tc.STAGES, copy,
                                       decode_tc.CHAINS, tile)
    I = getattr(types, index)
    sig = ((types.uint32[::1],) * 3 + (I[::1],) * 2 + (types.uint32[::1],) + (types.float32[::1],) * 3 +
           (types.int64,) * 16 + (types.float32,) + (types.uint64[::1],) * 2)
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    cap = decode_tc.register_cap(d, d, copy)                    # as split_kernel_tc asks of the compiler
    return dict(kernel="decode_split_tc", storage=storage, d=d, page=page, warps=warps, copy=copy, tile=tile,
                shared_bytes=decode_tc.shared_bytes(d, d, warps, decode_tc.STAGES, copy, tile),
                mma=ptx.count("mma.sync"),
                ldmatrix=ptx.count("ldmatrix"), cp_async=ptx.count("cp.async.cg"),
                tensor_copies=ptx.count("cp.async.bulk.tensor"), **_ptxas(ptx, cap))


def merge_report(storage: str = "float16", d_v: int = 128) -> dict:
    from kernels_gpu.inference import decode
    _compile_without_gpu()
    kernel = decode.merge_kernel(storage, d_v, False)
    W = types.float32 if storage == "float32" else types.uint32
    sig = (types.float32[::1], types.float32[::1], W[::1], types.float32[::1], types.int64, types.int64,
           types.int64)
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    return dict(kernel="decode_merge", storage=storage, d=d_v, **_ptxas(ptx))


def varlen_report(storage: str = "float16", d: int = 128, causal: bool = False) -> dict:
    from kernels_gpu.inference import varlen
    _compile_without_gpu()
    tiling = varlen.VarlenTiling(16, 8, 4, 4) if d <= 128 else varlen.VarlenTiling(8, 8, 4, 4)
    kernel = varlen.varlen_kernel(storage, d, d, tiling, causal, (d, d, d), False)
    E = types.float32 if storage == "float32" else types.uint16
    sig = ((E[::1],) * 4 + (types.float32[::1],) + (types.int32[::1],) * 4 + (types.int64,) * 6 +
           (types.float32,))
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    return dict(kernel="varlen_forward", storage=storage, d=d, causal=causal, tiling=tuple(tiling),
                shared_bytes=4 * varlen.shared_floats(tiling, d, d), **_ptxas(ptx))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", nargs="+", default=["float16", "bfloat16", "float32"])
    parser.add_argument("--d", type=int, nargs="+", default=[128])
    parser.add_argument("--R", type=int, nargs="+", default=[1, 4, 8], help="query rows G·N_new per KV head")
    args = parser.parse_args(argv)
    for storage in args.storage:
        for d in args.d:
            for R in args.R:
                print(split_report(storage, d, R), flush=True)
            print(split_report(storage, d, 4, page=0), flush=True)
            if storage != "float32":
                for page in (256, 0):
                    print(split_tc_report(storage, d, page), flush=True)
            print(merge_report(storage, d), flush=True)
            for causal in (False, True):
                print(varlen_report(storage, d, causal), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
