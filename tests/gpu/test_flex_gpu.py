"""FlexAttention on a real GPU: ``fa2edu.torch.flex_attention`` and flash_attention's flash-attn keywords through
``kernels_gpu.flex`` (the mods compiled by numba into the mma.sync forward and backward).

Run on the device from the repository root (``benchmarks/flex_device_run.sh`` does, with the harness)::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_flex_gpu.py -q -p no:cacheprovider

Checks, for float16 and bfloat16, every ready mod of :mod:`fa2edu.flex` (causal, sliding_window, prefix_lm,
document, alibi, softcap, relative_bias), O, L and dQ, dK, dV: flash-attn's rule against a float64 oracle computed
on the GPU by definition (the mask and the score applied elementwise, autograd for the gradients) — the error at
most 2× the error of PyTorch's own attention in the same dtype with the same mask or bias given explicitly (SDPA
with a boolean mask or an additive bias; eager attention for softcap, which no mask expresses), plus a small
floor. GQA, ragged N (N_q ≠ N_k, neither a multiple of the tile), fully masked rows (O = 0, L = +inf, dQ = 0),
PyTorch's default BLOCK_SIZE = 128 and the kernels' (64, 64). Outputs are poisoned (NaN patterns) before every
launch, so an element the kernel never writes fails. Then against ``torch.nn.attention.flex_attention`` compiled
with ``torch.compile`` where this torch has it: our error at most 2× its error (plus the floor), with fa2edu's
BlockMask and with PyTorch's own (converted; its mask_mod compiled by numba). CUDA float32 is refused with the
documented error; ``torch.compile(fullgraph=True)`` traces the op on CUDA.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")]

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tolerances import assert_close_to_oracle  # noqa: E402

import fa2edu  # noqa: E402
import kernels_gpu.runtime as rt  # noqa: E402
from fa2edu import flex  # noqa: E402
from fa2edu.torch import flash_attention, flex_attention  # noqa: E402

F = torch.nn.functional
CUDA = "cuda"
F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64
INF = math.inf


@pytest.fixture(autouse=True)
def poisoned_outputs_and_true_baselines(monkeypatch):
    """Every kernel output starts as NaN patterns; TF32 off and 16-bit reductions allowed in SDPA's math backend, so
    that each baseline computes in the dtype it is the baseline of (tests/gpu/test_torch_gpu.py says why)."""
    monkeypatch.setattr(rt, "poison_outputs", True)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved[0]
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(saved[1])


def draw(q_shape, k_shape, dtype, seed=0):
    """q, k, v, dO drawn in float64 on the CPU (the same numbers for both dtypes), moved and rounded."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (q_shape, k_shape, k_shape, q_shape)
    return [torch.randn(s, generator=generator, dtype=F64).to(device=CUDA, dtype=dtype) for s in shapes]


def grid(B, H, N_q, N_k):
    """Index tensors b, h, i, j broadcasting to (B, H, N_q, N_k) on the GPU."""
    ar = lambda n: torch.arange(n, device=CUDA)            # noqa: E731
    return ar(B).view(B, 1, 1, 1), ar(H).view(1, H, 1, 1), ar(N_q).view(1, 1, N_q, 1), ar(N_k).view(1, 1, 1, N_k)


def dense(q, k, v, keep=None, score=None):
    """softmax(MASK(score(τ q kᵀ))) v by definition, in q's dtype for the matrix products (float64 for the oracle,
    the scores and softmax in float32 otherwise), GQA by repetition; rows that keep nothing give O = 0."""
    G = q.shape[-3] // k.shape[-3]
    K, V = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    work = F64 if q.dtype == F64 else torch.float32
    S = (q @ K.transpose(-1, -2)).to(work) / math.sqrt(q.shape[-1])
    b, h, i, j = grid(*S.shape)
    if score is not None:
        S = score(S, b, h, i, j).to(work)
    if keep is not None:
        S = S.masked_fill(~keep(b, h, i, j), -INF)
    P = torch.nan_to_num(torch.softmax(S, dim=-1)).to(q.dtype)
    return P @ V


def lse(q, k, keep=None, score=None):
    """L in float64, +inf on rows that keep no score."""
    G = q.shape[-3] // k.shape[-3]
    S = (q.double() @ k.double().repeat_interleave(G, dim=-3).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    b, h, i, j = grid(*S.shape)
    if score is not None:
        S = score(S, b, h, i, j)
    if keep is not None:
        S = S.masked_fill(~keep(b, h, i, j), -INF)
    L = torch.logsumexp(S, -1)
    return torch.where(torch.isneginf(L), torch.full_like(L, INF), L)


def sdpa(keep=None, bias=None):
    """PyTorch's SDPA with the mask as a boolean attn_mask, or the score_mod as an additive bias (GQA on)."""
    def attention(q, k, v):
        b, h, i, j = grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask = None
        if keep is not None:
            mask = keep(b, h, i, j).expand(q.shape[0], q.shape[1], -1, -1)
        if bias is not None:
            add = bias(b, h, i, j).to(q.dtype).expand(q.shape[0], q.shape[1], -1, -1)
            mask = add if mask is None else add.masked_fill(~mask, -INF)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return torch.nan_to_num(out)          # SDPA gives NaN on rows that keep nothing; the convention is 0
    return attention


def with_grads(attention, q, k, v, dO):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v)
    O = out[0] if isinstance(out, tuple) else out
    O.backward(dO)
    return [O.detach(), q.grad, k.grad, v.grad]


def assert_rule(ours, oracle, baseline, label, floor=1e-5):
    """(O, dQ, dK, dV) within 2 × baseline's error against the oracle, plus the floor (tests/tolerances.py)."""
    for name, x, ref, low in zip(("O", "dQ", "dK", "dV"), ours, oracle, baseline):
        assert x.device.type == "cuda" and x.shape == ref.shape, f"{label} {name}"
        expected = ref.double().cpu().numpy()
        finite = np.isfinite(expected)
        error = float(np.max(np.abs(low.double().cpu().numpy() - expected)[finite], initial=0.0))
        assert_close_to_oracle(x.double().cpu().numpy(), expected, f"{label} {name}", dtype=np.float16,
                               baseline=error, floor=floor)


# -- every ready mod: (q shape, k shape, mask_mod, keep on index tensors, score_mod, score on tensors, bias for SDPA)

def _docs(n, seed):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, n), 4, replace=False))
    return np.repeat(np.arange(5), np.diff(np.concatenate([[0], cuts, [n]])))


DOCS = _docs(512, 3)
DOCS_T = torch.from_numpy(DOCS).to(CUDA) if torch.cuda.is_available() else None
SLOPES = flex.alibi_slopes(8)
SLOPES_T = torch.from_numpy(SLOPES).to(CUDA) if torch.cuda.is_available() else None
TABLE = np.linspace(-2.0, 2.0, 65)
TABLE_T = torch.from_numpy(TABLE).to(CUDA) if torch.cuda.is_available() else None

MODS = {
    # N_q > N_k, bottom-right: the first 43 queries see no key (whole row blocks skipped); GQA 8:2
    "causal": ((2, 8, 300, 64), (2, 2, 257, 64), flex.causal, lambda b, h, i, j: j <= i - 43, None, None, None),
    "sliding_window": ((1, 4, 1000, 128), (1, 4, 1000, 128), flex.sliding_window(128),
                       lambda b, h, i, j: (j <= i) & (j > i - 128), None, None, None),
    "prefix_lm": ((2, 4, 333, 64), (2, 4, 333, 64), flex.prefix_lm(100), lambda b, h, i, j: (j < 100) | (j <= i),
                  None, None, None),
    "document": ((1, 4, 512, 64), (1, 2, 512, 64), flex.document(DOCS),
                 lambda b, h, i, j: DOCS_T[i] == DOCS_T[j], None, None, None),
    "alibi": ((1, 8, 257, 128), (1, 8, 257, 128), flex.causal, lambda b, h, i, j: j <= i, flex.alibi(SLOPES),
              lambda S, b, h, i, j: S + SLOPES_T[h] * (j - i), lambda b, h, i, j: SLOPES_T[h] * (j - i)),
    "softcap": ((2, 4, 200, 64), (2, 4, 311, 64), None, None, flex.softcap(2.0),
                lambda S, b, h, i, j: 2.0 * torch.tanh(S / 2.0), None),
    "relative_bias": ((1, 4, 300, 64), (1, 4, 300, 64), flex.sliding_window(96), lambda b, h, i, j: (j <= i) & (
        j > i - 96), flex.relative_bias(TABLE), lambda S, b, h, i, j: S + TABLE_T[(j - i + 32).clamp(0, 64)],
        lambda b, h, i, j: TABLE_T[(j - i + 32).clamp(0, 64)]),
}


def baseline_for(name):
    """PyTorch's own attention in the same dtype with the same mask or bias: SDPA (boolean mask, additive bias),
    eager attention for softcap."""
    _, _, _, keep, _, score, bias = MODS[name]
    if name == "softcap":
        return lambda q, k, v: dense(q, k, v, keep, score)
    return sdpa(keep, bias)


#: every mod in both dtypes at PyTorch's BLOCK_SIZE = 128; two of them also at the kernels' own (64, 64) tile (each
#: tile and mod is a kernel numba compiles on first use: seconds each)
CASES = [(name, dtype, 128) for name in MODS for dtype in (F16, BF16)] + [
    ("causal", BF16, (64, 64)), ("alibi", F16, (64, 64))]


@pytest.mark.parametrize("name, dtype, block_size", CASES, ids=[f"{n}-{str(t)[6:]}-{b}" for n, t, b in CASES])
def test_every_ready_mod_forward_and_gradients(name, dtype, block_size):
    q_shape, k_shape, mask_mod, keep, score_mod, score, _ = MODS[name]
    q, k, v, dO = draw(q_shape, k_shape, dtype, seed=len(name))
    bm = None if mask_mod is None else fa2edu.create_block_mask(mask_mod, None, None, q_shape[2], k_shape[2],
                                                                BLOCK_SIZE=block_size)
    gqa = q_shape[1] != k_shape[1]
    ours = with_grads(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                                     return_lse=True), q, k, v, dO)
    O, L = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    assert O.dtype == dtype and L.dtype == torch.float32 and all(g.dtype == dtype for g in ours[1:])
    oracle = with_grads(lambda q, k, v: dense(q, k, v, keep, score), *(x.double() for x in (q, k, v, dO)))
    assert_rule(ours, oracle, with_grads(baseline_for(name), q, k, v, dO), f"{name} {dtype}")
    L_ref = lse(q, k, keep, score)
    assert torch.equal(torch.isposinf(L), torch.isposinf(L_ref)), "L = +inf exactly on the rows that keep no score"
    finite = torch.isfinite(L_ref)
    torch.testing.assert_close(L[finite].double(), L_ref[finite], rtol=1e-4, atol=1e-4)
    if name == "causal":                     # fully masked rows: O = 0, L = +inf, dQ = 0, never NaN
        assert torch.isposinf(L[..., :43]).all() and (O[..., :43, :] == 0).all() and (ours[1][..., :43, :] == 0).all()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_flash_attn_keywords_on_cuda(dtype):
    """window_size, softcap and alibi_slopes together, GQA, N_q ≠ N_k, against flash-attn's definition in float64
    (cap, then window, then −slope·|i + N_k − N_q − j|) and eager attention in the same dtype."""
    q, k, v, dO = draw((2, 8, 190, 64), (2, 4, 230, 64), dtype, seed=5)
    slopes = torch.rand(8, generator=torch.Generator().manual_seed(6)).to(CUDA)
    off = 230 - 190

    def keep(b, h, i, j):
        return (j >= i + off - 50) & (j <= i + off + 7)

    def score(S, b, h, i, j):
        return 4.0 * torch.tanh(S / 4.0) - slopes.to(S.dtype)[h] * (i + off - j).abs()
    ours = with_grads(lambda q, k, v: flash_attention(q, k, v, window_size=(50, 7), softcap=4.0, alibi_slopes=slopes),
                      q, k, v, dO)
    oracle = with_grads(lambda q, k, v: dense(q, k, v, keep, score), *(x.double() for x in (q, k, v, dO)))
    assert_rule(ours, oracle, with_grads(lambda q, k, v: dense(q, k, v, keep, score), q, k, v, dO), "keywords")


def _torch_flex():
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError as error:                                             # pragma: no cover (older torch)
        pytest.skip(f"this torch has no torch.nn.attention.flex_attention: {error}")
    return module


#: PyTorch's mods for the same functions (top-left is bottom-right here: N_q = N_k), keyed as MODS
TORCH_MODS = {
    "causal": (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None),
    "sliding_window": (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 256), None),
    "document": (lambda b, h, q_idx, kv_idx: DOCS_T[q_idx] == DOCS_T[kv_idx], None),
    "alibi": (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
              lambda score, b, h, q_idx, kv_idx: score + SLOPES_T[h].to(score.dtype) * (kv_idx - q_idx)),
    "softcap": (None, lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0)),
}
FA2EDU_MODS = {"causal": (flex.causal, None), "sliding_window": (flex.sliding_window(256), None),
               "document": (flex.document(DOCS), None), "alibi": (flex.causal, flex.alibi(SLOPES)),
               "softcap": (None, flex.softcap(20.0))}


@pytest.mark.parametrize("block_mask_of", ["fa2edu", "pytorch"])
@pytest.mark.parametrize("name", list(TORCH_MODS))
def test_against_pytorchs_compiled_flex_attention(name, block_mask_of):
    """bfloat16, (B, H, N, d) = (1, 8, 512, 64): our O and gradients within 2× the error of PyTorch's compiled
    FlexAttention against the float64 oracle (plus the floor); with PyTorch's own BlockMask (converted, its
    mask_mod compiled by numba) as well as fa2edu's."""
    tf = _torch_flex()
    torch_mask, torch_score = TORCH_MODS[name]
    mask_mod, score_mod = FA2EDU_MODS[name]
    N = 512
    q, k, v, dO = draw((1, 8, N, 64), (1, 8, N, 64), BF16, seed=7)
    torch_bm = None if torch_mask is None else tf.create_block_mask(torch_mask, None, None, N, N, device=CUDA)
    compiled = torch.compile(tf.flex_attention)
    theirs = with_grads(lambda q, k, v: compiled(q, k, v, score_mod=torch_score, block_mask=torch_bm), q, k, v, dO)
    if block_mask_of == "pytorch":
        bm = torch_bm
        if name == "document":
            # PyTorch's mask_mod indexes a CUDA tensor, which numba cannot compile into the kernel: a clear error
            # naming the mod (fa2edu's document() binds a NumPy array instead)
            with pytest.raises(TypeError, match="cannot be compiled for the GPU"):
                flex_attention(q, k, v, block_mask=bm)
            return
    else:
        bm = None if mask_mod is None else fa2edu.create_block_mask(mask_mod, None, None, N, N)
    ours = with_grads(lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=bm), q, k, v, dO)
    b, h, i, j = grid(1, 8, N, N)
    keep = None if torch_mask is None else (lambda b, h, i, j: torch_mask(b, h, i, j))
    score = None if torch_score is None else (lambda S, b, h, i, j: torch_score(S, b, h, i, j))
    oracle = with_grads(lambda q, k, v: dense(q, k, v, keep, score), *(x.double() for x in (q, k, v, dO)))
    assert_rule(ours, oracle, theirs, f"{name} vs compiled FlexAttention")


def test_cuda_float32_is_refused_and_compile_traces_on_cuda():
    q = torch.randn(1, 2, 64, 64, device=CUDA)
    with pytest.raises(TypeError, match="Cast q, k, v to torch.bfloat16"):
        flex_attention(q, q, q)
    q, k, v, dO = draw((1, 4, 200, 64), (1, 4, 200, 64), BF16, seed=9)
    bm = fa2edu.create_block_mask(flex.sliding_window(64), None, None, 200, 200, BLOCK_SIZE=64)
    capped = flex.softcap(5.0)

    def layer(q, k, v):
        return flex_attention(q, k, v, score_mod=capped, block_mask=bm) + flash_attention(q, k, v, softcap=5.0,
                                                                                            window_size=(63, 0))
    eager = with_grads(layer, q, k, v, dO)
    compiled = with_grads(torch.compile(layer, fullgraph=True), q, k, v, dO)
    assert torch.equal(eager[0], compiled[0])                     # the forward kernels are deterministic
    for a, b in zip(eager[1:], compiled[1:]):                     # dQ by atomic adds: the order may differ
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
