"""What the harness times, and the float64 reference every implementation is checked against first.

Each implementation is a *builder*: ``build(pass_, x, causal, scale, options)`` takes one input set ``x`` (a dict of
float32 CUDA tensors ``Q, K, V, dO`` of shape (batch, heads, N, d)), does the untimed set-up (dtype casts; for a
backward pass, the forward whose saved state it needs), and returns a function of no arguments that runs the
timed pass once and returns its outputs as a dict (``O`` and ``L``, or FA1's ``l, m``; or ``dQ, dK, dV``).

| name           | what                                                                               | dtype   |
| -------------- | ---------------------------------------------------------------------------------- | ------- |
| kg_standard    | kernels_gpu standard attention (FA1 Alg. 0/3): S and P materialised in global memory | float32 |
| kg_flash1      | kernels_gpu FA1 forward (FA1 Alg. 1): K/V-outer loop, O/ℓ/m round-trip through HBM  | float32 |
| kg_flash2      | kernels_gpu FA2 forward and backward (FA2 Alg. 1/2), dQ accumulated with atomics   | float32 |
| kg_flash2_det  | kernels_gpu FA2 backward, deterministic dQ (backward only; not in the default set) | float32 |
| kg_flash2_fast | kernels_gpu.fast FA2: forward v6, backward v1 (register-tiled, pipelined loads)     | float32 |
| kg_flash2_fast_fp16 | the same kernels with fp16 storage, fp32 arithmetic (not in the default set) | float16 |
| kg_flash2_v3   | kernels_gpu.fast FA2 forward v3 (forward only; not in the default set)             | float32 |
| torch_eager    | PyTorch eager: matmul, softmax, matmul; autograd for the backward                  | float32 |
| sdpa_math      | PyTorch SDPA, math backend                                                         | float32 |
| sdpa_efficient | PyTorch SDPA, memory-efficient backend                                             | float32 |
| sdpa_flash     | PyTorch SDPA, flash backend (needs fp16/bf16: inputs cast to fp16)                 | float16 |

The PyTorch forward passes run as in training (inputs require grad), as the FA2 paper times them; TF32 is off
(``bench_attention`` sets it), so every float32 row is true fp32 arithmetic on CUDA cores.
torch and kernels_gpu are imported inside the functions: this module imports on a machine without a GPU.

The harness is layered one way: implementations (this module, the bottom: it imports nothing else of
``benchmarks``) ← ``timing`` (how one configuration is measured, the CUDA set-up, the record of a run) ← the
drivers (``bench_attention``, ``fast_kernels``, ``fast_backward``, ``fp16_check``, ``gpt_speed`` …).
"""

import math

# The relative error ‖out − ref‖_F / ‖ref‖_F allowed against the float64 reference (GPU.md's method: float32
# lands far under 1e-3; fp16 operands between 1e-3 and 1e-2; backward errors compound, hence the larger bound).
TOLERANCE = {("float32", "forward"): 1e-3, ("float32", "backward"): 1e-3,
             ("float16", "forward"): 1e-2, ("float16", "backward"): 3e-2}


class ImplSpec:
    """One implementation: its name, family (kernels_gpu or torch), dtype, passes and builder."""

    def __init__(self, name, family, dtype, passes, build, description, default=True):
        self.name, self.family, self.dtype, self.passes = name, family, dtype, tuple(passes)
        self.build, self.description, self.default = build, description, default

    def __repr__(self):
        return f"ImplSpec({self.name!r}, {self.dtype}, passes={self.passes})"


# ---------------------------------------------------------------------------------------------- kernels_gpu

def _kg():
    import kernels_gpu
    return kernels_gpu


def _kg_standard(pass_, x, causal, scale, options):
    kg = _kg()
    Q, K, V = x["Q"], x["K"], x["V"]
    if pass_ == "forward":
        def forward():
            # FA1 Alg. 0: S = τQKᵀ and P = softmax(S) written to HBM, then O = PV
            result = kg.standard_attention(Q, K, V, causal=causal, scale=scale)
            return {"O": result[0]}
        return forward
    # untimed: the forward pass leaves P (N × N per head) in HBM for FA1 Alg. 3
    P = kg.standard_attention(Q, K, V, causal=causal, scale=scale)[1]
    dO = x["dO"]

    def backward():
        dQ, dK, dV = kg.standard_attention_backward(Q, K, V, P, dO, causal=causal, scale=scale)[:3]
        return {"dQ": dQ, "dK": dK, "dV": dV}
    return backward


def _kg_flash1(pass_, x, causal, scale, options):
    kg = _kg()
    Q, K, V = x["Q"], x["K"], x["V"]
    block_sizes = options.get("block_sizes")

    def forward():
        O, l, m = kg.flash1_forward(Q, K, V, block_sizes=block_sizes, causal=causal, scale=scale)[:3]
        return {"O": O, "l": l, "m": m}
    return forward


def _kg_flash2(pass_, x, causal, scale, options, deterministic=False):
    kg = _kg()
    Q, K, V = x["Q"], x["K"], x["V"]
    block_sizes = options.get("block_sizes")
    if pass_ == "forward":
        def forward():
            O, L = kg.flash2_forward(Q, K, V, block_sizes=block_sizes, causal=causal, scale=scale)[:2]
            return {"O": O, "L": L}
        return forward
    # untimed: FA2 Alg. 1 saves O and the log-sum-exp L for the backward pass
    O, L = kg.flash2_forward(Q, K, V, block_sizes=block_sizes, causal=causal, scale=scale)[:2]
    dO = x["dO"]

    def backward():
        dQ, dK, dV = kg.flash2_backward(Q, K, V, O, L, dO, block_sizes=block_sizes, causal=causal, scale=scale,
                                        deterministic=deterministic)[:3]
        return {"dQ": dQ, "dK": dK, "dV": dV}
    return backward


def _kg_flash2_det(pass_, x, causal, scale, options):
    return _kg_flash2(pass_, x, causal, scale, options, deterministic=True)


#: the fast versions timed as ``kg_flash2_fast`` (kernels_gpu.fast: the fastest measured forward, per head
#: dimension — d ≤ 64 the first entry, else the second — and backward): v8's stream-K pays at d = 128 (one block
#: per SM) and not at d = 64 (``fast_v8e_explore_d64.json``)
FAST_FORWARD, FAST_BACKWARD = {64: "v6", 128: "v8"}, "v4"
#: the fast versions timed as ``kg_flash2_fast_fp16``: the fastest ones that take ``storage="float16"``
FP16_FORWARD, FP16_BACKWARD = "v6", "v1"


def _kg_flash2_fast(pass_, x, causal, scale, options, storage="float32", versions=None):
    """The fast forward and backward (``versions``: their names, default ``FAST_FORWARD, FAST_BACKWARD``), with
    Q, K, V (and dO) stored as ``storage``: float16 inputs are the harness's float32 values cast once, untimed (as
    ``sdpa_flash``'s are); the kernels then read float16, compute in float32 and write float16 (L float32)."""
    from kernels_gpu.fast import BACKWARD_VERSIONS, VERSIONS
    forward_name, backward_name = versions or (FAST_FORWARD, FAST_BACKWARD)
    if isinstance(forward_name, dict):                  # one version per head dimension
        forward_name = forward_name[64 if x["Q"].shape[-1] <= 64 else 128]
    forward, backward = VERSIONS[forward_name], BACKWARD_VERSIONS[backward_name]
    stored = {} if storage == "float32" else {"storage": storage}    # versions without the option still run fp32
    Q, K, V, dO = (x.get(name) for name in ("Q", "K", "V", "dO"))
    if storage == "float16":
        Q, K, V, dO = (None if t is None else t.half() for t in (Q, K, V, dO))
    if pass_ == "forward":
        def call_forward():
            O, L = forward(Q, K, V, causal=causal, scale=scale, **stored)   # FA2 Alg. 1, the default tiling
            return {"O": O, "L": L}
        return call_forward
    # untimed: the fast forward saves O and L for FA2 Alg. 2
    O, L = forward(Q, K, V, causal=causal, scale=scale, **stored)

    def call_backward():
        dQ, dK, dV = backward(Q, K, V, O, L, dO, causal=causal, scale=scale, **stored)
        return {"dQ": dQ, "dK": dK, "dV": dV}
    return call_backward


def _kg_flash2_fast_fp16(pass_, x, causal, scale, options):
    return _kg_flash2_fast(pass_, x, causal, scale, options, storage="float16",
                           versions=(FP16_FORWARD, FP16_BACKWARD))


# ---------------------------------------------------------------------------------------------- PyTorch

def _leaves(x, dtype):
    """Q, K, V as fresh leaf tensors of ``dtype`` that require grad, and dO in that dtype."""
    import torch
    dtype = getattr(torch, dtype)
    Q, K, V = (x[name].to(dtype).detach().requires_grad_(True) for name in ("Q", "K", "V"))
    return Q, K, V, x["dO"].to(dtype)


def _autograd_builder(attention, dtype):
    """A builder for an attention function ``attention(Q, K, V, causal, scale)``, forward or backward."""
    def build(pass_, x, causal, scale, options):
        import torch
        Q, K, V, dO = _leaves(x, dtype)
        if pass_ == "forward":
            dO = None

            def forward():
                return {"O": attention(Q, K, V, causal, scale)}
            return forward
        # untimed: the forward builds the autograd graph (eager and math keep P, N × N per head)
        O = attention(Q, K, V, causal, scale)

        def backward():
            dQ, dK, dV = torch.autograd.grad(O, (Q, K, V), dO, retain_graph=True)
            return {"dQ": dQ, "dK": dK, "dV": dV}
        return backward
    return build


_causal_masks = {}


def _causal_mask(N, device):
    """Boolean (N, N) mask, True where key j lies after query i (cached per N: it is not part of the work)."""
    import torch
    key = (N, str(device))
    if key not in _causal_masks:
        _causal_masks.clear()
        _causal_masks[key] = torch.ones(N, N, dtype=torch.bool, device=device).triu_(1)
    return _causal_masks[key]


def _eager_attention(Q, K, V, causal, scale):
    import torch
    # S = τQKᵀ (τ folded into Q: an (N, d) multiply instead of an (N, N) one)
    S = torch.matmul(Q * scale, K.transpose(-2, -1))
    if causal:
        S = S.masked_fill_(_causal_mask(S.shape[-1], S.device), float("-inf"))
    P = torch.softmax(S, dim=-1)
    return torch.matmul(P, V)


def _sdpa(backend_name):
    def attention(Q, K, V, causal, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)
    return attention


def fast_builder(version, tiling=None, max_registers=None):
    """A forward-only builder for ``kernels_gpu.fast``'s ``version`` (``"v1"`` …), with an optional tiling and
    ptxas register cap (v5+); ``benchmarks.fast_kernels`` times every version through it."""
    def build(pass_, x, causal, scale, options):
        from kernels_gpu.fast import VERSIONS
        forward = VERSIONS[version]
        Q, K, V = x["Q"], x["K"], x["V"]
        cap = {} if max_registers is None else {"max_registers": max_registers}   # v5+: a ptxas register cap

        def call():
            O, L = forward(Q, K, V, causal=causal, scale=scale, tiling=tiling, **cap)
            return {"O": O, "L": L}
        return call
    return build


def register_fast_versions():
    """Add every ``kernels_gpu.fast`` forward version to :data:`IMPLS` as ``fast_v1``, ``fast_v2``, … (forward only,
    not in the default set); returns the names added."""
    from kernels_gpu.fast import VERSIONS
    names = []
    for version in VERSIONS:
        name = f"fast_{version}"
        IMPLS[name] = ImplSpec(name, "kernels_gpu", "float32", ("forward",), fast_builder(version),
                               f"kernels_gpu.fast FA2 forward {version} (register-tiled)", default=False)
        names.append(name)
    return names

IMPLS = {spec.name: spec for spec in (
    ImplSpec("kg_standard", "kernels_gpu", "float32", ("forward", "backward"), _kg_standard,
             "kernels_gpu standard attention: S, P materialised in global memory (FA1 Alg. 0/3)"),
    ImplSpec("kg_flash1", "kernels_gpu", "float32", ("forward",), _kg_flash1,
             "kernels_gpu FlashAttention forward (FA1 Alg. 1)"),
    ImplSpec("kg_flash2", "kernels_gpu", "float32", ("forward", "backward"), _kg_flash2,
             "kernels_gpu FlashAttention-2 forward and backward (FA2 Alg. 1/2)"),
    ImplSpec("kg_flash2_fast", "kernels_gpu", "float32", ("forward", "backward"), _kg_flash2_fast,
             "kernels_gpu.fast FlashAttention-2: forward v6, backward v1 (register-tiled, the fastest versions)"),
    ImplSpec("kg_flash2_fast_fp16", "kernels_gpu", "float16", ("forward", "backward"), _kg_flash2_fast_fp16,
             "kernels_gpu.fast FlashAttention-2 forward v6, backward v1 with fp16 storage and fp32 arithmetic",
             default=False),
    ImplSpec("kg_flash2_v3", "kernels_gpu", "float32", ("forward",), fast_builder("v3"),
             "kernels_gpu.fast FlashAttention-2 forward v3 (register-tiled)", default=False),
    ImplSpec("kg_flash2_det", "kernels_gpu", "float32", ("backward",), _kg_flash2_det,
             "kernels_gpu FlashAttention-2 backward with deterministic dQ", default=False),
    ImplSpec("torch_eager", "torch", "float32", ("forward", "backward"),
             _autograd_builder(_eager_attention, "float32"),
             "PyTorch eager fp32: matmul, softmax, matmul; autograd backward"),
    ImplSpec("sdpa_math", "torch", "float32", ("forward", "backward"), _autograd_builder(_sdpa("MATH"), "float32"),
             "PyTorch SDPA, math backend, fp32"),
    ImplSpec("sdpa_efficient", "torch", "float32", ("forward", "backward"),
             _autograd_builder(_sdpa("EFFICIENT_ATTENTION"), "float32"),
             "PyTorch SDPA, memory-efficient backend, fp32"),
    ImplSpec("sdpa_flash", "torch", "float16", ("forward", "backward"),
             _autograd_builder(_sdpa("FLASH_ATTENTION"), "float16"),
             "PyTorch SDPA, flash backend, fp16 (tensor cores: the only row not on CUDA cores)"),
)}

DEFAULT_IMPLS = tuple(name for name, spec in IMPLS.items() if spec.default)


# ---------------------------------------------------------------------------------------------- inputs

def config_seed(seed, N, d, causal, copy):
    """A distinct, reproducible seed per (run seed, configuration, input set)."""
    return (seed * 1_000_003 + N * 7_919 + d * 104_729 + int(causal) * 15_485_863 + copy * 2_038_074_743) % 2**62


def make_inputs(batch, heads, N, d, seed, device="cuda"):
    """One input set: Q, K, V, dO, float32 standard normal (never zeros), shape (batch, heads, N, d)."""
    import torch
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, N, d)
    return {name: torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            for name in ("Q", "K", "V", "dO")}


# ---------------------------------------------------------------------------------------------- reference

def _chunks(BH, N_q, N_k, chunk_bytes):
    """(heads per chunk, rows per chunk) so one float64 (heads, rows, N_k) score block stays under chunk_bytes."""
    rows = max(1, min(N_q, chunk_bytes // (8 * N_k)))
    heads = max(1, chunk_bytes // (8 * N_k * rows)) if rows == N_q else 1
    return min(heads, BH), rows


def _scores(q, k, r0, causal, scale, N_q, N_k):
    """S = τ q kᵀ in float64 for query rows r0 … r0 + R, with the causal mask (bottom-right aligned)."""
    import torch
    S = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        i = torch.arange(r0, r0 + q.shape[-2], device=q.device)[:, None]
        j = torch.arange(N_k, device=q.device)[None, :]
        # docs/conventions.md: query i sees key j iff j ≤ i + N_k − N_q
        S.masked_fill_(j > i + (N_k - N_q), float("-inf"))
    return S


def reference_forward(Q, K, V, causal, scale, chunk_bytes=2**28):
    """The float64 oracle on the GPU, in chunks: O = softmax(τQKᵀ)V and L = logsumexp(τQKᵀ) per row.

    Q: (B, H, N_q, d), K, V: (B, H, N_k, d) → O (B, H, N_q, d), L (B, H, N_q), both float64.
    Cost: 4·B·H·N_q·N_k·d FLOPs in float64; memory: the inputs in float64 plus one score block.
    """
    import torch
    B, H, N_q, d = Q.shape
    N_k = K.shape[-2]
    q, k, v = (t.reshape(B * H, t.shape[-2], t.shape[-1]) for t in (Q, K, V))
    O = torch.empty((B * H, N_q, V.shape[-1]), dtype=torch.float64, device=Q.device)
    L = torch.empty((B * H, N_q), dtype=torch.float64, device=Q.device)
    G, R = _chunks(B * H, N_q, N_k, chunk_bytes)
    for g0 in range(0, B * H, G):
        kk, vv = k[g0:g0 + G].double(), v[g0:g0 + G].double()
        for r0 in range(0, N_q, R):
            S = _scores(q[g0:g0 + G, r0:r0 + R].double(), kk, r0, causal, scale, N_q, N_k)
            Lc = torch.logsumexp(S, dim=-1)
            O[g0:g0 + G, r0:r0 + R] = torch.matmul(torch.exp(S - Lc[..., None]), vv)
            L[g0:g0 + G, r0:r0 + R] = Lc
    return O.reshape(B, H, N_q, -1), L.reshape(B, H, N_q)


def reference_backward(Q, K, V, dO, O, L, causal, scale, chunk_bytes=2**27):
    """Float64 gradients of the oracle, in chunks (FA2 Alg. 2's equations, evaluated exactly):
    P = exp(S − L), dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D), dQ = τ dS K, dK = τ dSᵀ Q.

    O, L: the float64 reference forward. Returns dQ, dK, dV (float64, shapes of Q, K, V).
    """
    import torch
    B, H, N_q, d = Q.shape
    N_k = K.shape[-2]
    q, k, v, dout = (t.reshape(B * H, t.shape[-2], t.shape[-1]) for t in (Q, K, V, dO))
    o, lse = O.reshape(B * H, N_q, -1), L.reshape(B * H, N_q)
    D = (dout.double() * o).sum(dim=-1)
    dQ = torch.empty((B * H, N_q, d), dtype=torch.float64, device=Q.device)
    dK = torch.zeros((B * H, N_k, d), dtype=torch.float64, device=Q.device)
    dV = torch.zeros((B * H, N_k, V.shape[-1]), dtype=torch.float64, device=Q.device)
    G, R = _chunks(B * H, N_q, N_k, chunk_bytes)
    for g0 in range(0, B * H, G):
        g = slice(g0, g0 + G)
        kk, vv = k[g].double(), v[g].double()
        for r0 in range(0, N_q, R):
            r = slice(r0, r0 + R)
            qq, dd = q[g, r].double(), dout[g, r].double()
            P = torch.exp(_scores(qq, kk, r0, causal, scale, N_q, N_k) - lse[g, r][..., None])
            dV[g] += torch.matmul(P.transpose(-2, -1), dd)
            dS = P * (torch.matmul(dd, vv.transpose(-2, -1)) - D[g, r][..., None])
            dQ[g, r] = torch.matmul(dS, kk) * scale
            dK[g] += torch.matmul(dS.transpose(-2, -1), qq) * scale
    return dQ.reshape(Q.shape), dK.reshape(K.shape), dV.reshape(V.shape)


def as_torch(array):
    """A torch view of a kernels_gpu result (numba device array, zero-copy) or a torch tensor as is."""
    import torch
    if isinstance(array, torch.Tensor):
        return array
    if hasattr(array, "__cuda_array_interface__"):
        return torch.as_tensor(array, device="cuda")
    return torch.as_tensor(array).cuda()


def relative_error(x, ref):
    """‖x − ref‖_F / ‖ref‖_F in float64; None when x holds a NaN or an infinity where ref is finite."""
    import torch
    x = as_torch(x).double()
    if x.shape != ref.shape and x.numel() == ref.numel():
        x = x.reshape(ref.shape)  # e.g. L returned as (B·H, N) for a (B, H, N) reference
    if x.shape != ref.shape:
        raise ValueError(f"output shape {tuple(x.shape)} differs from the reference's {tuple(ref.shape)}")
    finite = torch.isfinite(ref)
    if not bool(torch.isfinite(x[finite]).all()):
        return None
    diff = torch.where(finite, x - ref, torch.zeros_like(ref))
    norm = torch.linalg.vector_norm(torch.where(finite, ref, torch.zeros_like(ref)))
    return float(torch.linalg.vector_norm(diff) / norm) if float(norm) > 0 else float(torch.linalg.vector_norm(diff))


def make_check(reference, dtype, pass_):
    """A ``check(outputs)`` for ``timing.measure``: every output against the float64 reference.

    reference: dict with ``O, L`` (forward) or ``dQ, dK, dV`` (backward), float64.
    FA1's (ℓ, m) are compared as L = m + log ℓ. Returns (ok, {"rel_error": worst, "rel_errors": {...}}).
    """
    tolerance = TOLERANCE[(dtype, pass_)]

    def check(outputs):
        import torch
        outputs = dict(outputs)
        if "l" in outputs and "m" in outputs:
            # FA1 saves (ℓ, m); the log-sum-exp is L = m + log ℓ
            l, m = as_torch(outputs.pop("l")).double(), as_torch(outputs.pop("m")).double()
            outputs["L"] = m + torch.log(l)
        errors = {}
        with torch.no_grad():
            for name, value in outputs.items():
                if name in reference:
                    errors[name] = relative_error(value, reference[name])
        if not errors:
            raise ValueError(f"no output to check among {sorted(outputs)}")
        bad = [name for name, e in errors.items() if e is None or not math.isfinite(e) or e > tolerance]
        finite = [e for e in errors.values() if e is not None]
        worst = None if len(finite) < len(errors) else max(finite)
        return not bad, {"rel_error": worst, "rel_errors": errors, "tolerance": tolerance}
    return check
