"""Tensor-core FA2 forward in **TF32** for float32 inputs: ``mma.m16n8k8`` with tf32 operands, float32 accumulators.

**TF32 is not float32.** A tf32 value keeps float32's 8-bit exponent but only 10 of its 23 mantissa bits, so every
operand the tensor core multiplies is rounded with unit roundoff u = 2⁻¹¹ ≈ 4.9e-4 (float32: 2⁻²⁴ ≈ 6e-8). This
kernel takes float32 Q, K, V and returns float32 O and L, but its matrix products see Q, K, V and P̃ rounded to tf32:
expect errors around 1e-4 … 1e-3 where kernels_gpu's float32 kernels make ~1e-6 (:func:`error_against_fp32`
measures both on the same inputs). This is the trade Triton's tutorials and PyTorch's ``allow_tf32`` make quietly;
here it is opt-in and labelled: the function is ``flash2_forward_tf32``, its result ``Flash2ForwardTF32`` carries
``precision = "tf32"``, and ``kernels_gpu.tensorcore`` never makes it the default for float32.

**What changes against the 16-bit rungs (v6's structure: cp.async double-buffered K/V, P̃ in registers,
base-2 softmax, masks on the tiles that need them):**

* elements are 32 bits, in HBM, in shared memory (Q_i, K_j, V_j rows of d floats, padded to RS = d + 4 so that the
  8 rows × 4 columns one fragment load touches fall in 32 different banks) and in registers;
* ``ldmatrix`` moves 16-bit elements only, so every operand register is a plain shared-memory load
  (``ld.shared.f32``) followed by ``cvt.rna.tf32.f32`` — Q, K, V are converted to tf32 *as they are loaded into
  registers*, laid out as :mod:`~kernels_gpu.fragments`' m16n8k8 tf32 table says
  (a0 = Q[g][t], a1 = Q[g + 8][t], a2 = Q[g][t + 4], a3 = Q[g + 8][t + 4]; b0 = K[g][t], b1 = K[g][t + 4]);
* the k-steps are 8 wide (``mma.m16n8k8``: half the FLOPs of an m16n8k16 per instruction), so d needs only be a
  multiple of 8, with no padding;
* P̃ still never leaves the registers, but S's accumulators are not P̃'s A operand as they are for 16-bit types:
  the keys of each 8-key k-step are taken in the order 0, 2, 4, 6, 1, 3, 5, 7
  (:data:`~kernels_gpu.fragments.KEY_ORDER_TF32`), which makes a0…a3 = cvt(c0, c2, c1, c3) of the
  lane's own accumulators, and V's rows are loaded in the same order (b0 = V[2t][g], b1 = V[2t + 1][g]);
* O is stored as float32.

**Error (what the tests assert).** With u = 2⁻¹¹, the scores the kernel exponentiates are off by at most
``E_i = τ·max_j (2u + u² + (d + 2)·2⁻²⁴)·Σ_k |q_ik|·|k_jk|`` (Q and K rounded, float32 accumulation); a
perturbation of at most E in every score moves each softmax weight by a factor within [e^(−2E), e^(2E)]; P̃ and V
rounded to tf32 add two factors within (1 ± u). So ``|O_ic − O_ref,ic| ≤ max_j |v_jc|·(e^(2E_i)(1 + u)² − 1)`` plus
float32 slack, and ``|L_i − L_ref,i| ≤ E_i`` plus float32 slack: :func:`tf32_error_bound`. It is a worst case;
typical errors are 10-100× smaller, and still 100-1000× those of float32. Inputs that are already tf32 values lose
only P̃'s rounding, about ``u·max|v|`` — the part of TF32's error no input can avoid (the tests check the kernel
against that tighter bound).

**Prediction (written before any GPU run).** Per warp and K/V tile at d = 64 (B_c = 32), 160 scalar shared loads
and 176 conversions per lane feed 64 MMAs of 2 048 FLOPs: 0.16 shared-memory bytes per FLOP, 2.2× v6's 0.07
(ldmatrix, m16n8k16), and about 6× v6's instructions per FLOP (every operand register is a load, a conversion and
its address arithmetic, where one ldmatrix gives four registers). So instruction issue binds, not the tensor cores
(tf32 mma.sync runs at half the f16 rate: ~240 TFLOP/s by the measured f16 ceiling). v6, the same loop, made
106-129 TFLOP/s in fp16 at N ≥ 4096: at 4-6× its instructions per FLOP, **25-45 TFLOP/s at d = 64 and 128,
N ≥ 4096** — about kernels_gpu.fast's float32 forward (30-36) and SDPA memory-efficient float32 (35-46), with
~1000× the first one's error (SDPA's is measured beside it: the benchmark records every one). ptxas (sm_90,
``python -m kernels_gpu.tensorcore.inspect_ptx tf32 --dtype float32 --d 64 128 256``): 119 / 150 / 252 registers,
no spills, 52 / 101 / 133 KB of shared memory. What would come next: Q's and K's fragments by ``ldmatrix`` (a b16
8 × 8 matrix of 32-bit data is an 8 × 4 tf32 tile whose lane (g, t) holds (g, t): exactly a0 of A and b0 of B;
V's transposed load has no 32-bit form), and the conversion done once per tile in shared memory instead of once
per warp.

**Measured** (H100 80GB HBM3, 2026-11-24, ``benchmarks/results/nvidia-h100/tensorcore_variants.json``; float32
inputs, non-causal, batch × N = 16k tokens, TFLOP/s at N = 4096 / 16384): TF32 38.7 / 46.6 at d = 64, 43.9 / 47.4 at
d = 128; in the same run kernels_gpu.fast's float32 forward 33.6 / 34.8 and 29.6 / 37.7 (TF32 1.15-1.48× faster),
SDPA memory-efficient float32 35.2 / 35.0 and 46.3 / 45.0, SDPA math with ``allow_tf32`` 21.6 and 42.1 (N = 4096).
Within the predicted 25-45, slightly above it at N = 16384. Error against float64 (N = 2048, largest absolute error
of O): TF32 2.3e-4 / 1.7e-4 at d = 64 / 128; kernels_gpu.fast float32 6.4e-7 / 1.0e-6; SDPA float32 5.3e-7 / 5.5e-7
(memory-efficient), 5.5e-7 / 1.1e-6 (math); SDPA math in TF32 2.6e-4 / 2.3e-4. TF32 pays 165-350× float32's error
— less than the ~1000× guessed above, and about what PyTorch's own TF32 path pays. GPU tests
(``gpu_tests_tensorcore_tf32_partitioning.log``): 31 passed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
from numba import cuda, float32

import kernels_gpu.runtime as rt
from kernels_gpu import driver_launch, ptx
from kernels_gpu.tensorcore.steps import LN2, LOG2E, device

__all__ = ["flash2_forward_tf32", "Flash2ForwardTF32", "TF32Config", "config_for", "make_kernel", "shared_words",
           "tf32_error_bound", "error_against_fp32", "UNIT_ROUNDOFF_TF32", "MAX_HEAD_DIM", "PTX_SIGNATURE", "run",
           "launch_forward", "make_copy_rows", "make_softmax", "make_accumulators", "make_splits"]

#: the unit roundoff of tf32 under round-to-nearest (10 mantissa bits): 2⁻¹¹
UNIT_ROUNDOFF_TF32 = 2.0 ** -11
#: float32's unit roundoff, 2⁻²⁴
UNIT_ROUNDOFF_FP32 = 2.0 ** -24
MAX_HEAD_DIM = 256


def _ptx_signature():
    from numba import types
    f32 = types.float32[:, :, :, ::1]
    return (f32, f32, f32, f32, types.float32[:, :, ::1], types.int32, types.int32, types.int32, types.float32)


#: the kernel's argument types (Q, K, V, O float32 (Z, H, N, d); L; N_q, N_k, G; τ), for compiling it to PTX without
#: a GPU: ``python -m kernels_gpu.tensorcore.inspect_ptx tf32 --dtype float32``
PTX_SIGNATURE = _ptx_signature()


class Flash2ForwardTF32(NamedTuple):
    """``(O, L)`` of the TF32 forward — O float32 (…, N_q, d), L float32 (…, N_q) in natural-log units (+inf on
    rows that see no key) — computed with tf32 operands: ``precision`` says so."""

    O: object
    L: object
    precision = "tf32"


@dataclass(frozen=True)
class TF32Config:
    """Compile-time constants of the TF32 kernel: head dimension d (a multiple of 8), W warps of 16 query rows
    (B_r = 16·W), B_c keys per K/V tile (a multiple of 8), causal or not, simulator or GPU, and ``products``: 1
    (TF32: each operand rounded to tf32, one MMA per product) or 3 (3xTF32,
    :mod:`~kernels_gpu.tensorcore.flash2_forward_3xtf32`: each operand split into big + small, three MMAs)."""

    d: int
    B_c: int
    causal: bool
    simulated: bool
    warps: int = 4
    products: int = 1
    #: the limits a configuration is checked against (a form of the kernel with other limits overrides them):
    #: d and B_c multiples of STEP, d at most MAX_D, ``products`` one of PRODUCTS (1: TF32, 3: 3xTF32)
    STEP: ClassVar[int] = 8
    MAX_D: ClassVar[int] = MAX_HEAD_DIM
    PRODUCTS: ClassVar[tuple] = (1, 3)

    def __post_init__(self):
        if self.d % self.STEP or not self.STEP <= self.d <= self.MAX_D:
            raise ValueError(f"d must be a multiple of {self.STEP} in [{self.STEP}, {self.MAX_D}], got {self.d}")
        if self.B_c % self.STEP or self.B_c < self.STEP:
            raise ValueError(f"B_c must be a positive multiple of {self.STEP}, got {self.B_c}")
        if self.products not in self.PRODUCTS:
            raise ValueError(f"products must be one of {self.PRODUCTS} (1: TF32, 3: 3xTF32), got {self.products}")

    @property
    def B_r(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def RS(self) -> int:
        """Floats per row of a Q, K or V tile in shared memory: d, plus 4 of padding (bank spread, 16-byte rows)."""
        return self.d + 4

    @property
    def NT(self) -> int:
        """16 × 8 tiles of S per warp (B_c / 8); also the 8-key k-steps of O += P̃V."""
        return self.B_c // 8

    @property
    def NO(self) -> int:
        """16 × 8 tiles of O per warp (d / 8); also the 8-wide k-steps of S = QKᵀ."""
        return self.d // 8


def config_for(d: int, dtype: str, causal: bool, simulated: bool, products: int = 1) -> TF32Config:
    """The tile shape: 4 warps (B_r = 64); B_c = 32 keys up to d = 128 (Q_i and two stages of K_j, V_j: 101 KiB at
    d = 128, two blocks per SM), 16 beyond (133 KiB at d = 256). ``dtype``: the inputs' element type, "float32"
    (the rungs' signature, so that :mod:`~kernels_gpu.tensorcore.inspect_ptx` compiles this kernel as theirs)."""
    if dtype != "float32":
        raise ValueError(f"the TF32 kernel takes float32 inputs (dtype 'float32'), got {dtype!r}")
    return TF32Config(d=d, B_c=32 if d <= 128 else 16, causal=causal, simulated=simulated, products=products)


def shared_words(cfg: TF32Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS floats per row)."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


def make_copy_rows(jit, d: int, RS: int, T: int, ROWS: int):
    """``copy_rows(sm, off, X, z, h, row0, N, tid)``: T threads start the ``cp.async`` copies of ROWS rows of d
    floats (rows row0 … of X[z, h], C-contiguous) into ``sm`` from word ``off`` on, RS words per row."""
    CH = d // 4                              # 16-byte chunks (four floats) per row
    DR = T // CH                             # rows between a thread's consecutive copies
    if T % CH or ROWS % DR:                  # (d = 8, 24, 40, …: the chunks of a row do not divide the threads)
        @jit
        def copy_rows(sm, off, X, z, h, row0, N, tid):
            """Start the copy of rows row0 … row0 + ROWS − 1 of X[z, h] (float32, C-contiguous) into ``sm``
            from float ``off`` on (row stride RS) with ``cp.async``, 16 bytes per copy; rows past N are filled
            with zeros (source size 0; the source address clamped to a row that exists). FA2 Alg. 1 lines 4,
            7: load Q_i, K_j, V_j from HBM to SRAM (as float32: the conversion to tf32 comes with the loads
            into registers)."""
            first = ((z * X.shape[1] + h) * X.shape[2] + row0) * d
            for e in range(tid, ROWS * CH, T):
                r = e // CH
                c = e - r * CH
                valid = row0 + r < N
                ptx.cp_async16(sm, off + r * RS + 4 * c, X, first + r * d + 4 * c if valid else first,
                               16 if valid else 0)
        return copy_rows
    STEPS = ROWS // DR

    @jit
    def copy_rows_inc(sm, off, X, z, h, row0, N, tid):
        """The same copy with the addressing computed once: a thread copies chunk ``tid % CH`` of rows
        ``tid // CH + k·DR`` (as v9's copies do for 16-bit tiles)."""
        c = tid % CH
        r0 = tid // CH
        rem = N - row0 - r0                  # copy k reads a row of X iff k·DR < rem
        first = ((z * X.shape[1] + h) * X.shape[2] + row0) * d
        src = first + r0 * d + 4 * c
        dst = off + r0 * RS + 4 * c
        for k in range(STEPS):
            valid = k * DR < rem
            ptx.cp_async16(sm, dst + k * DR * RS, X, src + k * DR * d if valid else first, 16 if valid else 0)
    return copy_rows_inc


def make_softmax(jit, NT: int, NO: int, causal: bool):
    """``(row_softmax, finish_row)`` for a warp's 16 rows held as m16n8 accumulator tiles: S in NT tiles of 8 keys,
    Õ in NO tiles of 8 columns (lane (g, t) holds rows g and g + 8, columns 2t, 2t + 1 of each)."""
    neg_inf = float32(-math.inf)
    shfl_xor, ex2 = ptx.shfl_xor, ptx.ex2

    @jit
    def row_softmax(s, o, m, l, h, row, col0, N_k, scale_log2, diag, mask_tile):
        """FA2 Alg. 1 lines 8-10 for one of the lane's two rows (h = 0: row g, h = 1: row g + 8), in place and in
        float32, base 2 with the scale folded in (P̃ = 2^(S·τlog₂e − m·τlog₂e)); Õ and ℓ rescaled only when the
        row maximum moved. ``mask_tile``: False when every key of the tile is visible to every row of the block."""
        # Alg. 1 line 9 (first half): mask, then the row maximum — the lane's 2·NT values, the rest of the row in
        # the other three lanes of its group (xor 1, xor 2).
        mx = neg_inf
        for n in range(NT):
            for e in range(2):
                if mask_tile:
                    col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                    if col >= N_k or (causal and col > row + diag):
                        s[4 * n + 2 * h + e] = neg_inf
                mx = max(mx, s[4 * n + 2 * h + e])
        mx = max(mx, shfl_xor(mx, 1))
        mx = max(mx, shfl_xor(mx, 2))
        m_new = max(m[h], mx)
        # Guard (no visible key so far): P̃ = 0 for the whole row, nothing to rescale.
        if m_new == neg_inf:
            for n in range(NT):
                for e in range(2):
                    s[4 * n + 2 * h + e] = float32(0.0)
            return
        m_scaled = m_new * scale_log2
        # Alg. 1 line 10: rescale the old ℓ and Õ by exp(m_old − m_new), only if the maximum moved.
        if m_new != m[h]:
            alpha = ex2(m[h] * scale_log2 - m_scaled)
            l[h] *= alpha
            for n in range(NO):
                for e in range(2):
                    o[4 * n + 2 * h + e] *= alpha
        # Alg. 1 line 9 (second half): P̃ = exp(S − m_new), and the lane's part of its row sum (float32: ℓ sees
        # P̃ before it is rounded to tf32 for the product with V).
        rowsum = float32(0.0)
        for n in range(NT):
            for e in range(2):
                p = ex2(s[4 * n + 2 * h + e] * scale_log2 - m_scaled)
                s[4 * n + 2 * h + e] = p
                rowsum += p
        l[h] += rowsum
        m[h] = m_new

    @jit
    def finish_row(o, m, l, h, O, L, z, head, row, N_q, scale_log2):
        """FA2 Alg. 1 lines 12-15 for one of the lane's two rows: the group's four partial ℓ summed (two shuffles),
        O_i = diag(ℓ_i)⁻¹ Õ_i stored as float32, L_i = m_i·τ + log ℓ_i (natural units; +∞ and O = 0 for a row
        that saw no key, never NaN)."""
        t = cuda.laneid % 4
        total = l[h] + shfl_xor(l[h], 1)
        total = total + shfl_xor(total, 2)
        inv = float32(0.0) if total == float32(0.0) else float32(1.0) / total
        if row < N_q:
            for n in range(NO):
                for e in range(2):
                    O[z, head, row, 8 * n + 2 * t + e] = o[4 * n + 2 * h + e] * inv
            if t == 0:
                L[z, head, row] = math.inf if total == float32(0.0) else \
                    float32(m[h] * (scale_log2 * float32(LN2)) + math.log(total))

    return row_softmax, finish_row


def make_accumulators(jit):
    """``(zero, add_into, mma_into)``: zero a register array, add one into another, one tf32 MMA into tile n."""
    mma = ptx.mma_tf32

    @jit
    def zero(x, n):
        """x[0 … n−1] = 0."""
        for k in range(n):
            x[k] = float32(0.0)

    @jit
    def add_into(x, y, n):
        """x[0 … n−1] += y[0 … n−1] (float32 additions on the FMA units: rounded to nearest)."""
        for k in range(n):
            x[k] += y[k]

    @jit
    def mma_into(acc, n, a0, a1, a2, a3, b0, b1):
        """acc[4n … 4n+3] += A·B for one 16 × 8 × 8 product (``mma.sync.m16n8k8`` with tf32 operands, f32
        accumulators): the accumulator tile n of S or O, updated in place."""
        c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])
        acc[4 * n] = c0
        acc[4 * n + 1] = c1
        acc[4 * n + 2] = c2
        acc[4 * n + 3] = c3

    return zero, add_into, mma_into


def make_splits(jit):
    """``(a_operands, b_operands)`` for 3xTF32: four float32 values (or their bits) → their four big tf32 halves, then
    their four small ones (an A fragment's registers); two → big, big, small, small (a B fragment's)."""
    split = ptx.split_tf32

    @jit
    def a_operands(x0, x1, x2, x3):
        h0, l0 = split(x0)
        h1, l1 = split(x1)
        h2, l2 = split(x2)
        h3, l3 = split(x3)
        return h0, h1, h2, h3, l0, l1, l2, l3

    @jit
    def b_operands(x0, x1):
        h0, l0 = split(x0)
        h1, l1 = split(x1)
        return h0, h1, l0, l1
    return a_operands, b_operands


@functools.lru_cache(maxsize=None)
def make_kernel(cfg: TF32Config):
    """The TF32 kernel for one configuration (compiled on first launch)."""
    jit = device(cfg.simulated)
    B_r, B_c, T, RS, NT, NO, d = cfg.B_r, cfg.B_c, cfg.threads, cfg.RS, cfg.NT, cfg.NO, cfg.d
    K_OFF = B_r * RS                         # float offsets of the tiles in the one shared array: Q_i, then
    V_OFF = K_OFF + B_c * RS                 # stage 0 (K, V), then stage 1 (K, V)
    STAGE = 2 * B_c * RS
    S_LEN, O_LEN = 4 * NT, 4 * NO            # register-array lengths (compile-time constants)
    causal = cfg.causal
    neg_inf = float32(-math.inf)
    cvt = ptx.cvt_tf32

    copy_q, copy_kv = make_copy_rows(jit, d, RS, T, B_r), make_copy_rows(jit, d, RS, T, B_c)

    # 3xTF32 accumulates in stages, as CUTLASS's 3xTF32 GEMMs do: the tensor core adds an MMA's products into its
    # accumulator with truncation, not rounding to nearest (the error has a sign), and 3xTF32 issues three MMAs per
    # product — a chain of 3·d/8 of them for S and 3·N_k/8 for Õ would drift by ~10⁻⁵. So each group of KG k-steps
    # of S and each K/V tile's Õ += P̃V go into zeroed accumulators (s_part, o_part), added to S and Õ by float32
    # additions: chains of at most 3·KG and 3·B_c/8 MMAs (12 at B_c = 32), the rest rounded to nearest.
    STAGED = cfg.products == 3
    KG = 4

    # The operands of one product, from the float32 values of its A registers (four) and B registers (two), and the
    # product itself. TF32: each value rounded to tf32, one MMA. 3xTF32: each value split into big + small
    # (``split_tf32``), and A·B ≈ A_small·B_big + A_big·B_small + A_big·B_big — the small terms first, so that they
    # are added while the accumulator is still small; A_small·B_small (~2⁻²² of A·B) is left out.
    if cfg.products == 1:
        @jit
        def a_operands(x0, x1, x2, x3):
            return cvt(x0), cvt(x1), cvt(x2), cvt(x3)

        @jit
        def b_operands(x0, x1):
            return cvt(x0), cvt(x1)

        @jit
        def product(acc, n, a, b):
            mma_into(acc, n, a[0], a[1], a[2], a[3], b[0], b[1])
    else:
        a_operands, b_operands = make_splits(jit)

        @jit
        def product(acc, n, a, b):
            mma_into(acc, n, a[4], a[5], a[6], a[7], b[0], b[1])      # A_small · B_big
            mma_into(acc, n, a[0], a[1], a[2], a[3], b[2], b[3])      # A_big · B_small
            mma_into(acc, n, a[0], a[1], a[2], a[3], b[0], b[1])      # A_big · B_big

    row_softmax, finish_row = make_softmax(jit, NT, NO, causal)
    zero, add_into, mma_into = make_accumulators(jit)

    @cuda.jit
    def flash2_forward_tf32_kernel(Q, K, V, O, L, N_q, N_k, G, scale):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        t = lane % 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, float32)    # dynamic shared memory: Q_i, K_j, V_j as float32
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        # 3xTF32's staging accumulators (see ``STAGED``); unused (and compiled away) with one product
        s_part = cuda.local.array(S_LEN, float32)
        o_part = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * warp + g        # this lane's first row; its second is row0 + 8
        q_at = (16 * warp + g) * RS + t       # Q_i[16w + g][t]: where this lane's A element a0 sits (k-step 0)
        diag = N_k - N_q
        scale_log2 = scale * float32(LOG2E)   # τ·log₂e: exp(τx) = 2^(x·τlog₂e)

        # Causal: the tiles right of the block's last row's diagonal are never visited (all masked).
        n_tiles = (N_k + B_c - 1) // B_c
        if causal:
            last = min(N_k, (i + 1) * B_r + diag)
            n_tiles = max(0, (last + B_c - 1) // B_c)
        # Alg. 1 lines 4 and 7 (j = 1): start the copies of Q_i, K_1, V_1, as one group.
        copy_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        if n_tiles > 0:
            copy_kv(sm, K_OFF, K, z, hk, 0, N_k, tid)
            copy_kv(sm, V_OFF, V, z, hk, 0, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers).
        zero(o, O_LEN)
        for e in range(2):
            m[e] = neg_inf
            l[e] = float32(0.0)
        # Alg. 1 line 6: for j = 1 … T_c.
        for j in range(n_tiles):
            stage = (j % 2) * STAGE
            # Line 7 for tile j + 1, started now, lands while tile j is computed.
            if j + 1 < n_tiles:
                copy_kv(sm, K_OFF + STAGE - stage, K, z, hk, (j + 1) * B_c, N_k, tid)
                copy_kv(sm, V_OFF + STAGE - stage, V, z, hk, (j + 1) * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8: S_ij = Q_i K_jᵀ for the warp's 16 rows, 8-wide k-steps; every operand register is one
            # shared load rounded to tf32 (cvt.rna) — or split into two tf32 values — on its way in.
            zero(s, S_LEN)
            for kk in range(NO):
                if STAGED and kk % KG == 0:
                    zero(s_part, S_LEN)
                a = a_operands(sm[q_at + 8 * kk], sm[q_at + 8 * RS + 8 * kk], sm[q_at + 8 * kk + 4],
                               sm[q_at + 8 * RS + 8 * kk + 4])
                for n in range(NT):
                    # B = K_jᵀ: b0 = K_j[8n + g][8kk + t], b1 = K_j[8n + g][8kk + t + 4]
                    k_at = K_OFF + stage + (8 * n + g) * RS + 8 * kk + t
                    product(s_part if STAGED else s, n, a, b_operands(sm[k_at], sm[k_at + 4]))
                if STAGED and (kk % KG == KG - 1 or kk == NO - 1):
                    add_into(s, s_part, S_LEN)

            # Lines 9-10: the online softmax; the mask only on tiles that can hold a key invisible to some row of
            # the block: past N_k, or (causal) past the first row's diagonal.
            mask_tile = (j + 1) * B_c > N_k or (causal and (j + 1) * B_c - 1 > i * B_r + diag)
            row_softmax(s, o, m, l, 0, row0, j * B_c, N_k, scale_log2, diag, mask_tile)
            row_softmax(s, o, m, l, 1, row0 + 8, j * B_c, N_k, scale_log2, diag, mask_tile)

            # Line 10 (second half): Õ_i += P̃_ij V_j, one 8-key k-step per tile of S. A comes from the lane's own
            # accumulators with the keys in the order 0, 2, 4, 6, 1, 3, 5, 7 (a0…a3 = c0, c2, c1, c3), so V's
            # rows follow that order: b0 = V_j[8kk + 2t][8n + g], b1 = V_j[8kk + 2t + 1][8n + g].
            if STAGED:
                zero(o_part, O_LEN)
            for kk in range(NT):
                a = a_operands(s[4 * kk], s[4 * kk + 2], s[4 * kk + 1], s[4 * kk + 3])
                v_at = V_OFF + stage + (8 * kk + 2 * t) * RS + g
                for n in range(NO):
                    product(o_part if STAGED else o, n, a, b_operands(sm[v_at + 8 * n], sm[v_at + RS + 8 * n]))
            if STAGED:
                add_into(o, o_part, O_LEN)
            cuda.syncthreads()                # stage j mod 2 is free for tile j + 2

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i, written to HBM once.
        finish_row(o, m, l, 0, O, L, z, h, row0, N_q, scale_log2)
        finish_row(o, m, l, 1, O, L, z, h, row0 + 8, N_q, scale_log2)

    return flash2_forward_tf32_kernel


def _contiguous(x, name: str):
    """The kernel addresses Q, K, V through flat indices (cp.async): a device array must be C-contiguous."""
    if not x.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous for the TF32 and 3xTF32 kernels (their copies address rows by "
                         f"flat index); make it contiguous first")
    return x


def flash2_forward_tf32(Q, K, V, causal=False, scale=None) -> Flash2ForwardTF32:
    """FA2 forward on tensor cores **in TF32**: float32 Q (…, N_q, d), K, V (…, N_k, d) — NumPy arrays (float64 is
    cast to float32), numba device arrays or anything with ``__cuda_array_interface__`` such as PyTorch CUDA
    tensors (zero-copy, C-contiguous) — with every matrix-product operand rounded to tf32 (10-bit mantissa,
    u = 2⁻¹¹) and float32 accumulation. Returns ``Flash2ForwardTF32(O, L)`` (``.precision == "tf32"``): O float32
    (…, N_q, d), L float32 (…, N_q), +inf on rows that see no key (O = 0 there); NumPy in → NumPy out, device in →
    numba device arrays out. d a multiple of 8 up to 256, d_v = d; GQA/MQA by head mapping; ``causal``: bottom-right
    aligned; ``scale``: τ, default 1/√d. Cost: 4·N_q·N_k·d FLOPs per (batch, head) (half of it skipped when causal);
    HBM reads N_q·d + 2·N_k·d·T_r floats, writes N_q·d + N_q. Errors: :func:`tf32_error_bound`."""
    return Flash2ForwardTF32(*run(Q, K, V, causal, scale, products=1))


def run(Q, K, V, causal, scale, products: int):
    """Check the inputs, launch the kernel with ``products`` MMAs per product (1: TF32, 3: 3xTF32), return (O, L)."""
    return launch_forward(Q, K, V, causal, scale, "TF32" if products == 1 else "3xTF32", 8, MAX_HEAD_DIM,
                          lambda d, c, sim: config_for(d, "float32", c, sim, products), make_kernel, shared_words)


def launch_forward(Q, K, V, causal, scale, name: str, multiple: int, max_d: int, config, kernel_for, words):
    """What the float32 tensor-core forwards share around their kernels: the inputs prepared and checked (d a
    multiple of ``multiple`` up to ``max_d``, d_v = d, C-contiguous), the configuration ``config(d, causal,
    simulated)`` and its kernel ``kernel_for(cfg)`` launched on a grid of (row blocks, heads, batch) with
    ``4·words(cfg)`` bytes of shared memory; returns (O, L) shaped as the inputs."""
    layout, Q4, K4, V4, tau = rt.prepare_inputs(Q, K, V, causal=causal, scale=scale)
    d = layout.d
    if layout.d_v != d:
        raise ValueError(f"V's head dimension must equal Q's for the {name} kernel: d = {d}, d_v = {layout.d_v}")
    if d % multiple or d > max_d:
        raise ValueError(f"the {name} kernel takes head dimensions that are multiples of {multiple} up to {max_d}, "
                         f"got d = {d}")
    Q4, K4, V4 = _contiguous(Q4, "Q"), _contiguous(K4, "K"), _contiguous(V4, "V")
    cfg = config(d, bool(causal), rt.simulator_in_use())
    O = rt.device_empty((layout.Z, layout.H_q, layout.N_q, d))
    L = rt.device_empty((layout.Z, layout.H_q, layout.N_q))
    args = (Q4, K4, V4, O, L, np.int32(layout.N_q), np.int32(layout.N_k), np.int32(layout.G), np.float32(tau))
    driver_launch.launch(kernel_for(cfg), (rt.grid_size(layout.N_q, cfg.B_r), layout.H_q, layout.Z), cfg.threads, 0,
                         args, 4 * words(cfg))
    return rt.finish(O, layout, (layout.N_q, d)), rt.finish(L, layout, (layout.N_q,))


# -- the error it may make, and the error it makes beside float32 ---------------------------------------------------

def _heads(Q, K, V):
    """float64 (Z, H_q, N, d) views of host Q, K, V with K, V repeated over each GQA group."""
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    q = Q.reshape((-1,) + Q.shape[-3:]) if Q.ndim >= 3 else Q[None, None]
    k = K.reshape((-1,) + K.shape[-3:]) if K.ndim >= 3 else K[None, None]
    v = V.reshape((-1,) + V.shape[-3:]) if V.ndim >= 3 else V[None, None]
    G = q.shape[1] // k.shape[1]
    return q, np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)


def tf32_error_bound(Q, K, V, scale=None):
    """Worst-case bounds on the TF32 kernel's error against exact attention, for host arrays: ``(bound_O,
    bound_L)`` shaped like O (…, N_q, d) and L (…, N_q). With u = 2⁻¹¹ (tf32 round-to-nearest) for each of Q, K, V
    that is not already made of tf32 values (0 for one that is: rounding it changes nothing), and
    ``E_i = τ·max_j (u_Q + u_K + u_Q·u_K + (d + 2)·2⁻²⁴)·Σ_k |q_ik|·|k_jk|`` (the largest error of a scaled score: Q
    and K rounded to tf32, the products accumulated in float32):

    * ``|O_ic − O_ic,exact| ≤ max_j |v_jc|·(e^(2E_i)(1 + u)(1 + u_V) − 1) + 16·2⁻²⁴·max_j |v_jc|`` — the softmax
      weights move by factors within e^(±2E_i), P̃ is rounded to tf32 for the product with V (u; ℓ sums the
      unrounded P̃), V is rounded (u_V), the rest is float32 arithmetic;
    * ``|L_i − L_i,exact| ≤ E_i + 2⁻²⁰·(1 + |L_i|)`` (the log-sum-exp moves by at most the largest score error);
      ``bound_L`` is E_i, the float32 term is the caller's to add.

    The maxima over j run over every key, masked or not, so the bounds hold for causal calls too. For inputs already
    in tf32 only P̃'s rounding is left: about ``u·max|v|``, the error TF32 cannot avoid."""
    q, k, v = _heads(Q, K, V)
    d = q.shape[-1]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    u = UNIT_ROUNDOFF_TF32
    u_q, u_k, u_v = (0.0 if np.array_equal(ptx.tf32_round(x.astype(np.float32)), x) else u for x in (q, k, v))
    reach = np.max(np.abs(q) @ np.abs(k).swapaxes(-1, -2), axis=-1)                          # (Z, H, N_q)
    score_bound = tau * (u_q + u_k + u_q * u_k + (d + 2) * UNIT_ROUNDOFF_FP32) * reach        # E_i
    vmax = np.abs(v).max(axis=-2)[..., None, :]                                                # (Z, H, 1, d)
    bound_O = vmax * (np.exp(2 * score_bound)[..., None] * (1 + u) * (1 + u_v) - 1) + 16 * UNIT_ROUNDOFF_FP32 * vmax
    lead = np.shape(Q)[:-1]
    return bound_O.reshape(lead + (d,)), score_bound.reshape(lead)


def error_against_fp32(Q, K, V, causal=False, scale=None) -> dict:
    """The TF32 kernel beside kernels_gpu's float32 kernel on the same host inputs, both against the float64
    oracle (:func:`fa2edu.attention_reference` on the float32-rounded inputs): a dict with the largest absolute
    error of O of each (``"tf32"``, ``"fp32"``), the worst-case TF32 bound (``"tf32_bound"``), the largest
    magnitude of O (``"max_abs_O"``) and both unit roundoffs. The float32 kernel is the one ``fa2edu.distributed``
    uses on CUDA float32: ``kernels_gpu.fast`` v6 for d ≤ 64, v8 beyond."""
    import fa2edu
    from kernels_gpu.fast import VERSIONS

    q, k, v = (np.asarray(x, dtype=np.float32) for x in (Q, K, V))
    O_ref, _ = fa2edu.attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                          causal=causal, scale=scale)
    O_ref = np.nan_to_num(O_ref)                      # rows that see no key: O = 0
    O_tf32, _ = flash2_forward_tf32(q, k, v, causal=causal, scale=scale)
    fast = VERSIONS["v6" if q.shape[-1] <= 64 else "v8"]
    O_fp32, _ = fast(q, k, v, causal=causal, scale=scale)
    bound_O, _ = tf32_error_bound(q, k, v, scale=scale)
    return dict(tf32=float(np.abs(O_tf32 - O_ref).max()), fp32=float(np.abs(O_fp32 - O_ref).max()),
                tf32_bound=float(bound_O.max()), max_abs_O=float(np.abs(O_ref).max()),
                unit_roundoff_tf32=UNIT_ROUNDOFF_TF32, unit_roundoff_fp32=UNIT_ROUNDOFF_FP32)
