"""The inference kernels: decoding from a KV cache (contiguous or paged, split-KV, GQA) and packed batches.

* :mod:`~kernels_gpu.inference.decode` — :func:`decode_attention`, the host side of a decoding step: checks, the
  split rule, the plan of launches (prepared once per cache), the merge of the splits (a launch, or inside the
  splits' thread-block cluster).
* :mod:`~kernels_gpu.inference.decode_tc` — the split program on tensor cores for 16-bit caches, its tiles brought
  in by Hopper's copy engine through tensor maps (:mod:`kernels_gpu.tensor_map`).
* :mod:`~kernels_gpu.inference.varlen` — :func:`varlen_attention`, packed variable-length batches.
* :mod:`~kernels_gpu.inference.decode_io` (traffic counted in the simulator),
  :mod:`~kernels_gpu.inference.decode_inspect` (what a plan will launch),
  :mod:`~kernels_gpu.inference.decode_sanitize` (one launch of each program, for compute-sanitizer).

They build on the bottom of the package (:mod:`kernels_gpu.runtime`, :mod:`kernels_gpu.ptx`,
:mod:`kernels_gpu.driver_launch`, :mod:`kernels_gpu.tensor_map`); users import the two entry points from
``kernels_gpu`` itself: ``kernels_gpu.decode_attention``, ``kernels_gpu.varlen_attention``.
"""

from kernels_gpu.inference.decode import DecodeResult, decode_attention
from kernels_gpu.inference.varlen import varlen_attention

__all__ = ["DecodeResult", "decode_attention", "varlen_attention"]
