"""FlashAttention as a PyTorch operator: ``fa2edu.torch.flash_attention`` (and ``flex_attention``).

Every anchor a learner meets (flash-attn, the Triton tutorial, course assignments) hands its attention to PyTorch
the same way: a forward pass that runs the paper's forward algorithm and *saves only what the paper's algorithm
saves*, and a backward pass that runs the paper's backward algorithm from those saved tensors. This module does that
three times, so the saved tensors can be compared:

==============  ===========================  ==============================  ==================================
algorithm       forward / backward            saved for backward (per head)   HBM that costs (elements)
==============  ===========================  ==============================  ==================================
``"flash2"``    FA2 Alg. 1 / Alg. 2           Q, K, V, O and L                N_q·(d + d_v + 1) + N_k·(d + d_v)
``"flash1"``    FA1 Alg. 2 / Alg. 4           Q, K, V, O, ℓ and m             N_q·(d + d_v + 2) + N_k·(d + d_v)
``"standard"``  FA1 Alg. 0 / Alg. 3           Q, K, V and P                   N_q·(d + N_k) + N_k·(d + d_v)
==============  ===========================  ==============================  ==================================

Only the standard algorithm keeps an N_q × N_k tensor alive between the passes (FA1 Section 3.1: "we do not store
the N × N attention matrix"; FA2 Section 3.1, tweak 2: only the log-sum-exp L = m + log ℓ).

**How it is registered.** Each algorithm is a pair of PyTorch custom operators (``torch.library.custom_op``, in
the namespace ``fa2edu``): ``torch.ops.fa2edu.flash_attention_fwd`` returns (O, L) and
``torch.ops.fa2edu.flash_attention_bwd`` returns (dQ, dK, dV); ``flash1_attention_fwd|bwd`` and
``standard_attention_fwd|bwd`` likewise. Each has a *fake* implementation (shapes and dtypes only, no data), so
``torch.compile(fullgraph=True)`` traces through the operator instead of into NumPy or numba code it cannot read,
and ``torch.library.opcheck`` passes. ``torch.library.register_autograd`` joins each pair: the forward's
``setup_context`` saves exactly the tensors of the table above, and the backward formula calls the backward
operator. That is the road ``torch.compile`` takes. In eager mode (plain tensors, no tracing) ``flash_attention``
takes a shorter one to the same code: the ``torch.autograd.Function`` form of the op (:class:`Flash2Attention`,
:class:`Flash1Attention`, :class:`StandardAttention`, usable on their own), whose passes call the operators' bodies
without PyTorch's dispatcher, which costs host time on every call (see "the autograd formulas" below).

**Where it runs** (``fa2edu._torch_ops``, one table, :data:`DISPATCH`): CPU float32/float64 → fa2edu's NumPy
algorithms (the counted textbook code, on the tensors' own memory); CUDA float32 → tensor cores, each product as
three TF32 products, float32's accuracy, as PyTorch's own float32 SDPA computes (``backend="3xtf32"``:
``kernels_gpu.tensorcore.TF32``, ``TF32_BACKWARD``; heads wider than 128 on ``kernels_gpu.fast``); CUDA
float16/bfloat16 → ``kernels_gpu.hopper``'s forward on sm_90 where it measured faster, ``kernels_gpu.tensorcore``
otherwise. The CUDA-core float32 kernels run by name (``backend="fast"``), and the teaching kernels
(``kernels_gpu.flash2_forward`` …) only by name too: ``backend="teaching"``, or ``algorithm="standard"`` on CUDA.
Every head dimension 1 … 256 runs on every path: the fast kernels need widths that are multiples of their thread
layout (32 or 64) and the tensor-core kernels multiples of 8, so the op pads Q, K, V (and O, dO) with zero columns
inside the call and slices the results; τ defaults to 1/√d of the caller's d, not the padded one.

Layout: q (…, H_q, N_q, d), k (…, H_kv, N_k, d), v (…, H_kv, N_k, d_v), as ``F.scaled_dot_product_attention``
takes them, with GQA/MQA when H_q is a multiple of H_kv (K, V never repeated). ``causal=True`` is bottom-right
aligned (query i sees key j iff j ≤ i + N_k − N_q, docs/conventions.md); SDPA's ``is_causal`` is top-left aligned,
which differs only when N_q ≠ N_k. Fully masked rows give O = 0, L = +inf and zero gradients.

Non-contiguous inputs (a ``transpose(1, 2)`` of a (B, N, H, d) projection, say) are read where they lie by the
tensor-core kernels (float16, bfloat16 on CUDA), which lay O and the gradients out like the inputs — O of such a
view is (B, N, H, d) in memory, as SDPA's flash and cuDNN kernels make it, so ``O.transpose(1, 2).reshape(B, N,
H·d)`` copies nothing; the other paths copy them to a contiguous layout first (``Tensor.contiguous()``) and return
contiguous results. The gradients come back with the inputs' shapes. The op is differentiable **once**: its backward
runs the paper's backward algorithm, which has no derivative of its own here, so a double backward — a gradient
penalty, ``torch.autograd.grad(out, q, create_graph=True)`` then a backward through that gradient — raises a
``RuntimeError`` saying so (:data:`DOUBLE_BACKWARD_ERROR`) when it reaches the op, on both roads below, rather
than silently dropping the second-order term. L (``return_lse=True``) is not differentiable.

**Scores and masks as code** (DESIGN.md's FlexAttention contract): :func:`flex_attention` is
``torch.nn.attention.flex_attention``'s signature (plus ``score_mod_grad``) on :mod:`fa2edu.flex`: FA2 Alg. 1/2 over
a BlockMask's blocks, through the score_mod and its derivative, as the operators ``torch.ops.fa2edu.
flex_attention_fwd|bwd``. Python mods cannot be operator arguments: the eager road hands them to its Function, the
traced road registers them and passes an int key (``fa2edu._torch_ops``, section 4). flash-attn's keywords of
:func:`flash_attention` — ``window_size``, ``softcap``, ``alibi_slopes`` — run on the same machinery
(``torch.ops.fa2edu.flash_attention_flex_fwd|bwd``, which take them as numbers and a tensor). Both run where
``fa2edu._torch_ops.FLEX_DISPATCH`` says: CPU float32/float64 on fa2edu.flex (NumPy), CUDA float16/bfloat16 on
``kernels_gpu.flex`` (the mods compiled by numba into tensor-core kernels); CUDA float32 gets a clear error (no
kernel of float32's accuracy: cast to bfloat16 yourself or move to the CPU), never a silent cast or copy.

This file is named ``torch.py`` inside the ``fa2edu`` package; ``import torch`` below still means PyTorch because
imports are absolute in Python 3 (the package's own module is ``fa2edu.torch``). ``import fa2edu`` never imports
this module, so fa2edu works without PyTorch.
"""

from __future__ import annotations

try:
    import torch
except ModuleNotFoundError as error:  # pragma: no cover - exercised only where torch is absent
    if error.name != "torch":
        raise
    raise ImportError("fa2edu.torch needs PyTorch, which is not installed: `pip install torch` "
                      "(or `pip install 'fa2edu[torch]'`); the rest of fa2edu works without it") from error

import math
from numbers import Integral, Real

from fa2edu import _torch_ops as ops
from fa2edu._torch_ops import ALGORITHMS, BACKENDS, DISPATCH, MAX_HEAD_DIM, choose_backend
from fa2edu.blocks import block_sizes_q_outer, resolve_block_sizes
from fa2edu.validation import check_block_sizes, check_M, check_scale

__all__ = ["flash_attention", "flex_attention", "ALGORITHMS", "BACKENDS", "DISPATCH", "MAX_HEAD_DIM",
           "choose_backend", "Flash2Attention", "Flash1Attention", "StandardAttention", "DOUBLE_BACKWARD_ERROR",
           "quantize_fp8"]


# -- checking and resolving the arguments ----------------------------------------------------------------------------

def _check_tensors(q, k, v, algorithm: str):
    """Types, one device, one dtype; returns q, k, v (cast to the autocast dtype on CUDA under autocast).
    Everything here reads only metadata, so ``torch.compile`` turns it into guards (a data-dependent check would
    break its graph)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} "
                            f"(for NumPy arrays call fa2edu.{algorithm}_forward directly)")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q on {q.device} and {name} on {x.device}")
    if q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        # As SDPA does under autocast: attention runs in the autocast dtype (float16 or bfloat16).
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (x.to(dtype) for x in (q, k, v))
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"q, k, v must share one dtype, got q {q.dtype} and {name} {x.dtype}")
    return q, k, v


def _check_shapes(q, k, v) -> None:
    """(…, H_q, N_q, d), (…, H_kv, N_k, d), (…, H_kv, N_k, d_v) with H_q a multiple of H_kv and d, d_v ≤ 256."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, d) with at least 2 axes, got {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != q.dim():
            raise ValueError(f"{name} must have as many axes as q ({q.dim()}), got shape {tuple(x.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's head dimension d = {q.shape[-1]}, got shape {tuple(k.shape)}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must have k's leading axes and N_k rows {tuple(k.shape[:-1])}, got {tuple(v.shape)}")
    if q.dim() >= 3:
        if q.shape[:-3] != k.shape[:-3]:
            raise ValueError(f"q and k must share their batch axes, got {tuple(q.shape)} and {tuple(k.shape)}")
        H_q, H_kv = q.shape[-3], k.shape[-3]
        if H_kv == 0 or H_q % H_kv:
            raise ValueError(f"q has H_q = {H_q} heads, which must be a multiple of k's and v's H_kv = {H_kv} "
                             "(GQA/MQA: query head h reads key/value head h // (H_q / H_kv))")
    for name, x in (("q", q), ("v", v)):
        if not 1 <= x.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"{name} has head dimension {x.shape[-1]}; flash_attention takes 1 to {MAX_HEAD_DIM} "
                             "on every device (as flash-attn does)")


def _prepare(q, k, v, algorithm, causal, scale, backend, block_sizes, M):
    """Checked q, k, v (contiguous, except for the tensor cores) and the operator's resolved arguments (causal,
    scale, backend, block_sizes, M)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    q, k, v = _check_tensors(q, k, v, algorithm)
    backend = choose_backend(q.device.type, q.dtype, algorithm, backend)
    _check_shapes(q, k, v)
    # The keywords as the NumPy API checks them (fa2edu.validation): τ = 1/√d of the caller's d by default (FA2
    # footnote 2: erratum 7), any finite real (np.float32 included); block sizes a pair of ints ≥ 1 (2.5 and True
    # refused, never truncated); M an int ≥ 4d.
    scale = check_scale(scale, q.shape[-1])
    if M is not None and backend != "numpy":
        raise ValueError(f"M (the simulated SRAM size) applies to the NumPy backend; backend {backend!r} runs on a "
                         "GPU (the teaching kernels take block_sizes=(B_r, B_c))")
    if block_sizes is not None:
        if algorithm == "standard":
            raise ValueError("algorithm='standard' is not tiled: block_sizes and M must be None")
        if backend not in ("numpy", "teaching"):
            raise ValueError(f"block_sizes apply to the 'numpy' and 'teaching' backends; backend {backend!r} "
                             "chooses its own tiles")
        block_sizes = list(check_block_sizes(block_sizes))
    if algorithm == "standard" and M is not None:
        raise ValueError("algorithm='standard' is not tiled: block_sizes and M must be None")
    if M is not None:
        M = check_M(M, q.shape[-1])
    if not ops.reads_strided(backend):       # the tensor cores read strided q, k, v where they lie
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return (q, k, v), (causal, float(scale), backend, block_sizes, M)


# -- the autograd formulas ---------------------------------------------------------------------------------------------
#
# Two roads lead to the same kernels, chosen per call by flash_attention (:func:`_eager`):
#
# * **eager** (not under torch.compile, plain tensors): the algorithm's autograd Function (_Flash2, _Flash1,
#   _Standard), whose forward and backward call the operators' bodies (fa2edu._torch_ops.*_impl) directly.
#   PyTorch's dispatcher has nothing to add here and costs host time on every call: on an H100 host, 1.1 ms per
#   forward + backward through the registered operators against 0.75 ms through the Function (bfloat16, d = 64,
#   benchmarks/profilers/op_host_time.py), which a small model's training step pays once per layer;
# * **traced** (torch.compile, torch.export, torch.jit.trace, FakeTensors and other tensor subclasses): the operators
#   torch.ops.fa2edu.*_fwd, whose autograd formula (_flash2_formula, ...) calls torch.ops.fa2edu.*_bwd, so that a
#   compiled graph holds two opaque operators with fake implementations.
#
# Both roads save the same tensors (one setup_context function per algorithm) and run the same code on the same
# arguments, so they return the same bits (tests/test_torch_op.py). The public Functions (Flash2Attention, ...)
# are the op in torch.autograd.Function form, usable on their own: Flash2Attention.apply(q, k, v, causal, scale,
# block_sizes, M) checks its arguments and returns O; the eager road's Functions are their subclasses that take
# the arguments flash_attention has already checked and return all the operator's outputs.

#: what a double backward through the op raises (a RuntimeError, as PyTorch's own once-differentiable ops do)
DOUBLE_BACKWARD_ERROR = (
    "fa2edu.torch.flash_attention does not support double backward: its backward pass runs the paper's backward "
    "algorithm, which has no derivative of its own, so the gradient it returns cannot be differentiated again (a "
    "gradient penalty: create_graph=True, then a backward through the gradient). Compute such a loss with an "
    "attention that is twice differentiable, e.g. torch.nn.functional.scaled_dot_product_attention on the CPU "
    "(its math backend) or softmax(q kᵀ·scale) v written out")


class _DoubleBackwardRefused(torch.autograd.Function):
    """The op's gradients as they are, with a backward of their own that raises :data:`DOUBLE_BACKWARD_ERROR`.

    The backward algorithms run outside autograd (NumPy, numba kernels), so under ``create_graph=True`` their
    gradients would come back with no history at all and a backward through them would silently miss the op's
    second-order term. Passing them through this Function gives them one, whose only job is to refuse.
    """

    @staticmethod
    def forward(ctx, needs_grad, *grads):
        # ``needs_grad``: a tensor the backward read that requires gradients (the gradients themselves do not: they
        # were computed outside autograd), so that the outputs get this Function as their grad_fn.
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _differentiable_once(ctx, dO, grads):
    """The backward's ``grads``; when the backward itself is being recorded (``create_graph=True``, so grad mode
    is on inside it) and something it read needs gradients, wrapped so that differentiating them raises."""
    if torch.is_grad_enabled():
        needs_grad = [t for t in (dO, *ctx.saved_tensors) if t is not None and t.requires_grad]
        if needs_grad:
            return _DoubleBackwardRefused.apply(needs_grad[0], *grads)
    return grads


def _refuse_double_backward(ctx, *_):
    """The traced road's autograd formula of the backward operators: a double backward is refused."""
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _nothing_to_save(ctx, inputs, output):
    """The backward operators' setup_context: their formula only raises, so it needs nothing."""


def _options(args) -> dict:
    return dict(zip(("causal", "scale", "backend", "block_sizes", "M"), args))


def _eager(q, k, v) -> bool:
    """Whether flash_attention takes the eager road: not while torch.compile, torch.export or torch.jit.trace
    traces (a traced graph should hold the registered operator, which TorchScript can save, not a Python call),
    and only for plain tensors (FakeTensors and the other subclasses that tracing uses go to the operators)."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and type(q) is type(k) is type(v) is torch.Tensor)


class Flash2Attention(torch.autograd.Function):
    """FA2 Alg. 1 forward, Alg. 2 backward. Saves Q, K, V, O and the log-sum-exp L: never S or P.

    Cost per (batch, head) with N_q = N_k = N, d_v = d: forward 4N²d matmul FLOPs, backward 10N²d (2.5×, FA2
    Section 4.1); HBM reads Nd + 2Nd·T_r and writes Nd + N in the forward pass (the conventions' table).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M, backend=None):
        (q, k, v), args = _prepare(q, k, v, "flash2", causal, scale, backend, block_sizes, M)
        O, L = ops.flash_attention_fwd_impl(q, k, v, *args)
        _flash2_setup_context(ctx, (q, k, v) + args, (O, L))
        return O

    @staticmethod
    def backward(ctx, dO, *_):
        q, k, v, O, L = ctx.saved_tensors
        # FA2 Alg. 2 from Q, K, V, O, L and dO (D = rowsum(dO ∘ O) is recomputed, line 4).
        dQ, dK, dV = _differentiable_once(ctx, dO, ops.flash_attention_bwd_impl(dO, q, k, v, O, L,
                                                                                 *ctx.options.values()))
        return dQ, dK, dV, None, None, None, None, None


class _Flash2(Flash2Attention):
    """The eager road of FA2: checked, resolved arguments in the operator's order; returns (O, L)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, block_sizes, M):
        O, L = ops.flash_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)
        _flash2_setup_context(ctx, (q, k, v, causal, scale, backend, block_sizes, M), (O, L))
        return O, L


def _flash2_setup_context(ctx, inputs, output):
    """What FA2's forward keeps for its backward (FA2 Section 3.1, tweak 2): Q, K, V, O and L."""
    q, k, v, *args = inputs
    O, L = output
    ctx.save_for_backward(q, k, v, O, L)
    ctx.options = _options(args)
    ctx.mark_non_differentiable(L)


def _flash2_formula(ctx, dO, dL):
    """The traced road's backward: the registered backward operator on the same saved tensors."""
    q, k, v, O, L = ctx.saved_tensors
    dQ, dK, dV = torch.ops.fa2edu.flash_attention_bwd(dO, q, k, v, O, L, *ctx.options.values())
    return dQ, dK, dV, None, None, None, None, None


class Flash1Attention(torch.autograd.Function):
    """FA1 Alg. 2 forward (Alg. 1 with the scale τ and the mask), Alg. 4 backward. Saves Q, K, V, O, ℓ and m.

    Cost per (batch, head): the same FLOPs as FA2; HBM reads 2Nd + T_c(2Nd + 2N), writes T_c(Nd + 2N) forward,
    because O, ℓ, m go back to HBM on every inner step (the conventions' table). CPU only: kernels_gpu has FA1's
    forward kernel but no backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M, backend=None):
        (q, k, v), args = _prepare(q, k, v, "flash1", causal, scale, backend, block_sizes, M)
        O, l, m = ops.flash1_attention_fwd_impl(q, k, v, *args)
        _flash1_setup_context(ctx, (q, k, v) + args, (O, l, m))
        return O

    @staticmethod
    def backward(ctx, dO, *_):
        q, k, v, O, l, m = ctx.saved_tensors
        # FA1 Alg. 4: P rebuilt block by block from ℓ and m.
        dQ, dK, dV = _differentiable_once(ctx, dO, ops.flash1_attention_bwd_impl(dO, q, k, v, O, l, m,
                                                                                  *ctx.options.values()))
        return dQ, dK, dV, None, None, None, None, None


class _Flash1(Flash1Attention):
    """The eager road of FA1: checked, resolved arguments in the operator's order; returns (O, ℓ, m)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, block_sizes, M):
        O, l, m = ops.flash1_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)
        _flash1_setup_context(ctx, (q, k, v, causal, scale, backend, block_sizes, M), (O, l, m))
        return O, l, m


def _flash1_setup_context(ctx, inputs, output):
    """FA1 Alg. 2 line 15 / Alg. 4 line 1: O and the two statistics ℓ, m are what the backward pass reads."""
    q, k, v, *args = inputs
    O, l, m = output
    ctx.save_for_backward(q, k, v, O, l, m)
    ctx.options = _options(args)
    ctx.mark_non_differentiable(l, m)


def _flash1_formula(ctx, dO, dl, dm):
    """The traced road's backward: the registered backward operator on the same saved tensors."""
    q, k, v, O, l, m = ctx.saved_tensors
    dQ, dK, dV = torch.ops.fa2edu.flash1_attention_bwd(dO, q, k, v, O, l, m, *ctx.options.values())
    return dQ, dK, dV, None, None, None, None, None


class StandardAttention(torch.autograd.Function):
    """FA1 Alg. 0 forward, Alg. 3 backward. Saves Q, K, V and the N_q × N_k matrix P: the memory FlashAttention
    removes. Cost per (batch, head): HBM reads 3Nd + 2N², writes Nd + 2N² forward. CPU (NumPy) and CUDA
    (kernels_gpu's teaching ``standard_attention`` and ``standard_attention_backward``).

    ``block_sizes`` and ``M`` do not apply (nothing is tiled) and must be None.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_sizes, M, backend=None):
        (q, k, v), args = _prepare(q, k, v, "standard", causal, scale, backend, block_sizes, M)
        O, P = ops.standard_attention_fwd_impl(q, k, v, *args)
        _standard_setup_context(ctx, (q, k, v) + args, (O, P))
        return O

    @staticmethod
    def backward(ctx, dO, *_):
        q, k, v, P = ctx.saved_tensors
        # FA1 Alg. 3: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = τ dS K, dK = τ dSᵀ Q.
        dQ, dK, dV = _differentiable_once(ctx, dO, ops.standard_attention_bwd_impl(dO, q, k, v, P,
                                                                                    *ctx.options.values()))
        return dQ, dK, dV, None, None, None, None, None


class _Standard(StandardAttention):
    """The eager road of standard attention: checked, resolved arguments in the operator's order; returns (O, P)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, backend, block_sizes, M):
        O, P = ops.standard_attention_fwd_impl(q, k, v, causal, scale, backend, block_sizes, M)
        _standard_setup_context(ctx, (q, k, v, causal, scale, backend, block_sizes, M), (O, P))
        return O, P


def _standard_setup_context(ctx, inputs, output):
    """FA1 Alg. 0 line 2: P = softmax(S) was written to HBM, and Alg. 3 reads it back: it is kept alive."""
    q, k, v, *args = inputs
    O, P = output
    ctx.save_for_backward(q, k, v, P)
    ctx.options = _options(args)
    ctx.mark_non_differentiable(P)


def _standard_formula(ctx, dO, dP):
    """The traced road's backward: the registered backward operator on the same saved tensors."""
    q, k, v, P = ctx.saved_tensors
    dQ, dK, dV = torch.ops.fa2edu.standard_attention_bwd(dO, q, k, v, P, *ctx.options.values())
    return dQ, dK, dV, None, None, None, None, None


torch.library.register_autograd("fa2edu::flash_attention_fwd", _flash2_formula, setup_context=_flash2_setup_context)
torch.library.register_autograd("fa2edu::flash1_attention_fwd", _flash1_formula,
                                setup_context=_flash1_setup_context)
torch.library.register_autograd("fa2edu::standard_attention_fwd", _standard_formula,
                                setup_context=_standard_setup_context)
# The backward operators are differentiable only to say that they are not (a double backward on the traced road).
for _name in ("flash_attention_bwd", "flash1_attention_bwd", "standard_attention_bwd"):
    torch.library.register_autograd(f"fa2edu::{_name}", _refuse_double_backward, setup_context=_nothing_to_save)

#: per algorithm: the eager road's Function and the traced road's forward operator, which return the same outputs
_EAGER = {"flash2": _Flash2, "flash1": _Flash1, "standard": _Standard}
_OPERATORS = {"flash2": torch.ops.fa2edu.flash_attention_fwd, "flash1": torch.ops.fa2edu.flash1_attention_fwd,
              "standard": torch.ops.fa2edu.standard_attention_fwd}


# -- the log-sum-exp for return_lse -----------------------------------------------------------------------------------

def _lse_from_l_m(l, m):
    """FA1's statistics as FA2's L = m + log ℓ; +inf where ℓ = 0 (a row that saw no key)."""
    seen = l > 0
    return torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, math.inf))


def _lse_of_scores(q, k, causal: bool, scale: float):
    """L = logsumexp(τ q kᵀ + mask) per row, for the standard algorithm (which keeps P, not L): the N_q × N_k
    scores once more, in PyTorch ops; +inf on fully masked rows."""
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)      # GQA, spelled out (a copy; fine here)
    S = scale * (q @ k.transpose(-1, -2))
    if causal:
        N_q, N_k = q.shape[-2], k.shape[-2]
        visible = torch.ones(N_q, N_k, dtype=torch.bool, device=q.device).tril(N_k - N_q)
        S = S.masked_fill(~visible, -math.inf)
    L = torch.logsumexp(S, dim=-1)
    return torch.where(torch.isneginf(L), torch.full_like(L, math.inf), L).to(ops._stat_dtype(q.dtype))


# -- the public op -----------------------------------------------------------------------------------------------------

def flash_attention(q, k, v, causal: bool = False, scale=None, algorithm: str = "flash2", return_lse: bool = False,
                    *, backend: str | None = None, block_sizes=None, M=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, descale_q=None, descale_k=None, descale_v=None):
    """softmax(τ·q kᵀ [+ causal mask]) v, differentiable, computed by one of the papers' algorithms.

    flash-attn's keywords ``window_size``, ``softcap`` and ``alibi_slopes`` (``flash_attn_func``'s, same meaning)
    run on FlexAttention's machinery (:mod:`fa2edu.flex`: FA2 Alg. 1/2 over the blocks the window leaves, the soft
    cap and the bias as a score_mod, :func:`fa2edu._torch_ops.flash_attn_mods`) — NumPy on CPU float32/float64,
    ``kernels_gpu.flex`` on CUDA float16/bfloat16 (``backend="tensorcore"``) — in flash-attn's order: S = τ·q kᵀ,
    capped ``softcap·tanh(S/softcap)``, masked by the window (and causal), biased
    by ALiBi. With none of them set, flash_attention runs exactly as without them.

    Args:
        q (torch.Tensor): queries, shape (…, H_q, N_q, d), 1 ≤ d ≤ 256. CPU: float32 or float64, finite.
            CUDA: float32 (``kernels_gpu.fast``), float16 or bfloat16 (``kernels_gpu.tensorcore``).
        k (torch.Tensor): keys, shape (…, H_kv, N_k, d), on q's device in q's dtype; H_q must be a multiple of H_kv
            (GQA/MQA).
        v (torch.Tensor): values, shape (…, H_kv, N_k, d_v), 1 ≤ d_v ≤ 256, on q's device in q's dtype.
        causal (bool, optional): bottom-right aligned causal mask (query i sees key j iff j ≤ i + N_k − N_q).
            Default False.
        scale (float, optional): the softmax scale τ. Default None: 1/√d (FA2 footnote 2's 1/d is erratum 7).
        algorithm (str, optional): ``"flash2"`` (FA2 Alg. 1/2, the default), ``"flash1"`` (FA1 Alg. 2/4, CPU only)
            or ``"standard"`` (FA1 Alg. 0/3, which saves P).
        return_lse (bool, optional): also return L = logsumexp(τ q kᵀ + mask) per query row, float32 (float64 for
            float64 inputs), +inf on rows that see no key; not differentiable. Default False.
        backend (str, optional): which kernels run (keyword only): ``"numpy"``, ``"fast"``, ``"tensorcore"``,
            ``"3xtf32"`` (CUDA float32 on tensor cores, three TF32 products each: float32's accuracy) or
            ``"teaching"`` (:data:`BACKENDS`). Default None: the dispatch table :data:`DISPATCH` (the fastest
            measured for the device and dtype; see :func:`choose_backend`).
        block_sizes (tuple of int, optional): ``(B_r, B_c)`` for the tiled algorithms on the ``"numpy"`` and
            ``"teaching"`` backends (keyword only; None with ``"standard"``). Default None: from ``M`` by the
            conventions' rules on the CPU, :func:`kernels_gpu.runtime.default_block_sizes` on the teaching kernels.
        M (int, optional): SRAM size in elements, for the tiled algorithms on the ``"numpy"`` backend only
            (keyword only). Default None: the block sizes of :data:`fa2edu.blocks.DEFAULT_M`. With flash-attn's
            keywords, ``block_sizes`` (or M, by FA2's forward rule) is the BlockMask's block size in both passes;
            on ``backend="tensorcore"`` (CUDA float16/bfloat16) it is the kernels' tile, (64, 64) by default.
        window_size (tuple of int, optional): ``(left, right)``, flash-attn's sliding-window (local) attention
            (keyword only): query i sees the keys j with i + N_k − N_q − left ≤ j ≤ i + N_k − N_q + right
            (bottom-right aligned, as ``causal``); −1 leaves that side unbounded, and so does a side ≥ N_k (as
            flash-attn's kernels normalise it); with ``causal=True`` the window is (left, 0), as in flash-attn. Rows
            that see no key give O = 0, L = +inf. Default (−1, −1): no window.
        softcap (float, optional): flash-attn's soft cap (keyword only): each scaled score S becomes
            softcap·tanh(S/softcap), before the mask and the bias; must be ≥ 0. Default 0.0: off.
        alibi_slopes (torch.Tensor, optional): flash-attn's ALiBi (keyword only): float32 of shape (H_q,) or
            (B, H_q) (q's leading axes (…, H_q) in general), on q's device; adds ``−slope·|i + N_k − N_q − j|`` to the
            score of query i and key j (:func:`fa2edu.flex.symmetric_alibi`); no gradient. Default None: no bias.
        descale_q (torch.Tensor, optional): for ``torch.float8_e4m3fn`` q, k, v (FA3's FP8 forward, keyword
            only): q's float32 descales, one per (batch, head), shape q.shape[:-2], as :func:`quantize_fp8`
            returns them; the attention is that of ``q·descale_q``, ``k·descale_k``, ``v·descale_v``. Default
            None: 1. On CUDA sm_90 the FP8 kernel (``kernels_gpu.hopper.flash_forward_fp8``) runs, on the CPU its
            NumPy emulation (:func:`fa2edu.fp8.flash2_forward_fp8`); O comes back in bfloat16, L in float32.
            Forward only: a backward raises (:data:`fa2edu._torch_ops.FP8_BACKWARD_ERROR`). ``scale`` is τ of the
            dequantised inputs (default 1/√d).
        descale_k (torch.Tensor, optional): k's float32 descales for float8 inputs, shape k.shape[:-2] (keyword
            only). Default None: 1.
        descale_v (torch.Tensor, optional): v's float32 descales for float8 inputs, shape v.shape[:-2] (keyword
            only), folded into O's final rescale. Default None: 1.

    Returns:
        O of shape (…, H_q, N_q, d_v) in the inputs' dtype, with a ``grad_fn`` whose backward runs the matching
        backward algorithm on the saved tensors listed in the module docstring; ``(O, L)`` with ``return_lse``, L
        of shape (…, H_q, N_q).

    Raises:
        TypeError: non-tensors, mixed or unsupported dtypes, a non-bool ``causal``, a ``scale`` that is not a real
            number, ``block_sizes`` that are not a pair of ints (2.5 and True are refused, not truncated), a
            non-int ``M`` — the keywords are checked by ``fa2edu.validation``, as the NumPy API checks them.
        ValueError: bad shapes, devices, algorithm or backend; a non-finite scale, block sizes < 1, M < 4d; on the
            CPU, NaN or inf in q, k or v.
        fa2edu.validation.AttentionOverflowError: on the CPU, finite q and k whose scores τ·q·k would overflow the
            compute dtype (naming q and k), as the NumPy API raises. CUDA tensors' values are not checked (that
            would read them once more and synchronise with the GPU on every call): like SDPA, the kernels return
            what their arithmetic gives.
        RuntimeError: on a double backward (:data:`DOUBLE_BACKWARD_ERROR`).

    With flash-attn's keywords, also: a TypeError for a ``window_size`` that is not a pair of ints, a ``softcap``
    that is not a real number, ``alibi_slopes`` that are not a float32 tensor; a ValueError for window sizes below
    −1, a negative softcap, slopes of the wrong shape, an ``algorithm`` other than ``"flash2"``, a backend other
    than ``"numpy"`` or ``"tensorcore"``, ``M`` on the GPU; a TypeError for CUDA float32 (no FlexAttention kernel
    of float32's accuracy: cast to bfloat16 yourself, or move the tensors to the CPU).
    """
    window, softcap, alibi_slopes, flash_attn_keywords = _check_flash_attn_keywords(window_size, softcap,
                                                                                     alibi_slopes)
    if flash_attn_keywords:
        return _flash_attention_flex(q, k, v, causal, scale, algorithm, return_lse, backend, block_sizes, M,
                                     window, softcap, alibi_slopes)
    if _is_fp8(q, k, v) or not (descale_q is None and descale_k is None and descale_v is None):
        return _flash_attention_fp8(q, k, v, causal, scale, algorithm, return_lse, backend, block_sizes, M,
                                    descale_q, descale_k, descale_v)
    (q, k, v), args = _prepare(q, k, v, algorithm, causal, scale, backend, block_sizes, M)
    # the eager road (the Function, no dispatcher) or the traced one (the registered operator): the same outputs
    outputs = (_EAGER[algorithm].apply if _eager(q, k, v) else _OPERATORS[algorithm])(q, k, v, *args)
    if algorithm == "flash2":
        O, L = outputs
    elif algorithm == "flash1":
        O, l, m = outputs
        L = _lse_from_l_m(l, m) if return_lse else None
    else:
        O, _ = outputs
        L = _lse_of_scores(q.detach(), k.detach(), causal, args[1]) if return_lse else None
    return (O, L) if return_lse else O


# -- float8 inputs: FA3's FP8 forward ---------------------------------------------------------------------------------

def _is_fp8(*xs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn for x in xs)


def _check_fp8_descale(x, name: str, like: torch.Tensor, lead) -> torch.Tensor:
    """A descale: None → ones; else a float32 tensor of shape ``lead`` on ``like``'s device (metadata checks only)."""
    if x is None:
        return torch.ones(tuple(lead), dtype=torch.float32, device=like.device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor (from fa2edu.torch.quantize_fp8) or None, got "
                        f"{type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) != tuple(lead):
        raise ValueError(f"{name} must have shape {tuple(lead)}, one descale per (batch, head) of its tensor "
                         f"(block descales: fa2edu.fp8.flash2_forward_fp8), got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on q's device {like.device}, got {x.device}")
    return x


def _flash_attention_fp8(q, k, v, causal, scale, algorithm, return_lse, backend, block_sizes, M, descale_q,
                         descale_k, descale_v):
    """flash_attention on float8_e4m3fn inputs (the docstring's descale_* entry): checks, then the FP8 operator."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} has dtype {x.dtype}: descale_q, descale_k and descale_v go with float8 inputs, "
                            "and float8 q, k, v must all be torch.float8_e4m3fn (fa2edu.torch.quantize_fp8)")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q on {q.device} and {name} on {x.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if algorithm != "flash2":
        raise ValueError(f"float8 inputs run FA2's forward (FA3's FP8 kernel): algorithm must be 'flash2', got "
                         f"{algorithm!r}")
    if block_sizes is not None or M is not None:
        raise ValueError("block_sizes and M do not apply to float8 inputs (the FP8 kernel and its emulation choose "
                         "their own tiles)")
    _check_shapes(q, k, v)
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v are on device {q.device.type!r}; float8 flash_attention runs on 'cpu' and 'cuda'")
    if backend is None:
        backend = "hopper" if q.device.type == "cuda" else "numpy"
    if backend not in ops.FP8_BACKENDS:
        raise ValueError(f"backend for float8 inputs must be one of {ops.FP8_BACKENDS} or None, got {backend!r}")
    if backend == "numpy" and q.device.type != "cpu":
        raise ValueError("backend='numpy' (fa2edu.fp8's emulation) runs on CPU tensors; on CUDA float8 runs on "
                         "the Hopper kernel")
    if backend == "hopper" and q.device.type == "cpu" and not ops.simulator_enabled():
        raise ValueError("backend='hopper' runs on CUDA tensors (CPU tensors only in numba's CUDA simulator, "
                         "NUMBA_ENABLE_CUDASIM=1)")
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) != (9, 0):
        raise ValueError(f"float8 flash_attention on CUDA needs an sm_90 GPU (H100, H200: FP8 wgmma), and "
                         f"{torch.cuda.get_device_name(q.device)} is not one; dequantise to bfloat16 "
                         "(x8.to(torch.bfloat16) · descale) there, or run on the CPU")
    lead_q, lead_k = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    descales = [_check_fp8_descale(x, n, q, ld) for x, n, ld in ((descale_q, "descale_q", lead_q),
                                                                 (descale_k, "descale_k", lead_k),
                                                                 (descale_v, "descale_v", lead_k))]
    tau = float(check_scale(scale, q.shape[-1]))
    O, L = torch.ops.fa2edu.flash_attention_fp8_fwd(q, k, v, *descales, causal, tau, backend)
    return (O, L) if return_lse else O


def _fp8_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])


def _fp8_formula(ctx, dO, dL):
    """FA3's FP8 attention is forward only: a backward through it is refused, by name."""
    raise RuntimeError(ops.FP8_BACKWARD_ERROR)


torch.library.register_autograd("fa2edu::flash_attention_fp8_fwd", _fp8_formula, setup_context=_fp8_setup_context)


# -- FlexAttention: score_mod and mask_mod as code ---------------------------------------------------------------------
#
# The same two roads as flash_attention's. The mods are Python functions, which an operator cannot take: the eager
# road hands the Function the checked mods (fa2edu._torch_ops.FlexMods) itself; the traced road registers them and
# hands the operators their key, an int (fa2edu._torch_ops, section 4, says how their lifetime is kept).

class _Flex(torch.autograd.Function):
    """The eager road of flex_attention: FlexMods in hand; returns (O, L)."""

    @staticmethod
    def forward(ctx, q, k, v, mods, scale, enable_gqa, backend):
        O, L = ops.flex_forward(q, k, v, mods, scale, enable_gqa, backend)
        ctx.save_for_backward(q, k, v, O, L)
        ctx.mods, ctx.options = mods, (scale, enable_gqa, backend)
        ctx.mark_non_differentiable(L)
        return O, L

    @staticmethod
    def backward(ctx, dO, dL):
        q, k, v, O, L = ctx.saved_tensors
        # FA2 Alg. 2 over the BlockMask, through score_mod's derivative (an error naming score_mod_grad without one)
        grads = ops.flex_backward(dO.contiguous(), q, k, v, O, L, ctx.mods, *ctx.options)
        return (*_differentiable_once(ctx, dO, grads), None, None, None, None)


def _flex_setup_context(ctx, inputs, output):
    """The traced road: what FlexAttention's forward keeps (Q, K, V, O, L, as FA2) and the mods' key. On real
    tensors (torch.jit.trace, a tracer that runs the op) also the mods themselves, so that they live until this
    graph's backward has run; not while torch.compile traces (fake tensors), whose traced graph would keep them
    alive for as long as the compiled code exists (there the forward operator keeps them alive with L, which the
    backward saves: fa2edu._torch_ops.flex_attention_fwd_impl)."""
    q, k, v, key, scale, enable_gqa, backend = inputs
    O, L = output
    ctx.save_for_backward(q, k, v, O, L)
    ctx.key, ctx.options = key, (scale, enable_gqa, backend)
    if type(q) is torch.Tensor:
        ctx.mods = ops.MODS.lookup(key)
    ctx.mark_non_differentiable(L)


def _flex_formula(ctx, dO, dL):
    q, k, v, O, L = ctx.saved_tensors
    dQ, dK, dV = torch.ops.fa2edu.flex_attention_bwd(dO, q, k, v, O, L, ctx.key, *ctx.options)
    return dQ, dK, dV, None, None, None, None


class _FlashFlex(torch.autograd.Function):
    """The eager road of flash_attention with flash-attn's keywords; returns (O, L)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, *args):
        O, L = ops.flash_attention_flex_fwd_impl(q, k, v, alibi_slopes, *args)
        _flash_flex_setup_context(ctx, (q, k, v, alibi_slopes, *args), (O, L))
        return O, L

    @staticmethod
    def backward(ctx, dO, dL):
        q, k, v, O, L, alibi_slopes = ctx.saved_tensors
        grads = ops.flash_attention_flex_bwd_impl(dO, q, k, v, O, L, alibi_slopes, *ctx.options)
        return (*_differentiable_once(ctx, dO, grads), None, None, None, None, None, None, None, None)


def _flash_flex_setup_context(ctx, inputs, output):
    """FA2's saved tensors, and the slopes (no gradient: flash-attn gives none either)."""
    q, k, v, alibi_slopes, *args = inputs
    O, L = output
    ctx.save_for_backward(q, k, v, O, L, alibi_slopes)
    ctx.options = tuple(args)
    ctx.mark_non_differentiable(L)


def _flash_flex_formula(ctx, dO, dL):
    q, k, v, O, L, alibi_slopes = ctx.saved_tensors
    dQ, dK, dV = torch.ops.fa2edu.flash_attention_flex_bwd(dO, q, k, v, O, L, alibi_slopes, *ctx.options)
    return dQ, dK, dV, None, None, None, None, None, None, None, None


torch.library.register_autograd("fa2edu::flex_attention_fwd", _flex_formula, setup_context=_flex_setup_context)
torch.library.register_autograd("fa2edu::flash_attention_flex_fwd", _flash_flex_formula,
                                setup_context=_flash_flex_setup_context)
for _name in ("flex_attention_bwd", "flash_attention_flex_bwd"):
    torch.library.register_autograd(f"fa2edu::{_name}", _refuse_double_backward, setup_context=_nothing_to_save)


def _check_flex_tensors(q, k, v, enable_gqa, backend):
    """q (B, H_q, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v), one device, one dtype; GQA only on request
    (metadata only, as torch.compile needs). Returns the backend (:func:`fa2edu._torch_ops.choose_flex_backend`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__} "
                            "(for NumPy arrays call fa2edu.flex_attention)")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q on {q.device} and {name} on {x.device}")
    backend = ops.choose_flex_backend(q.device.type, q.dtype, backend, what="fa2edu.torch.flex_attention")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"q, k, v must share one dtype, got q {q.dtype} and {name} {x.dtype}")
    for name, x, axes in (("q", q, "(B, H, N_q, d)"), ("k", k, "(B, H_kv, N_k, d)"), ("v", v, "(B, H_kv, N_k, d_v)")):
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 axes {axes}, as torch's flex_attention, got shape {tuple(x.shape)}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must have the same batch size B, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must have the same heads and keys (B, H_kv, N_k), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k's head dimension must equal q's: q has d = {q.shape[3]}, k has {k.shape[3]}")
    H_q, H_kv = q.shape[1], k.shape[1]
    if H_q != H_kv and not enable_gqa:
        raise ValueError(f"q has H = {H_q} heads but k and v have {H_kv}: pass enable_gqa=True for grouped-query "
                         "attention (query head h reads key/value head h // (H_q / H_kv)), or give k and v q's heads")
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"with enable_gqa, q's heads H_q = {H_q} must be a multiple of k's and v's H_kv = {H_kv}")
    if backend == "tensorcore":
        for name, x in (("q", q), ("v", v)):
            if not 1 <= x.shape[-1] <= MAX_HEAD_DIM:
                raise ValueError(f"{name} has head dimension {x.shape[-1]}; on tensor cores flex_attention takes 1 "
                                 f"to {MAX_HEAD_DIM}")
    return backend


def _identity(x):
    """``id(x)``, None for None: read in the caller's code, so that torch.compile guards on each mod's identity."""
    return None if x is None else id(x)


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                   score_mod_grad=None, *, backend=None):
    """FlexAttention, differentiable: softmax(MASK(score_mod(τ·q kᵀ))) v, by fa2edu.flex (CPU) or kernels_gpu.flex
    (CUDA).

    PyTorch's ``torch.nn.attention.flex_attention`` signature, plus ``score_mod_grad`` (and the keyword ``backend``).
    The forward pass is FA2 Alg. 1 over the BlockMask's blocks (skipped blocks never loaded, partial ones masked
    per element, full ones not masked at all), the backward FA2 Alg. 2, which differentiates through score_mod
    with its derivative ``d score_mod / d score``. On the CPU (float32, float64) both are fa2edu.flex in NumPy
    (:func:`fa2edu.flex.flex_attention`, :func:`fa2edu.flex.flex_attention_backward`), computing in float64 for
    float64 tensors and float32 otherwise. On CUDA (float16, bfloat16) both are ``kernels_gpu.flex``'s tensor-core
    kernels (``flex_forward`` on the mma.sync forward, ``flex_backward`` on backward v1), the mods compiled by numba
    as device functions, float32 accumulators; head dimensions up to 256 (zero columns padded inside the op), and a
    BlockMask whose tile the kernels cannot run retiled from its classes (no mask_mod call:
    :func:`fa2edu._torch_ops.retile_block_mask`). Cost: per (batch, head), 4·d·(visited blocks' area) FLOPs forward,
    2.5× that backward; one mask_mod call per score of a partial block, one score_mod call per visited score.

    It is a ``torch.library.custom_op`` (``torch.ops.fa2edu.flex_attention_fwd`` / ``_bwd``) with fake
    implementations and ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces through it. The mods reach
    the operator as an int key (``fa2edu._torch_ops``, section 4): under torch.compile, keep them alive while the
    compiled code runs, its backward pass included (module attributes, say); other mods objects compile again.
    Mods are written as fa2edu.flex takes them: for scalars, with operators, ``math`` or NumPy ufuncs (the ready mods
    of :mod:`fa2edu.flex` are); on CUDA numba must compile them (a clear TypeError naming the mod otherwise: arrays
    a mod indexes are bound with :func:`fa2edu.flex.bind` as NumPy arrays, at most four over all mods).

    Args:
        q (torch.Tensor): queries, shape (B, H_q, N_q, d): CPU float32 or float64, finite; or CUDA float16 or
            bfloat16 (d ≤ 256).
        k (torch.Tensor): keys, shape (B, H_kv, N_k, d), on q's device in q's dtype; H_kv = H_q unless
            ``enable_gqa``.
        v (torch.Tensor): values, shape (B, H_kv, N_k, d_v), on q's device in q's dtype.
        score_mod (callable, optional): ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to each scaled
            score τ·q·k (h is the query head). Default None: the scores unchanged.
        block_mask (BlockMask, optional): ``fa2edu.create_block_mask(mask_mod, B, H, N_q, N_k, BLOCK_SIZE)`` (its B
            and H equal to q's or 1), or a PyTorch BlockMask from ``torch.nn.attention.flex_attention.
            create_block_mask``, converted (its blocks, and its mask_mod evaluated on tensors, as PyTorch does).
            Default None: no mask, every block full (BLOCK_SIZE 128).
        scale (float, optional): the softmax scale τ. Default None: 1/√d.
        enable_gqa (bool, optional): allow H_q ≠ H_kv (a multiple): query head h reads key/value head
            h // (H_q / H_kv), never copied; dK, dV summed over each group. Default False.
        return_lse (bool, optional): also return L, the natural-log log-sum-exp of each row of the modified, masked
            scores, float32 (float64 for float64 inputs); +inf on a row that keeps no score (PyTorch gives −inf
            there); not differentiable. Default False.
        score_mod_grad (callable, optional): ``score_mod_grad(score, b, h, q_idx, kv_idx) -> d score_mod / d score``
            at the scaled score, for the backward pass. Default None: ``score_mod.score_mod_grad`` (every ready
            score_mod carries one); a backward pass through a score_mod with neither raises a ValueError naming
            score_mod_grad. Gradients with respect to arrays a mod binds are not computed.
        backend (str, optional): keyword only: ``"numpy"`` (fa2edu.flex, CPU) or ``"tensorcore"`` (kernels_gpu.flex,
            CUDA; CPU tensors in numba's CUDA simulator, how the tests run it). Default None:
            :data:`fa2edu._torch_ops.FLEX_DISPATCH` for the device and dtype.

    Returns:
        O of shape (B, H_q, N_q, d_v) in q's dtype (0 on a row that keeps no score, with zero gradients), with a
        ``grad_fn``; ``(O, L)`` with ``return_lse``, L of shape (B, H_q, N_q).

    Raises:
        TypeError: non-tensors, mixed or unsupported dtypes, mods that are not callable, a block_mask that is not
            a BlockMask, non-bool ``enable_gqa`` or ``return_lse``.
        TypeError (CUDA): float32 tensors (:data:`fa2edu._torch_ops.FLEX_FLOAT32_CUDA_ERROR`), a mod numba cannot
            compile.
        ValueError: a backend that does not run on the tensors' device, shapes that do not fit (4 axes, GQA, a
            block_mask made for other lengths), a score_mod returning NaN or +inf for a kept score,
            NaN or inf in q, k or v, ``score_mod_grad`` without ``score_mod``, and, in the backward pass, a
            score_mod without a derivative.
        RuntimeError: on a double backward (:data:`DOUBLE_BACKWARD_ERROR`).
    """
    backend = _check_flex_tensors(q, k, v, enable_gqa, backend)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scale = float(check_scale(scale, q.shape[-1]))
    if _eager(q, k, v):
        O, L = _Flex.apply(q, k, v, ops.flex_mods(score_mod, block_mask, score_mod_grad), scale, enable_gqa,
                           backend)
    else:
        identities = (_identity(score_mod), _identity(score_mod_grad), _identity(block_mask))
        key = ops.register_mods(score_mod, score_mod_grad, block_mask, identities)
        O, L = torch.ops.fa2edu.flex_attention_fwd(q, k, v, key, scale, enable_gqa, backend)
    return (O, L) if return_lse else O


# -- flash-attn's keywords on flash_attention -------------------------------------------------------------------------

def _check_flash_attn_keywords(window_size, softcap, alibi_slopes):
    """window_size a pair of ints ≥ −1, softcap a real number ≥ 0, alibi_slopes a tensor or None; returns them
    normalised ((left, right), float softcap, slopes) and whether any of them asks for something."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or any(
            isinstance(w, bool) or not isinstance(w, Integral) for w in window_size):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for no bound (flash-attn's "
                        f"convention), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size must hold -1 (no bound) or sizes >= 0, got {tuple(window_size)}")
    if isinstance(softcap, bool) or not isinstance(softcap, Real):
        raise TypeError(f"softcap must be a real number (0 = off), got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor of shape (H,) or (B, H), or None; got "
                        f"{type(alibi_slopes).__name__}")
    wanted = (left, right) != (-1, -1) or softcap > 0 or alibi_slopes is not None
    return (left, right), float(softcap), alibi_slopes, wanted


def _check_alibi_slopes(alibi_slopes, q) -> None:
    """flash-attn's rule: float32, shape (H_q,) or (B, H_q) — here (H_q,) or q's leading axes (…, H_q) — on q's
    device."""
    H_q = q.shape[-3] if q.dim() >= 3 else 1
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype torch.float32 (as flash-attn's), got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device {q.device}, got {alibi_slopes.device}")
    shapes = {(H_q,), tuple(q.shape[:-2])}
    if tuple(alibi_slopes.shape) not in shapes:
        raise ValueError(f"alibi_slopes must have shape (H,) = ({H_q},) or (B, H) = {tuple(q.shape[:-2])} (one slope "
                         f"per query head, or per batch entry and head), got {tuple(alibi_slopes.shape)}")


def _flash_attention_flex(q, k, v, causal, scale, algorithm, return_lse, backend, block_sizes, M, window, softcap,
                          alibi_slopes):
    """flash_attention with flash-attn's keywords, on FlexAttention's machinery: fa2edu.flex on the CPU (float32,
    float64), kernels_gpu.flex on CUDA (float16, bfloat16; :func:`fa2edu._torch_ops.choose_flex_backend`)."""
    what = "flash_attention with window_size, softcap or alibi_slopes"
    if algorithm != "flash2":
        raise ValueError(f"window_size, softcap and alibi_slopes run on FlexAttention's FA2 loops (fa2edu.flex): "
                         f"algorithm must be 'flash2', got {algorithm!r}")
    if backend not in (None, *ops.FLEX_BACKENDS):
        raise ValueError(f"{what} runs on the {' or '.join(map(repr, ops.FLEX_BACKENDS))} backend (FlexAttention: "
                         f"fa2edu.flex, kernels_gpu.flex), got backend={backend!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    q, k, v = _check_tensors(q, k, v, algorithm)
    backend = ops.choose_flex_backend(q.device.type, q.dtype, backend, what=what)
    _check_shapes(q, k, v)
    if alibi_slopes is not None:
        _check_alibi_slopes(alibi_slopes, q)
    scale = float(check_scale(scale, q.shape[-1]))
    if M is not None:
        if backend != "numpy":
            raise ValueError(f"M (the simulated SRAM size) applies to the NumPy backend; backend {backend!r} runs "
                             f"on a GPU: block_sizes=(B_r, B_c) sets the window's BlockMask there")
        M = check_M(M, q.shape[-1])
    if block_sizes is not None:
        block_sizes = check_block_sizes(block_sizes)
    if backend == "numpy":
        # one BLOCK_SIZE for both passes: the FA2 forward's rule (docs/conventions.md) unless given
        sizes = list(resolve_block_sizes(M, block_sizes, q.shape[-1], block_sizes_q_outer))
    else:
        # the tensor-core kernels' tile, (64, 64) unless given (a tile they cannot run is retiled inside the op)
        sizes = list(block_sizes) if block_sizes is not None else [64, 64]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    args = (alibi_slopes, causal, window[0], window[1], softcap, scale, sizes, backend)
    if _eager(q, k, v):
        O, L = _FlashFlex.apply(q, k, v, *args)
    else:
        O, L = torch.ops.fa2edu.flash_attention_flex_fwd(q, k, v, *args)
    return (O, L) if return_lse else O


# -- FP8 inputs (FA3 Section 3.3) -----------------------------------------------------------------------------------

def quantize_fp8(x, incoherent: bool = True, block=None, seed: int = 0):
    """FA3's FP8 quantisation of a PyTorch tensor: ``(x8, descale)`` with x8 ``torch.float8_e4m3fn`` on x's device
    and ``x ≈ x8.float() · descale`` (after the rotation, with ``incoherent``).

    The same three steps as :func:`fa2edu.fp8.quantize_fp8` (the NumPy reference, which defaults to
    ``incoherent=False``; this one follows DESIGN.md's ``quantize_fp8(x, incoherent=True)``):

    1. with ``incoherent``, ``x ← x·M``, M = D·H/√d the random orthogonal matrix of
       :func:`fa2edu.fp8.rotation_matrix` (``seed`` picks D's signs: Q and K must share it, V is never rotated),
       as one float32 matrix product on x's device;
    2. ``descale = amax(|x|) / 448`` per (batch, head) — the last two axes — or per ``block`` rows of them,
       float32 (1 where x is all zero);
    3. ``x8 = (x / descale)`` cast to float8 e4m3, which rounds to nearest even and saturates at ±448.

    The quotient x / descale is formed in float32, as a kernel forms it, then rounded once to float8; the NumPy
    reference divides in float64. The codes therefore agree except where the float32 quotient lands on the other
    side of a rounding tie — about one element in a million, one code apart.

    Parameters
    ----------
    x : torch.Tensor, shape (..., N, d)
        float16, bfloat16 or float32, finite, at least two axes; any device.
    incoherent : bool, default True
        Rotate the last axis first; d must then be a power of two.
    block : int, optional
        Rows (along N) per scale; default None: one scale per (batch, head).
    seed : int, default 0
        Seed of the rotation's signs.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        x8 (x's shape, float8_e4m3fn) and descale (float32: x's shape without its last two axes, or with
        ⌈N / block⌉ in their place).
    """
    from fa2edu import fp8

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 2 or 0 in x.shape:
        raise ValueError(f"x must have shape (..., N, d) with at least 2 axes and no empty axis, got {tuple(x.shape)}")
    if not isinstance(incoherent, bool):
        raise TypeError(f"incoherent must be a bool, got {type(incoherent).__name__}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive int or None, got {block!r}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or infinite values; FP8 quantisation needs finite inputs (its scale is the "
                         "largest |x|)")
    xf = x.float()
    if incoherent:
        M = torch.from_numpy(fp8.rotation_matrix(x.shape[-1], seed)).to(device=x.device, dtype=torch.float32)
        xf = xf @ M
    row_amax = xf.abs().amax(dim=-1)                                    # (..., N)
    if block is None:
        amax = row_amax.amax(dim=-1)
        rows = amax[..., None, None]
    else:
        N = x.shape[-2]
        pad = -N % block
        padded = torch.nn.functional.pad(row_amax, (0, pad))
        amax = padded.unflatten(-1, (-1, block)).amax(dim=-1)           # (..., ⌈N / block⌉)
        rows = amax.repeat_interleave(block, dim=-1)[..., :N, None]
    descale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    scale_rows = torch.where(rows > 0, rows / 448.0, torch.ones_like(rows))
    x8 = (xf / scale_rows).to(torch.float8_e4m3fn)                   # in float32, as a kernel would
    return x8, descale
