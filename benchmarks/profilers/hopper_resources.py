"""What ptxas made of each Hopper rung (forward and backward): registers, local memory (spills), shared memory,
and the SASS counts that say whether the intended instructions are there (HGMMA: wgmma; UTMALDG: TMA loads;
LDL/STL: local memory).

    python -m benchmarks.profilers.hopper_resources [--d 128] [--dtype bfloat16]

Runs each rung once on a small problem (which compiles it), then reads the dispatcher's resource report and the
cubin's SASS through ``cuobjdump`` (on the GPU machine's PATH).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def report(name: str, d: int, cfg, kernel) -> None:
    """One line per compiled overload of ``kernel``: registers, local memory (spills), SASS counts."""
    for ov in kernel.overloads.values():
        regs = ov.regs_per_thread
        local = ov.local_mem_per_thread
        sass = ""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "k.cubin"
            cubin = ov.library.get_cubin()
            path.write_bytes(bytes(getattr(cubin, "code", cubin)))
            try:
                sass = subprocess.run(["cuobjdump", "--dump-sass", str(path)], capture_output=True,
                                      text=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired) as error:
                sass = f"cuobjdump failed: {error}"
        counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "UTMALDG", "LDL", "STL",
                                                                       "WARPGROUP", "SYNCS", "BAR")}
        # every instruction of the SASS listing ("/*0a80*/  FFMA R1, …"): how many, and of which kinds
        opcodes = collections.Counter(m.split(".")[0] for m in re.findall(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
        print(f"{name} d={d} B_c={cfg.B_c} threads={cfg.threads}: registers {regs}, local bytes {local}, "
              f"SASS {counts}; {sum(opcodes.values())} instructions, most common "
              f"{dict(opcodes.most_common(14))}", flush=True)


def main(argv=None) -> int:
    import torch

    from kernels_gpu import hopper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", default="64,128,256")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    forward = {name: importlib.import_module(f"kernels_gpu.hopper.flash_forward_{name}") for name in hopper.VERSIONS}
    backward = {name: importlib.import_module(f"kernels_gpu.hopper.flash_backward_{name}")
                for name in hopper.BACKWARD_VERSIONS}
    for d in (int(x) for x in args.d.split(",")):
        q = torch.randn(1, 2, 300, d, device="cuda", dtype=getattr(torch, args.dtype))
        for name, f in hopper.VERSIONS.items():
            f(q, q, q, causal=False)
            torch.cuda.synchronize()
            cfg = forward[name].config_for(d, args.dtype, False, False)
            report(name, d, cfg, forward[name].make_kernel(cfg))
        if d > 128:
            continue                          # the backward rungs take d ≤ 128
        O, L = hopper.flash_forward(q, q, q)
        for name, f in hopper.BACKWARD_VERSIONS.items():
            mod = backward[name]
            for deterministic in (False, True):
                f(q, q, q, O, L, q, deterministic=deterministic)
            torch.cuda.synchronize()
            cfg = mod.config_for(d, args.dtype, False, False)
            report(name, d, cfg, mod.make_kernel(cfg))
            report(f"{name} (dK, dV only)", d, cfg, mod.make_kernel(cfg, atomic_dq=False))
            report(f"{name} (dQ pass)", d, cfg, mod.make_dq_kernel(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
