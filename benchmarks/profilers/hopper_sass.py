"""The SASS of a Hopper rung without a GPU: compile it for sm_90a here, and read what ptxas made of its main loop.

    python -m benchmarks.profilers.hopper_sass h4 h5 b1 [--d 128] [--dtype bfloat16] [--causal] [--keep DIR]

For each rung (a forward rung, or a backward kernel: ``b1``, ``b1-kv``, ``b1-dq``): numba compiles the kernel to
PTX for ``sm_90a`` (no driver needed: only NVVM), ``ptxas -v`` reports its registers and spills, ``cuobjdump
--dump-sass`` disassembles the cubin, and the main loop — the backward branch whose body holds the most
``HGMMA`` — is printed as a list of its barriers, waits, wgmmas and
branches, with the instructions between two of them counted by opcode. That is enough to see, for example, that
h4 computes 64 column masks per tile before its softmax whether or not the tile needs them (the segment after
S = QKᵀ full of ``ISETP`` and ``LOP3``), and that h5 does not.

Needs, besides numba-cuda: ``ptxas`` (CUDA toolkit, on ``PATH``), libNVVM (found by numba-cuda as for any
compilation), and ``cuobjdump`` with ``nvdisasm`` (the GPU machine has them; elsewhere
``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`` puts them in the environment's ``nvidia/cu13/bin``,
which this script adds to ``PATH``). Static counts, not a profile: a segment inside a branch runs only when the
branch is taken, and what the instructions cost is for Nsight Compute on the GPU
(:mod:`benchmarks.profilers.hopper_ncu`).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: the instructions that delimit the segments of a loop listing
MARKERS = ("HGMMA", "QGMMA", "BRA", "SYNCS", "BAR", "WARPGROUP")
#: the warpgroup MMAs in SASS: HGMMA (16-bit operands), QGMMA (8-bit: e4m3, e5m2)
GMMA = ("HGMMA", "QGMMA")


def _offline_compiler() -> None:
    """Let numba-cuda compile for sm_90a on a machine with no GPU and no NVRTC: the device's compute capability is
    asked only for the target (given here), and NVRTC's path only to fill a table that PTX compilation never reads.
    """
    import numba.cuda.cuda_paths as paths
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    class Hopper:
        compute_capability = (9, 0)

    cuda.config.FORCE_CUDA_CC = (9, 0, "a")
    dispatcher.get_current_device = Hopper
    try:
        paths._get_nvrtc_path()
    except Exception:  # noqa: BLE001 - any failure to find NVRTC: PTX needs none
        paths._get_nvrtc_path = lambda: None


def _tool_path() -> None:
    """Add the pip wheels' CUDA binaries (``nvidia/cu13/bin`` in site-packages) to PATH, where they exist."""
    import site
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for sub in ("cu13", "cu12"):
            folder = Path(base) / "nvidia" / sub / "bin"
            if folder.is_dir():
                os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"


#: the backward kernels of a backward rung bN, by suffix: the key-block kernel (dQ by atomics), ``-kv`` its
#: dK/dV-only kernel, ``-dq`` the deterministic mode's dQ pass
BACKWARD_SUFFIXES = ("", "-kv", "-dq")


def kernel_ptx(rung: str, d: int, dtype: str, causal: bool) -> tuple[str, int | None]:
    """The PTX of one kernel for one configuration, compiled for sm_90a (no GPU needed): a forward rung ("h1" …)
    a backward kernel ("b1", "b1-kv", "b1-dq": :data:`BACKWARD_SUFFIXES`) or the FP8 rung ("fp8"); and the
    kernel's register cap (numba hands it to the assembler, so :func:`assemble` must too), or None."""
    from numba import cuda, types

    words = types.Array(types.uint32, 4, "A")
    f32 = types.Array(types.float32, 4, "A")
    scalars = (types.int32, types.int32, types.int32, types.float32)
    if rung.startswith("b"):
        name, _, kind = rung.partition("-")
        module = importlib.import_module(f"kernels_gpu.hopper.flash_backward_{name}")
        cfg = module.config_for(d, dtype, causal, False)
        if not kind:
            kernel, signature = module.make_kernel(cfg), (words, words, words, words, f32, f32, words, words)
        elif kind == "kv":
            kernel = module.make_kernel(cfg, atomic_dq=False)
            signature = (words, words, words, words, f32, words, words)
        else:
            kernel, signature = module.make_dq_kernel(cfg), (words, words, words, words, f32, words)
        signature += scalars + (types.float32,)
        if kind != "dq":                                # b3 on: the key-block kernels' tensor maps (Q, dO)
            signature += (types.Array(types.uint64, 1, "C"),) * getattr(module, "TENSOR_MAPS", 0)
    elif rung == "fp8":                                 # e4m3 inputs, per-(batch, head) descales, three maps
        module = importlib.import_module("kernels_gpu.hopper.flash_forward_fp8")
        kernel = module.make_kernel(module.config_for(d, causal, False))
        maps, descales = types.Array(types.uint64, 1, "C"), types.Array(types.float32, 2, "A")
        signature = ((words, words, words, words, types.Array(types.float32, 3, "A")) + scalars
                     + (descales, descales, descales, maps, maps, maps))
    else:
        module = importlib.import_module(f"kernels_gpu.hopper.flash_forward_{rung}")
        cfg = module.config_for(d, dtype, causal, False)
        kernel = module.make_kernel(cfg)
        maps = types.Array(types.uint64, 1, "C")
        signature = (words, words, words, words, types.Array(types.float32, 3, "A")) + scalars
        if rung != "h1":                                # the TMA rungs: three tensor maps and the trace array
            signature += (maps, maps, maps, types.Array(types.uint64, 4, "C"))
    options = kernel.targetoptions
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0, "a"), fastmath=bool(options.get("fastmath")),
                              launch_bounds=options.get("launch_bounds"))
    return ptx, options.get("max_registers")


def assemble(ptx: str, folder: Path, name: str, max_registers: int | None = None) -> tuple[str, str]:
    """(ptxas's resource lines, the SASS listing) of ``ptx``, assembled under ``max_registers`` if given."""
    source, cubin = folder / f"{name}.ptx", folder / f"{name}.cubin"
    source.write_text(ptx)
    cap = [f"-maxrregcount={max_registers}"] if max_registers else []
    report = subprocess.run(["ptxas", "-v", "-arch=sm_90a", *cap, "-o", str(cubin), str(source)],
                            capture_output=True, text=True, check=True).stderr
    resources = "\n".join(line.split(":", 1)[-1].strip() for line in report.splitlines()
                          if "Used" in line or "spill" in line)
    sass = subprocess.run(["cuobjdump", "--dump-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return resources, sass


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of a ``cuobjdump --dump-sass`` listing."""
    found = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2)))
    return found


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate guard and modifiers (``@!P0 IMAD.MOV.U32 …`` → IMAD)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def highest_register_after_setmaxnreg(listing: list[tuple[int, str]]) -> int | None:
    """The highest general register (``R<n>``) named after the first ``setmaxnreg.inc`` (SASS ``USETMAXREG.
    TRY_ALLOC``): what the warpgroups that took registers use, beyond the launch's count that ``ptxas -v`` reports.
    None for a kernel without it."""
    start = next((i for i, (_, text) in enumerate(listing) if "USETMAXREG.TRY_ALLOC" in text), None)
    if start is None:
        return None
    found = [int(n) for _, text in listing[start:] for n in re.findall(r"\bR(\d+)\b", text)]
    return max(found, default=None)


def main_loop(listing: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The loop (a backward branch and what lies between its target and it) that holds the most wgmmas, the
    shortest of those: the consumers' loop over K/V tiles, not a retry loop around an epilogue's product."""
    index = {address: i for i, (address, _) in enumerate(listing)}
    best, best_key = [], None
    for i, (address, text) in enumerate(listing):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            body = listing[index[int(target.group(1), 16)]:i + 1]
            key = (sum(opcode(t) in GMMA for _, t in body), -len(body))
            if key[0] and (best_key is None or key > best_key):
                best, best_key = body, key
    return best


def segments(body: list[tuple[int, str]]) -> list[str]:
    """The loop as lines: each marker instruction, and between two of them a count by opcode."""
    lines, run = [], []

    def flush():
        if run:
            common = collections.Counter(run).most_common(6)
            lines.append(f"    [{len(run):4d}] " + " ".join(f"{op} {n}" for op, n in common))
            run.clear()

    for address, text in body:
        if opcode(text) in MARKERS:
            flush()
            lines.append(f"  {address:5x}  {text[:88]}")
        else:
            run.append(opcode(text))
    flush()
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rungs", nargs="+", help="forward rungs (h1, h2, …) or backward kernels (b1, b1-kv, b1-dq)")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="a folder to keep the PTX, cubin and SASS in")
    args = parser.parse_args(argv)
    _tool_path()
    missing = [tool for tool in ("ptxas", "cuobjdump", "nvdisasm") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"needs {', '.join(missing)} on PATH: ptxas from the CUDA toolkit; cuobjdump and nvdisasm "
                         f"from the toolkit or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        raise SystemExit("NUMBA_ENABLE_CUDASIM is set: the simulator compiles nothing; unset it for this script")
    _offline_compiler()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for rung in args.rungs:
            name = f"{rung}_d{args.d}_{args.dtype}{'_causal' if args.causal else ''}"
            ptx, cap = kernel_ptx(rung, args.d, args.dtype, args.causal)
            resources, sass = assemble(ptx, folder, name, max_registers=cap)
            (folder / f"{name}.sass").write_text(sass)
            listing = instructions(sass)
            body = main_loop(listing)
            print(f"== {rung}, d = {args.d}, {args.dtype}{', causal' if args.causal else ''}: "
                  f"{len(listing)} instructions; {resources.replace(chr(10), '; ')}")
            highest = highest_register_after_setmaxnreg(listing)
            if highest is not None:
                print(f"  after setmaxnreg: registers up to R{highest}")
            if body:
                print(f"  main loop {body[0][0]:x}-{body[-1][0]:x}: {len(body)} instructions")
                print("\n".join(segments(body)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
