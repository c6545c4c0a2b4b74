"""FlashAttention as a PyTorch op: ``fa2edu.torch.flash_attention``, an ``autograd.Function`` per algorithm.

Every anchor a learner meets (flash-attn, the Triton tutorial, course assignments) hands its attention to PyTorch
the same way: a ``torch.autograd.Function`` whose ``forward`` runs the paper's forward pass and *saves only what the
paper's algorithm saves*, and whose ``backward`` runs the paper's backward pass from those saved tensors. This
module does exactly that, three times, so the saved tensors can be compared:

==============  ===========================  ==============================  ==================================
algorithm       forward / backward            saved for backward (per head)   HBM that costs (elements)
==============  ===========================  ==============================  ==================================
``"flash2"``    FA2 Alg. 1 / Alg. 2           Q, K, V, O and L                N_q·(d + d_v + 1) + N_k·(d + d_v)
``"flash1"``    FA1 Alg. 2 / Alg. 4           Q, K, V, O, ℓ and m             N_q·(d + d_v + 2) + N_k·(d + d_v)
``"standard"``  FA1 Alg. 0 / Alg. 3           Q, K, V and P                   N_q·(d + N_k) + N_k·(d + d_v)
==============  ===========================  ==============================  ==================================

Only the standard algorithm keeps an N_q × N_k tensor alive between the passes (FA1 Section 3.1: "we do not store
the N × N attention matrix"; FA2 Section 3.1, tweak 2: only the log-sum-exp L = m + log ℓ).

Where it runs:

* **CPU tensors** (float32 or float64) run fa2edu's NumPy algorithms on the tensors' memory (``Tensor.numpy()``
  shares it): the counted, line-by-line textbook code, so slow but exact.
* **CUDA tensors** (float32, ``algorithm="flash2"`` or ``"standard"``) run ``kernels_gpu.flash2_forward`` /
  ``flash2_backward`` (or ``standard_attention`` / ``standard_attention_backward``; kernels_gpu has no FA1
  backward, so ``"flash1"`` is CPU only).
  The tensors are handed over zero-copy through ``__cuda_array_interface__``, and the numba device arrays that come
  back are wrapped, again without a copy, by ``torch.as_tensor(..., device=q.device)``.

Layout: q (…, H_q, N_q, d), k (…, H_kv, N_k, d), v (…, H_kv, N_k, d_v), as ``F.scaled_dot_product_attention``
takes them, with GQA/MQA when H_q is a multiple of H_kv (K, V never repeated). ``causal=True`` is bottom-right
aligned (query i sees key j iff j ≤ i + N_k − N_q, docs/conventions.md); SDPA's ``is_causal`` is top-left aligned, which
differs only when N_q ≠ N_k. Fully masked rows give O = 0 and zero gradients.

Non-contiguous inputs (a ``transpose(1, 2)`` of a (B, N, H, d) projection, say) are accepted and copied to a
contiguous layout inside the op (``Tensor.contiguous()``, a no-op for contiguous tensors); the gradients come back
with the inputs' shapes. The backward passes are NumPy (or numba) code that autograd cannot trace, so the op is
differentiable once: a double backward (``create_graph=True``) raises instead of returning wrong zeros.

This file is named ``torch.py`` inside the ``fa2edu`` package; ``import torch`` below still means PyTorch because
imports are absolute in Python 3 (the package's own module is ``fa2edu.torch``). ``import fa2edu`` never imports
this module, so fa2edu works without PyTorch.
"""

from __future__ import annotations

from contextlib import contextmanager

try:
    import torch
except ModuleNotFoundError as error:  # pragma: no cover - exercised only where torch is absent
    if error.name != "torch":
        raise
    raise ImportError("fa2edu.torch needs PyTorch, which is not installed: `pip install torch` "
                      "(or `pip install 'fa2edu[torch]'`); the rest of fa2edu works without it") from error

import numpy as np

import fa2edu

__all__ = ["flash_attention", "ALGORITHMS", "Flash2Attention", "Flash1Attention", "StandardAttention"]

#: The algorithms ``flash_attention`` can run on the CPU; on CUDA those kernels_gpu has both passes of.
ALGORITHMS = ("flash2", "flash1", "standard")
_CUDA_ALGORITHMS = ("flash2", "standard")

_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float32,)


# -- moving tensors between PyTorch, NumPy and numba --------------------------------------------------------------

def _to_numpy(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a NumPy array sharing its memory (no copy)."""
    return x.detach().numpy()


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    """A NumPy result as a CPU tensor sharing its memory (a copy only if NumPy marked it read-only)."""
    return torch.from_numpy(x if x.flags.writeable else x.copy())


def _kernels_gpu():
    """kernels_gpu, imported only when a CUDA tensor arrives (it needs numba.cuda)."""
    try:
        import kernels_gpu
    except ImportError as error:
        raise ImportError(f"CUDA tensors run kernels_gpu's numba.cuda kernels, which failed to import: {error}"
                          ) from error
    return kernels_gpu


def _for_gpu(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors handed to kernels_gpu, detached: torch refuses ``__cuda_array_interface__`` on a tensor that
    requires grad (the kernels read its memory, zero-copy; autograd is this Function's job)."""
    return tuple(x.detach() for x in tensors)


def _from_gpu(x, like: torch.Tensor) -> torch.Tensor:
    """A kernels_gpu result (a numba device array, or anything with ``__cuda_array_interface__``) as a tensor on
    ``like``'s device, zero-copy: torch keeps the device array alive for as long as the tensor lives."""
    return torch.as_tensor(x, device=like.device)


@contextmanager
def _numba_stream(device: torch.device):
    """Order numba's launches after PyTorch's pending work and PyTorch's next work after numba's launches.

    numba launches on the legacy default stream, which is PyTorch's default stream too: there nothing is needed.
    Under ``torch.cuda.stream(side)`` the two are not ordered, so each side waits for the other (no host sync).
    """
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current == default:
        yield
        return
    default.wait_stream(current)
    yield
    current.wait_stream(default)


# -- the three autograd Functions -----------------------------------------------------------------------------------

class Flash2Attention(torch.autograd.Function):
    """FA2 Alg. 1 forward, Alg. 2 backward. Saves Q, K, V, O and the log-sum-exp L: never S or P.

    Cost per (batch, head) with N_q = N_k = N, d_v = d: forward 4N²d matmul FLOPs, backward 10N²d (2.5×, FA2
    Section 4.1); HBM reads Nd + 2Nd·T_r and writes Nd + N in the forward pass (the conventions' table).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if q.is_cuda:
            # FA2 Alg. 1 on the GPU: one thread block per row block of Q (FA2 Section 3.2).
            with _numba_stream(q.device):
                O, L = _kernels_gpu().flash2_forward(*_for_gpu(q, k, v), block_sizes=block_sizes, causal=causal,
                                                     scale=scale)
            O, L = _from_gpu(O, q), _from_gpu(L, q)
        else:
            # FA2 Alg. 1 in NumPy: returns O and L = m + log ℓ, nothing else survives the pass.
            fwd = fa2edu.flash2_forward(_to_numpy(q), _to_numpy(k), _to_numpy(v), M=M, block_sizes=block_sizes,
                                        causal=causal, scale=scale)
            O, L = _from_numpy(fwd.O), _from_numpy(fwd.L)
        # FA2 Section 3.1, tweak 2: the backward pass needs only O and L (plus the inputs) to rebuild P.
        ctx.save_for_backward(q, k, v, O, L)
        ctx.options = dict(causal=causal, scale=scale, block_sizes=block_sizes, M=M)
        return O

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        q, k, v, O, L = ctx.saved_tensors
        options = ctx.options
        dO = dO.contiguous()
        if q.is_cuda:
            options_gpu = {key: options[key] for key in ("block_sizes", "causal", "scale")}
            # FA2 Alg. 2 on the GPU: one thread block per column block of K/V, atomic adds into dQ.
            with _numba_stream(q.device):
                dQ, dK, dV = _kernels_gpu().flash2_backward(*_for_gpu(q, k, v, O, L, dO), **options_gpu)
            dQ, dK, dV = (_from_gpu(x, q) for x in (dQ, dK, dV))
        else:
            # FA2 Alg. 2 in NumPy: D = rowsum(dO ∘ O), then P = exp(S − L) recomputed block by block.
            grads = fa2edu.flash2_backward(*(_to_numpy(x) for x in (q, k, v, O, L, dO)), **options)
            dQ, dK, dV = (_from_numpy(x) for x in grads)
        return dQ, dK, dV, None, None, None, None


class Flash1Attention(torch.autograd.Function):
    """FA1 Alg. 2 forward (Alg. 1 with the scale τ and the mask), Alg. 4 backward. Saves Q, K, V, O, ℓ and m.

    Cost per (batch, head): the same FLOPs as FA2; HBM reads 2Nd + T_c(2Nd + 2N), writes T_c(Nd + 2N) forward,
    because O, ℓ, m go back to HBM on every inner step (the conventions' table). CPU only: kernels_gpu has FA1's forward
    kernel but no backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        fwd = fa2edu.flash1_forward(_to_numpy(q), _to_numpy(k), _to_numpy(v), M=M, block_sizes=block_sizes,
                                    causal=causal, scale=scale)
        O, l, m = (_from_numpy(x) for x in (fwd.O, fwd.l, fwd.m))
        # FA1 Alg. 2 line 15 / Alg. 4 line 1: O and the two statistics ℓ, m are what the backward pass reads.
        ctx.save_for_backward(q, k, v, O, l, m)
        ctx.options = dict(causal=causal, scale=scale, block_sizes=block_sizes, M=M)
        return O

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        q, k, v, O, l, m = ctx.saved_tensors
        # FA1 Alg. 4: P rebuilt block by block from ℓ and m, D_i = rowsum(dO_i ∘ O_i).
        grads = fa2edu.flash1_backward(*(_to_numpy(x) for x in (q, k, v, O, l, m, dO.contiguous())),
                                       **ctx.options)
        dQ, dK, dV = (_from_numpy(x) for x in grads)
        return dQ, dK, dV, None, None, None, None


class StandardAttention(torch.autograd.Function):
    """FA1 Alg. 0 forward, Alg. 3 backward. Saves Q, K, V and the N_q × N_k matrix P: the memory FlashAttention
    removes. Cost per (batch, head): HBM reads 3Nd + 2N², writes Nd + 2N² forward. CPU (NumPy) and CUDA
    (kernels_gpu's standard_attention and standard_attention_backward).

    ``block_sizes`` and ``M`` do not apply (nothing is tiled) and must be None.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M):
        if block_sizes is not None or M is not None:
            raise ValueError("algorithm='standard' is not tiled: block_sizes and M must be None")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if q.is_cuda:
            # FA1 Alg. 0 on the GPU: S and P materialised in global memory by separate launches.
            with _numba_stream(q.device):
                O, P = _kernels_gpu().standard_attention(*_for_gpu(q, k, v), causal=causal, scale=scale)
            O, P = _from_gpu(O, q), _from_gpu(P, q)
        else:
            fwd = fa2edu.standard_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), causal=causal, scale=scale)
            O, P = _from_numpy(fwd.O), _from_numpy(fwd.P)
        # FA1 Alg. 0 line 2: P = softmax(S) was written to HBM, and Alg. 3 reads it back: it is kept alive.
        ctx.save_for_backward(q, k, v, P)
        ctx.options = dict(causal=causal, scale=scale)
        return O

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        q, k, v, P = ctx.saved_tensors
        dO = dO.contiguous()
        # FA1 Alg. 3: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = τ dS K, dK = τ dSᵀ Q.
        if q.is_cuda:
            with _numba_stream(q.device):
                grads = _kernels_gpu().standard_attention_backward(*_for_gpu(q, k, v, P, dO), **ctx.options)
            dQ, dK, dV = (_from_gpu(x, q) for x in grads)
        else:
            grads = fa2edu.standard_attention_backward(*(_to_numpy(x) for x in (q, k, v, P, dO)), **ctx.options)
            dQ, dK, dV = (_from_numpy(x) for x in grads)
        return dQ, dK, dV, None, None, None, None


_FUNCTIONS = {"flash2": Flash2Attention, "flash1": Flash1Attention, "standard": StandardAttention}


# -- the public op -----------------------------------------------------------------------------------------------

def _check_tensors(q, k, v, algorithm: str) -> None:
    """Type, dtype, device and finiteness checks, naming the argument; shapes are checked by fa2edu/kernels_gpu."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} "
                            f"(for NumPy arrays call fa2edu.{algorithm}_forward directly)")
    devices = {x.device for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if device.type == "cpu":
        if q.dtype not in _CPU_DTYPES:
            hint = (" (fa2edu's NumPy path computes in float32 or float64; cast with .float() or .double())"
                    if q.dtype in (torch.float16, torch.bfloat16) else "")
            raise TypeError(f"q has dtype {q.dtype}; on the CPU flash_attention takes float32 or float64{hint}")
    elif device.type == "cuda":
        if q.dtype not in _CUDA_DTYPES:
            raise TypeError(f"q has dtype {q.dtype}; on CUDA flash_attention takes float32 (kernels_gpu's kernels "
                            f"are fp32 CUDA-core kernels); for float64 move the tensors to the CPU")
        if algorithm not in _CUDA_ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r} runs on the CPU only (kernels_gpu has no FA1 backward); on "
                             f"CUDA use one of {_CUDA_ALGORITHMS}, or move the tensors to the CPU")
    else:
        raise ValueError(f"q, k, v are on device {device}; flash_attention runs on 'cpu' and 'cuda'")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got {tuple(x.shape)}")
        if x.numel() and not bool(torch.isfinite(x.detach()).all()):
            raise ValueError(f"{name} contains NaN or infinite values; attention inputs must be finite")


def flash_attention(q, k, v, causal: bool = False, scale=None, algorithm: str = "flash2", block_sizes=None,
                    M=None) -> torch.Tensor:
    """softmax(τ·q kᵀ [+ causal mask]) v, differentiable, computed by one of the papers' algorithms.

    Args:
        q (torch.Tensor): queries, shape (…, H_q, N_q, d); float32 or float64 on the CPU, float32 on CUDA; finite.
        k (torch.Tensor): keys, shape (…, H_kv, N_k, d), on q's device in q's dtype; H_q must be a multiple of H_kv
            (GQA/MQA).
        v (torch.Tensor): values, shape (…, H_kv, N_k, d_v), on q's device in q's dtype.
        causal (bool, optional): bottom-right aligned causal mask (query i sees key j iff j ≤ i + N_k − N_q).
            Default False.
        scale (float, optional): the softmax scale τ. Default None: 1/√d (FA2 footnote 2's 1/d is erratum 7).
        algorithm (str, optional): ``"flash2"`` (FA2 Alg. 1/2, the default), ``"flash1"`` (FA1 Alg. 2/4, CPU only)
            or ``"standard"`` (FA1 Alg. 0/3, which saves P).
        block_sizes (tuple of int, optional): ``(B_r, B_c)`` for the tiled algorithms (None with ``"standard"``).
            Default None: from ``M`` by the conventions' rules on the CPU, and
            :func:`kernels_gpu.runtime.default_block_sizes` on CUDA.
        M (int, optional): SRAM size in elements, for the tiled algorithms on the CPU only (the kernels take
            ``block_sizes``). Default None: the block sizes of :data:`fa2edu.blocks.DEFAULT_M`.

    Returns:
        O of shape (…, H_q, N_q, d_v) in the inputs' dtype, with a ``grad_fn`` whose backward runs the matching
        backward algorithm on the saved tensors listed in the module docstring.
    """
    if algorithm not in _FUNCTIONS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_tensors(q, k, v, algorithm)
    if q.is_cuda and M is not None:
        raise ValueError("M (the simulated SRAM size) applies to the CPU path; on CUDA pass block_sizes=(B_r, B_c)")
    return _FUNCTIONS[algorithm].apply(q, k, v, causal, scale, block_sizes, M)
