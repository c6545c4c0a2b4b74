"""Device profiles for roofline estimates: what M is on a real GPU, and how long a count of bytes and FLOPs takes.

FA1 Theorem 2 measures the SRAM size M in **elements**. A GPU datasheet gives bytes of shared memory per streaming
multiprocessor (SM), so :func:`M_for` divides by the element size: an A100's 164 KiB of configurable shared memory
per SM holds 83 968 fp16 elements. FA1 Section 2.1 quotes the A100's 192 KB of on-chip memory per SM, which is the
combined L1 cache / shared memory; at most 164 KiB of it can be shared memory for one kernel.

The figures below are vendor datasheet and architecture-whitepaper numbers for the SXM (or PCIe for the T4) boards,
**dense** rates (no structured sparsity). They are peaks: measured kernels reach a fraction of them (FA2 reaches
50-73% of the tensor-core peak on an A100, FA2 Section 4). The T4 has GDDR6, not HBM; it is listed because it is
the GPU most readers can rent for free, and ``hbm_bandwidth`` then means its device-memory bandwidth.

A roofline estimate (:func:`roofline_time`) takes the larger of ``flops / peak rate`` and ``bytes / bandwidth``:
an algorithm whose HBM time dominates is *memory-bound* (standard attention's softmax), one whose arithmetic time
dominates is *compute-bound* (FlashAttention at realistic sizes).

Between GPUs, :data:`INTERCONNECTS` lists the links that carry a ring's K/V blocks (NVLink, PCIe, InfiniBand),
with their bandwidth **per direction**: a ring step sends one block to the next rank while it receives one from
the previous rank, so each direction of a link carries one block, and the datasheets' "total" figures count both
directions. :func:`interconnect` looks one up; :func:`fa2edu.simulate_context_parallel` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple

import numpy as np

__all__ = ["DeviceProfile", "DEVICES", "device", "itemsize", "elements", "M_for", "peak_flops",
           "RooflineEstimate", "roofline_time", "Interconnect", "INTERCONNECTS", "interconnect"]

KiB = 1024
MiB = 1024 * KiB
TERA = 1e12
GB_PER_S = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU's public spec figures (dense peaks; bytes, bytes/s and FLOP/s in SI units).

    ``sram_per_sm`` is the largest shared-memory carve-out a kernel can use per SM, in bytes; ``l1_sram_per_sm``
    the combined L1 / shared memory per SM. ``fp16_tensor`` is the fp16 (and bf16) tensor-core matmul rate with fp32
    accumulation; ``fp32`` and ``fp16`` the CUDA-core (non-tensor) rates, the ones fa2edu's numba kernels can use.
    """

    name: str
    sms: int
    sram_per_sm: int
    l1_sram_per_sm: int
    l2: int
    hbm: int
    hbm_bandwidth: float
    fp32: float
    fp16: float
    fp16_tensor: float
    tf32_tensor: float
    source: str

    @property
    def sram_total(self) -> int:
        """Shared memory over all SMs, in bytes."""
        return self.sms * self.sram_per_sm


DEVICES: dict[str, DeviceProfile] = {
    "A100-40GB": DeviceProfile(
        name="NVIDIA A100 SXM4 40GB", sms=108, sram_per_sm=164 * KiB, l1_sram_per_sm=192 * KiB, l2=40 * MiB,
        hbm=40 * 10**9, hbm_bandwidth=1555 * GB_PER_S, fp32=19.5 * TERA, fp16=78 * TERA,
        fp16_tensor=312 * TERA, tf32_tensor=156 * TERA,
        source="NVIDIA A100 datasheet and Ampere GA100 architecture whitepaper"),
    "A100-80GB": DeviceProfile(
        name="NVIDIA A100 SXM4 80GB", sms=108, sram_per_sm=164 * KiB, l1_sram_per_sm=192 * KiB, l2=40 * MiB,
        hbm=80 * 10**9, hbm_bandwidth=2039 * GB_PER_S, fp32=19.5 * TERA, fp16=78 * TERA,
        fp16_tensor=312 * TERA, tf32_tensor=156 * TERA,
        source="NVIDIA A100 datasheet and Ampere GA100 architecture whitepaper"),
    "H100-SXM": DeviceProfile(
        name="NVIDIA H100 SXM5 80GB", sms=132, sram_per_sm=228 * KiB, l1_sram_per_sm=256 * KiB, l2=50 * MiB,
        hbm=80 * 10**9, hbm_bandwidth=3350 * GB_PER_S, fp32=66.9 * TERA, fp16=133.8 * TERA,
        fp16_tensor=989.4 * TERA, tf32_tensor=494.7 * TERA,
        source="NVIDIA H100 datasheet and Hopper GH100 architecture whitepaper"),
    "H200": DeviceProfile(
        name="NVIDIA H200 SXM 141GB", sms=132, sram_per_sm=228 * KiB, l1_sram_per_sm=256 * KiB, l2=60 * MiB,
        hbm=141 * 10**9, hbm_bandwidth=4800 * GB_PER_S, fp32=66.9 * TERA, fp16=133.8 * TERA,
        fp16_tensor=989.4 * TERA, tf32_tensor=494.7 * TERA,
        source="NVIDIA H200 datasheet (same GH100 compute as the H100 SXM, HBM3e memory); L2 as the CUDA "
               "driver reports it on the H200 of benchmarks/results/nvidia-h200"),
    "T4": DeviceProfile(
        name="NVIDIA T4 16GB", sms=40, sram_per_sm=64 * KiB, l1_sram_per_sm=96 * KiB, l2=4 * MiB,
        hbm=16 * 10**9, hbm_bandwidth=320 * GB_PER_S, fp32=8.1 * TERA, fp16=16.2 * TERA,
        fp16_tensor=65 * TERA, tf32_tensor=0.0,
        source="NVIDIA T4 datasheet (GDDR6; no TF32 tensor cores; fp16 CUDA-core rate = 2× fp32, paired fp16)"),
}

_ALIASES = {"a100": "A100-40GB", "a100-40gb": "A100-40GB", "a100-80gb": "A100-80GB", "h100": "H100-SXM",
            "h100-sxm": "H100-SXM", "h200": "H200", "t4": "T4"}

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def device(name) -> DeviceProfile:
    """The profile called ``name`` (``"A100-40GB"``, ``"a100"``, ``"H100-SXM"``, ``"h200"``, ``"T4"``, ...)."""
    if isinstance(name, DeviceProfile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"device must be a device name or a DeviceProfile, got {type(name).__name__}")
    key = name if name in DEVICES else _ALIASES.get(name.lower())
    if key is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}")
    return DEVICES[key]


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"`` or a NumPy dtype)."""
    if isinstance(dtype, str) and dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must name a floating type such as 'float16', got {dtype!r}") from None
    if dt.kind != "f":
        raise TypeError(f"dtype must be a floating type, got {dt}")
    return dt.itemsize


def elements(n_bytes, dtype) -> int:
    """How many elements of ``dtype`` fit in ``n_bytes`` bytes (rounded down)."""
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, Real) or n_bytes < 0:
        raise ValueError(f"n_bytes must be a non-negative number, got {n_bytes!r}")
    return int(n_bytes // itemsize(dtype))


def M_for(device_name, dtype="float16") -> int:
    """FA1 Theorem 2's M (in elements) for one SM of ``device_name``: its shared memory divided by the element size."""
    return elements(device(device_name).sram_per_sm, dtype)


def peak_flops(device_name, dtype="float16", *, tensor_cores: bool = True) -> float:
    """Peak FLOP/s for matmuls in ``dtype``: tensor cores for fp16/bf16 (and fp32 as TF32) unless told not to."""
    dev = device(device_name)
    size = itemsize(dtype)
    if size == 2:
        return dev.fp16_tensor if tensor_cores else dev.fp16
    if size == 4 and tensor_cores and dev.tf32_tensor > 0:
        return dev.tf32_tensor
    if size == 4:
        return dev.fp32
    raise ValueError(f"no peak rate recorded for {np.dtype(dtype) if not isinstance(dtype, str) else dtype} "
                     f"on {dev.name}")


class RooflineEstimate(NamedTuple):
    """A lower bound on run time: ``seconds = max(compute_s, memory_s)``; ``bound`` says which one dominates."""

    seconds: float
    compute_s: float
    memory_s: float
    bound: str                  # "compute" or "memory"
    intensity: float            # FLOPs per byte of HBM traffic
    ridge: float                # the device's FLOPs per byte at which the two times are equal


def roofline_time(flops, n_bytes, device_name, dtype="float16", *, tensor_cores: bool = True) -> RooflineEstimate:
    """Roofline estimate of an operation doing ``flops`` FLOPs and moving ``n_bytes`` bytes of HBM traffic.

    ``compute_s = flops / peak_flops(device, dtype)`` and ``memory_s = n_bytes / hbm_bandwidth``; the operation
    cannot finish faster than the larger of the two. Example: FA1 Figure 2's standard attention moves ~40 GB on an
    A100, at least 40e9 / 1.555e12 ≈ 26 ms however fast the arithmetic.
    """
    for name, value in (("flops", flops), ("n_bytes", n_bytes)):
        if isinstance(value, bool) or not isinstance(value, Real) or value < 0:
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    dev = device(device_name)
    peak = peak_flops(dev, dtype, tensor_cores=tensor_cores)
    compute_s = float(flops) / peak
    memory_s = float(n_bytes) / dev.hbm_bandwidth
    intensity = float(flops) / float(n_bytes) if n_bytes else float("inf")
    bound = "compute" if compute_s >= memory_s else "memory"
    return RooflineEstimate(max(compute_s, memory_s), compute_s, memory_s, bound, intensity,
                            peak / dev.hbm_bandwidth)


# -- links between GPUs -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interconnect:
    """One link between GPUs (or between nodes): its public spec bandwidth, in bytes/s.

    ``per_direction`` is what one direction carries (a ring sends and receives at once, one direction each);
    ``total`` is the datasheets' bidirectional figure, twice that. These are signalling-rate peaks: PCIe's
    128b/130b encoding leaves about 98.5% of them for packets, and protocol overheads take more; NCCL's measured
    bus bandwidth on NVLink 4 is typically 80-90% of the peak.
    """

    name: str
    per_direction: float
    total: float
    source: str


INTERCONNECTS: dict[str, Interconnect] = {
    # NVIDIA A100 datasheet: "NVLink: 600GB/s" (12 third-generation links of 50 GB/s, both directions together).
    "NVLink3-A100": Interconnect(
        name="NVLink 3 (A100 SXM4)", per_direction=300 * GB_PER_S, total=600 * GB_PER_S,
        source="NVIDIA A100 datasheet (NVLink 600 GB/s total, 12 links) and Ampere GA100 whitepaper"),
    # NVIDIA H100 datasheet: "NVLink: 900GB/s"; Hopper whitepaper: 18 fourth-generation links, 900 GB/s total.
    "NVLink4-H100": Interconnect(
        name="NVLink 4 (H100 SXM5)", per_direction=450 * GB_PER_S, total=900 * GB_PER_S,
        source="NVIDIA H100 datasheet (NVLink 900 GB/s total) and Hopper GH100 whitepaper (18 NVLink 4 links)"),
    # NVIDIA H200 datasheet: "NVLink: 900GB/s" — the same fourth-generation NVLink as the H100 SXM.
    "NVLink4-H200": Interconnect(
        name="NVLink 4 (H200 SXM)", per_direction=450 * GB_PER_S, total=900 * GB_PER_S,
        source="NVIDIA H200 datasheet (NVLink 900 GB/s total, the H100's NVLink generation)"),
    # PCIe 5.0 x16: 32 GT/s × 16 lanes ≈ 64 GB/s each way; the H100 datasheet's "PCIe Gen5: 128GB/s" is both ways.
    "PCIe5-x16": Interconnect(
        name="PCIe 5.0 x16", per_direction=64 * GB_PER_S, total=128 * GB_PER_S,
        source="PCI-SIG PCI Express 5.0 base specification (32 GT/s per lane); NVIDIA H100 datasheet "
               "(PCIe Gen5 128 GB/s)"),
    # PCIe 4.0 x16: 16 GT/s × 16 lanes ≈ 32 GB/s each way; the A100 datasheet's "PCIe Gen4: 64GB/s" is both ways.
    "PCIe4-x16": Interconnect(
        name="PCIe 4.0 x16", per_direction=32 * GB_PER_S, total=64 * GB_PER_S,
        source="PCI-SIG PCI Express 4.0 base specification (16 GT/s per lane); NVIDIA A100 datasheet "
               "(PCIe Gen4 64 GB/s)"),
    # InfiniBand NDR: 400 Gb/s per port and direction = 50 GB/s (NVIDIA ConnectX-7 / Quantum-2 datasheets).
    "IB-NDR": Interconnect(
        name="InfiniBand NDR 400 Gb/s", per_direction=50 * GB_PER_S, total=100 * GB_PER_S,
        source="NVIDIA ConnectX-7 adapter and Quantum-2 switch datasheets (NDR, 400 Gb/s per port)"),
}

_LINK_ALIASES = {"nvlink3": "NVLink3-A100", "nvlink3-a100": "NVLink3-A100", "nvlink": "NVLink4-H100",
                 "nvlink4": "NVLink4-H100", "nvlink4-h100": "NVLink4-H100", "nvlink4-h200": "NVLink4-H200",
                 "pcie5": "PCIe5-x16", "pcie5-x16": "PCIe5-x16", "pcie4": "PCIe4-x16", "pcie4-x16": "PCIe4-x16",
                 "ib": "IB-NDR", "ndr": "IB-NDR", "ib-ndr": "IB-NDR", "infiniband": "IB-NDR"}


def interconnect(name) -> Interconnect:
    """The link called ``name`` (``"NVLink4-H100"``, ``"nvlink"``, ``"PCIe5-x16"``, ``"pcie4"``, ``"IB-NDR"``, ...).

    Parameters
    ----------
    name : str or Interconnect
        A key of :data:`INTERCONNECTS` or one of its lower-case aliases; an :class:`Interconnect` is returned as is.

    Returns
    -------
    Interconnect
        Its ``per_direction`` and ``total`` bandwidths in bytes/s, and the source of the figures.
    """
    if isinstance(name, Interconnect):
        return name
    if not isinstance(name, str):
        raise TypeError(f"link must be an interconnect name or an Interconnect, got {type(name).__name__}")
    key = name if name in INTERCONNECTS else _LINK_ALIASES.get(name.lower())
    if key is None:
        raise ValueError(f"unknown interconnect {name!r}; known links: {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[key]
