"""FlexAttention on tensor cores: the user's ``mask_mod`` and ``score_mod`` compiled into FA2 forward and backward
kernels.

:mod:`fa2edu.flex` is FlexAttention in NumPy: a mask written as a Python function ``mask_mod(b, h, q_idx, kv_idx)
-> bool``, classified ahead of time by :func:`fa2edu.create_block_mask` into skipped, partial and full blocks, and
a ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to each scaled score. This module runs the same mods
on the GPU. numba compiles each mod, a plain Python scalar function, as a device function
(``cuda.jit(device=True)(mod)``) and the kernel calls it from inside its loop, where LLVM inlines it. No code is
generated from the mods' text, and nothing is traced: it is the same function that the NumPy path calls.

Two forward rungs, :data:`FORWARD_VERSIONS` (same arguments, same results): **v11**, the default
(:func:`flex_forward_v11`, :func:`make_kernel`), is the mma.sync ladder's fastest forward
(:mod:`kernels_gpu.tensorcore.flash2_forward_v11`) with the mods — its section below says what changed and what it
predicts; **v4** (:func:`flex_forward_v4`, :func:`make_kernel_v4`), the first flex kernel, is rung v4 of
:mod:`kernels_gpu.tensorcore` (``cp.async`` with K_j, V_j double-buffered, ``ldmatrix``, ``mma.sync.m16n8k16``, P̃
kept in registers), kept so that its measurements stay reproducible (``flex_forward(..., rung="v4")``). Both use the
online softmax and the final rescale of :mod:`kernels_gpu.tensorcore.steps`, and make three changes from the
BlockMask (FA1 Algorithm 5 inside FA2's loops):

* **skipped blocks are never loaded.** A row block i visits only the key blocks whose class is not SKIPPED — v4
  walks the classes in the kernel (:func:`next_visited`), v11 reads a list made on the host (:func:`visit_table`).
  The copy of the next visited tile starts while the current one is computed. A row block that visits nothing
  stores O = 0, L = +inf;
* **partial blocks** call ``mask_mod`` once per score of the tile, and a dropped score becomes −inf before the
  online softmax (Alg. 1 line 9). **Full blocks** do not call it at all;
* **score_mod** rewrites every visible score after scaling, ``score_mod(τ·q·k, b, h, q_idx, kv_idx)``, exactly as
  :func:`fa2edu.flex.flex_attention` does. The softmax then runs on the modified scores (scale 1: τ has already
  been applied; without a score_mod, v11 leaves τ folded into the softmax's exponent, as the ladder's v5).

Mods that index arrays (document ids, a bias table, ALiBi's slopes), bound with :func:`fa2edu.flex.bind`, take them
as kernel arguments. The kernel's signature is fixed: four array slots A0 … A3 (dummy 1-element arrays where
unused), handed out in order to the mask's parts, then to the score_mod. That is up to four bound arrays in all,
for example :func:`~fa2edu.flex.document`'s two id arrays and :func:`~fa2edu.flex.alibi`'s slopes. Masks composed
with :func:`~fa2edu.flex.or_masks` / :func:`~fa2edu.flex.and_masks` are compiled part by part and combined by a
short-circuiting ``or`` / ``and``. Before a mod reaches the GPU, numba types it on the host for the kernel's
argument types. A mod numba cannot compile (``math`` it lacks, a Python object, a list) raises a ``TypeError``
naming the mod, in the simulator too. A kernel is compiled and cached per (tile, mods), keyed by what numba
compiles: a mod's code and the constants it closes over, not the arrays it binds. So new document ids, or a
``causal`` specialised again for the same lengths, reuse the compiled kernel (:func:`plan_mods`).

Conventions are fa2edu's, for float16 and bfloat16 inputs of the kinds :mod:`kernels_gpu.tensorcore.launch`
accepts: q (B, H_q, N_q, d), k, v (B, H_kv, N_k, d); τ = 1/√d by default; ``enable_gqa`` lets query head h read
key/value head h // (H_q / H_kv); d a multiple of 8 up to 256 (up to 128 at the largest tiles); any N_q, N_k.
A fully masked row gets O = 0, L = +inf (natural log, float32).

**Tiles.** v11: the kernel tile lies inside one BlockMask block and takes its class (:func:`config_for`): the
ladder's v10 tile for the head dimension (:func:`flex_tile`), shrunk to divide the BLOCK_SIZE, which may be any
multiples of 16. PyTorch's default 128 runs the preferred tiles — (128, 32) with 4 warps of two 16-row MMA tiles at
d ≤ 128, (64, 32) of one above —, (64, 64) runs 64-row tiles of 2 warps, and the simulator tests' (16, 16) one
warp. v4: the BlockMask's BLOCK_SIZE = (B_r, B_c) *is* the kernel's tile, B_r = 16·W for W = 1 … 8 warps (one
16-row MMA tile per warp), B_c a multiple of 16 up to 128 (:func:`config_for_v4`; 174 KB of shared memory at
BLOCK_SIZE 128 and d = 128). A BLOCK_SIZE a rung cannot run raises an error that says which sizes it can run. The
block mask is not re-classified behind the caller's back, because that costs a mask_mod call per score. No block
mask means every block is full (v11: the preferred tile; v4: (64, 64)).

**Costs, per (batch, head).** The MMAs of the visited blocks, 4·d·(their area) FLOPs. One ``mask_mod`` call per
score of a partial block, one ``score_mod`` call per visible score. HBM reads N_q·d + 2·d·CV elements, CV being the
sum over visited blocks of their key rows (the ledger of :func:`fa2edu.flex.flex_attention`, same tiles), plus one
byte of block class per (i, j) that a row block's walk inspects, plus whatever the mods read from their bound
arrays. Those reads go through L1 and L2 by ordinary loads, once per call: a document mask reads 2 ids per score of
a partial block. Writes: N_q·d elements of O (16-bit) and N_q of L (float32).

**Rung v4's prediction (it has not run on a GPU; nothing here is measured).** On full blocks the kernel is rung v4
plus a multiply by τ and a compare per score. v4 measured 58 TFLOP/s at d = 64 and 90 at d = 128 on an H100
(non-causal, N = 16k), and this kernel should come within 10 % of that when score_mod is None. With causal as a
mask_mod, about half of the blocks are skipped, and the diagonal's partial blocks (a fraction B/N of the visited
ones) pay a mask call per score: a few integer operations, inlined. Expect v4-causal's wall time within 15 %,
which is 1.7-1.9× faster than non-causal at N ≥ 4096. ``softcap`` (a ``tanh`` per score, in float64 because its
``c`` is a Python float: FP64 runs at 1/2 the FP32 rate on an H100, 1/64 on consumer parts) should cost 20-40 %
at d = 64 and less at d = 128, where the MMAs dominate. ALiBi and relative_bias are one global load per score
(cached) plus an add, ≤ 15 %. Two things could break the prediction. A mod that numba does not inline would put
``s`` in local memory. And the classes read from global memory sit in the critical path of the next tile's copy.
The GPU tests should measure all of this against FlexAttention's Triton kernels.

**The backward** (:func:`flex_backward`) has two rungs, :data:`BACKWARD_VERSIONS` (same arguments, same results
up to rounding). **v7**, the default (:func:`flex_backward_v7`), is the mma.sync ladder's fastest backward with
the mods — its section at the end of this docstring. **v1** (:func:`flex_backward_v1`,
:func:`make_backward_kernel_v1`), the first flex backward, is the ladder's backward v1 (one block per key block j
walking the row blocks i of its GQA group, dQ by atomic adds, three launches) over the classes read as
C[b, h, i, j] for each i, kept so that its results stay reproducible (``flex_backward(..., rung="v1")``). Both
recompute x = τ·qk, P = exp(score_mod(x) − L) and g = score_mod_grad(x), and multiply the softmax gradient by g,
as :func:`fa2edu.flex.flex_attention_backward` defines it; skipped pairs are not loaded, partial pairs call
``mask_mod`` per element, full pairs do not. A score_mod without a derivative (its attribute or the
``score_mod_grad`` argument) raises before any launch. The derivative's bound arrays take the next array slots
(an array already bound keeps its slot: ALiBi's slopes serve the score_mod and its derivative). A
:func:`~fa2edu.flex.chain_score_mods` (flash-attn's softcap then ALiBi) is compiled part by part, its derivative
by the chain rule g₁(s)·g₂(f₁(s)) (:func:`compile_score`). Neither has run on a GPU. Left for later: the Hopper
(wgmma) versions.

**The op.** ``fa2edu.torch.flex_attention`` (and ``flash_attention``'s ``window_size``, ``softcap``,
``alibi_slopes``) runs these two kernels for CUDA float16/bfloat16 tensors (``fa2edu._torch_ops``: zero columns
padded to a multiple of 8, d_v = d; a BlockMask whose tile these kernels cannot run retiled from its classes).

**Rung v11 (the default): the mods on the ladder's fastest forward.** Issue 38 asks for ≥ 1.0× PyTorch's compiled
FlexAttention (Triton; hundreds of TFLOP/s on an H100/H200). v4 is the ladder's v4 (58-90 TFLOP/s measured on an
H100); the ladder's v11 reached 218-309 TFLOP/s forward (fp16, N ≥ 4096,
``benchmarks/results/nvidia-h100/tensorcore_v11.json``). What separates them is v5-v11, one change each; the mods
touch only the score tile between ``S = Q Kᵀ`` and the online softmax, so each carries over. What v11 changes from
v4 (:func:`make_kernel` against :func:`make_kernel_v4`):

1. **v5's base-2 softmax** with the scale folded into one FMA and the rescale skipped when the maximum does not
   move. A score_mod must see τ·q·k (PyTorch's convention), so with one the tile is multiplied by τ, modified,
   and the softmax runs with log₂e; without one, τ·log₂e stays in the exponent and a full tile is not touched at
   all (the statistics keep one unit per kernel: a compile-time choice). **v6** (masks only on the tiles that
   need them) is the classes: a full tile runs no mask and no column test except keys past N_k on the last tile.
2. **v7's two 16-row MMA tiles per warp and v10's tile per head dimension** (:func:`flex_tile`). The kernel tile
   is no longer the BlockMask's block: it is the largest preferred tile that divides the block
   (:func:`config_for`), so each kernel tile lies inside one block and takes its class, mask_mod still runs on
   exactly the partial blocks' scores, and no retiling is needed for BLOCK_SIZE 128 (PyTorch's) or (64, 64).
   One departure from v10's table, from ptxas's report (sm_90a, no GPU): at 64 < d ≤ 128 the B_c = 64 tile
   spills 56-228 bytes once mods are compiled in (255 registers; the ladder's own v11: 8 bytes, outside its
   loop), the B_c = 32 tile none (241-254 registers) — so kernels with mods take B_c = 32 there, and
   ``flex_forward(..., B_c=64)`` measures the other choice. At d = 64: 156-170 registers, no spills, for every
   ready mod (the ladder's v11 causal: 163).
3. **v8's float32 softmax and v9's copies with stepped addresses** (``copy_*_async_inc``), unchanged by the mods.
4. **v11's longest row blocks first, for any mask.** The host counts the tiles each kernel row block visits
   (:func:`visit_table`, per (b, h) of the BlockMask) and sorts the row blocks by that count; when they differ
   (causal, windows near the start, documents), the grid is (heads, batch, row blocks) and the block runs row
   block ``order[b, h, blockIdx.z]``; when every row block is alike (no mask, all full), v10's grid (row blocks,
   heads, batch), whose consecutive blocks share a head's K and V in L2.
5. **The walk as a list, and the host path.** v4 read the classes in the kernel and stepped over skipped blocks
   one byte at a time, in the critical path of the next tile's copy. v11 reads the next visited tile's index from
   a list made on the host (``visits[b, h, i, t] = 2·j + partial``, PyTorch's ``kv_indices`` in one array): one
   load per tile, issued before the copy it addresses. The host work that v4 repeated on every call — the classes
   copied to the device, the bound arrays copied, the mods planned — is done once: the walk is kept with its
   BlockMask (weakly: :func:`walk_for`; a BlockMask whose classes are changed in place keeps its old walk), the
   plan per pair of mod objects (:func:`planned_mods`), the device copy per bound host array (:func:`_device_copy`:
   bind a new array rather than change one in place). PyTorch CUDA tensors then take the short road of the
   ladder's ``launch.run``: a plan per (shapes, strides, dtype, mods, BlockMask, τ) holding the packed launch, so a
   repeated call allocates O and L and makes one driver-level launch.

Not carried over: the ladder's ``causal=True`` specialisation (causal is a mask_mod here: its diagonal tiles are
partial blocks that call the mod per score, where the ladder tests a column index).

**Prediction (before any GPU run; nothing here is measured).** With 1-5 the mods' cost over the ladder's v11 is a
compare per score of a partial tile, the score_mod's arithmetic per score, one list load per visited tile, and at d
= 128 with mods the narrower B_c = 32 tile, which v10's sweep measured 9 % slower on v9 (193 against 211 TFLOP/s at
N = 4096). Forward, bf16, N ≥ 4096 on an H200, counting model FLOPs of the kept scores: causal, sliding window,
prefix-LM and document within 10 % of the ladder's v11-causal at d = 64 (213-252 TFLOP/s, GPU.md) and within 15 % at
d = 128 (285-312); ALiBi and relative_bias (one cached load per score) within 15 % / 20 %; softcap 20-35 % below at
d = 64 — :func:`fa2edu.flex.softcap` closes over a Python float, which numba types float64, so its ``c·tanh(s/c)``
runs in double precision (FP64 at half the FP32 rate on an H100; a float32 ``c`` would remove most of that cost, and
is fa2edu.flex's change to make). Sliding window 1024 against causal at N = 16384, BLOCK_SIZE 128: a row block
visits ≈ 9 blocks of the window (1024 + 128 keys) against causal's 64.5 on average, so ≈ 7.2× less work; in wall
time 6.5-7.5×, below issue 38's 8×. Even elementwise the ratio is exactly 8 (8192 kept keys per row on average
against 1024), so the block granularity alone puts the target out of reach unless causal runs less efficiently per
FLOP than the window (its longer rows should make it, if anything, more efficient); (64, 64) blocks bring the count
to ≈ 7.5× at the price of half-height tiles. Host: a repeated call on CUDA tensors should cost about what the
ladder's planned launch does (64-96 µs measured, ``tensorcore_launch_overhead.json``), against v4's copies and
planning per call. What could break it: a mod that numba does not inline (``s`` to local memory), the spills of d =
128 coming back with a heavier mod, or a partial-tile path that ptxas schedules around the full-tile one. Against
PyTorch's compiled FlexAttention (not yet measured here; ``benchmarks/flex.py`` will, in the same run): if it runs
near SDPA flash (FlashAttention-2), the forward target is plausible at d = 128 and tight at d = 64, where the
ladder's v11 is 0.82× SDPA flash; if its Triton kernels reach wgmma-class speed, mma.sync cannot meet it.

**Measured** (H200, 2026-12-02, ``benchmarks/results/nvidia-h200/flex_bf16.json``, bf16, d = 128, N = 16384,
BLOCK_SIZE 64, calls queued; TFLOP/s of kept scores, forward): causal 251, sliding window 205, prefix-LM 250,
document 202, ALiBi 171, relative_bias 136, softcap 52 — against PyTorch's compiled FlexAttention 408 / 310 / 406 /
290 / 369 / 84 / 190 (0.62 / 0.66 / 0.62 / 0.70 / 0.46 / 1.61 / 0.27×) and SDPA's causal 639. Against the
prediction: causal is 0.78× of the ladder's v11-causal in the same session (320, ``hopper_forward_h5_causal_bf16
.json``), not within 15 %; ALiBi 0.53×, not 0.85×; softcap 0.21× of causal, far past the predicted 20-35 % —
the double-precision tanh is the suspect named above, and its float32 form the change to make. The window's
speed-up over causal: 6.75× forward, 6.81× forward + backward (the ledger: 7.41×, 7.24×; issue 38's 8× missed, as
predicted). PyTorch's Triton kernels are of wgmma class: issue 38's ≥ 1.0× is met only with relative_bias. (A
first run of the harness timed PyTorch's FlexAttention after dynamo's recompile limit had sent it to eager mode,
1-12 TFLOP/s; the harness now raises that limit and refuses the eager fallback.)

**Backward rung v7 (the default): the mods on the ladder's fastest backward.** The v1-based kernel ran the
ladder's backward v1, which the ladder measured at 104-113 TFLOP/s (fp16, N = 4096, H100); the ladder's v7 reached
174-206 TFLOP/s from N = 4096 (bf16, ``tensorcore_backward_v7.json``). Between them are v2-v7, one change each, and
as in the forward the mods touch only the score tile between Sᵀ = K_j Q_iᵀ and the softmax gradient, so each carries
over. What v7 changes from the v1-based kernel (:func:`make_backward_kernel` and :func:`make_backward_dq_kernel`
against :func:`make_backward_kernel_v1`):

1. **v3's two passes.** The key-block kernel computes dK_j, dV_j only (no dSᵀ through shared memory, no dQ
   products, no atomics, one barrier per step); a dQ kernel in the forward's orientation, one block per query
   block of 16·W rows, recomputes S, P (through the mods) and dP and accumulates dQ_i in registers, written once
   in the input dtype: no float32 accumulator, no zeroing, no conversion launch, a bit-reproducible dQ. The
   price is 7 products per visited pair instead of 5, and the mods called twice (once per kernel).
2. **Walks as lists (v11's forward, from both sides).** The key-block kernel reads its (query head, row block)
   pairs from a host-made list per key block, over the whole GQA group, coded ``(gq << 23) | (i << 1) | partial``
   (:func:`kv_visit_table`; decoded by shifts, not v5's divisions — v6's point); the dQ kernel reads the
   forward's :func:`visit_table` at its own tile. One load per step, issued before the copy it addresses; the
   walks are kept with their BlockMask (:func:`backward_walks_for`). A per-head BlockMask gives each head of a
   group its own list; a key block or query block that visits nothing writes zeros.
3. **v4's longest blocks first, for any mask.** When the lists differ in length (causal, windows near the start,
   documents) each kernel's grid puts the block index last and reads ``order`` (longest first); otherwise the
   ladder's grids.
4. **v5's stepped copies, v6's unsigned statistics indices, v7's Sᵀ and dPᵀ in one loop**, unchanged by the mods.
   v7's pair has dPᵀ ready when Pᵀ is formed, which the mods use: with a score_mod the key-block kernel folds the
   derivative into dPᵀ at once, dPᵀ ← (dPᵀ − D_i) ∘ g, so that dSᵀ = Pᵀ ∘ dPᵀ later and g needs no registers of its
   own (the v1-based kernel kept a 4·B_r/8-float array of g across dV's update). The dQ kernel needs P only inside
   dS, so it keeps P ∘ g and runs the ladder's softmax gradient unchanged.
5. **Tiles inside the BlockMask's blocks** (:func:`backward_config_for_v7`): the ladder's v7 tile (4 warps; B_r =
   64 up to d = 64, 32 beyond) shrunk to divide gcd(B_r, B_c) of the mask, so BLOCK_SIZE 128 (PyTorch's) and
   (64, 64) run it unchanged and no retiling is needed; the v1-based kernel ran the BlockMask's block as its
   tile. Full tiles without a score_mod call the ladder's own probability step, the key test only on the ragged
   last key block.

One departure found with ptxas (sm_90a, no GPU), kept: the per-score mod step is split into loops of
:data:`MOD_TILES` n-tiles. As one loop over the tile, LLVM did not unroll it at B_r = 64 once a mod was compiled in,
and ptxas then kept Sᵀ and dPᵀ in local memory (a 256-byte stack frame in the key-block kernel with softcap at
d = 64, 128 bytes in the dQ kernel with causal + ALiBi). Registers after the split, bf16, BLOCK_SIZE 128, the
ladder's caps (key-block kernel 248 at d = 64, dQ kernel 168): key-block kernel 237 (no mods) / 244-248 (causal,
document, softcap, causal + ALiBi) at d = 64, 253-255 at d = 128 (the ladder's v7: 245 / 239 by numba's report); dQ
kernel 164-168 at both. No spills, no stack frame, except 8 bytes at d = 128 with causal in the key-block kernel,
stored before its loop and loaded after it.

**Prediction (before any GPU run; nothing here is measured).** On full tiles without a score_mod the kernels are the
ladder's v7 plus one list load per step. Backward, bf16, N ≥ 4096 on an H200, counting model FLOPs (2.5 × the
forward's) of the kept scores: causal, sliding window, prefix-LM and document within 10-15 % of the ladder's v7
causal at d = 64 and 128 (its mask test per score of a diagonal tile becomes a mask_mod call, inlined), i.e. about
1.5-1.8× the v1-based kernel; ALiBi and relative_bias 10-25 % below (a bias load per score, twice: each kernel
recomputes it); softcap 25-45 % below at d = 64 (the double-precision tanh of the forward's header, twice, plus its
derivative), less at d = 128. What could break it: the key-block kernel at d = 128 sits at 253-255 registers, so a
heavier mod than the ready ones may spill; the dQ kernel's cap of 168 leaves mods little room; and a mod's calls
are made twice, so a mod that costs more than the MMAs of its score moves the balance back towards v1's single
kernel. Against issue 38's forward + backward target (≥ 1.0× PyTorch's compiled FlexAttention): plausible at
d = 128 if PyTorch's Triton backward runs near SDPA flash's, out of reach at d = 64 where the ladder's v7 itself is
0.68-0.81× SDPA flash's backward.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref

import numpy as np
from numba import cuda, float32, uint32

import kernels_gpu.runtime as rt
from fa2edu.flex import FULL, PARTIAL, SKIPPED, BlockMask, at_lengths
from kernels_gpu import driver_launch, ptx
from kernels_gpu.driver_launch import MAX_DYNAMIC_BYTES
from kernels_gpu.tensorcore import backward_launch, launch
from kernels_gpu.tensorcore import flash2_backward_v1 as backward_v1
from kernels_gpu.tensorcore import flash2_backward_v7 as backward_v7
from kernels_gpu.tensorcore.backward_steps import BackwardConfig, make_backward_steps
from kernels_gpu.tensorcore.steps import LOG2E, Config, device, make_steps

__all__ = ["flex_forward", "FORWARD_VERSIONS", "flex_forward_v11", "flex_forward_v4", "flex_backward",
           "BACKWARD_VERSIONS", "flex_backward_v7", "flex_backward_v1", "make_backward_kernel",
           "make_backward_dq_kernel", "make_backward_kernel_v1", "backward_config_for", "backward_config_for_v7",
           "backward_config_for_v1", "backward_tile", "kv_visit_table", "backward_walks_for", "backward_grids",
           "plan_backward_mods", "make_kernel", "config_for",
           "make_kernel_v4", "config_for_v4", "flex_tile", "shared_words", "visit_table", "walk_for", "planned_mods",
           "grid_for", "next_visited", "plan_mods", "compile_mods", "compile_score", "DEFAULT_BLOCK_SIZE",
           "V4_BLOCK_SIZE", "ARRAY_SLOTS"]

#: The BlockMask tile (B_r, B_c) a mask is retiled to when the default rung cannot run its own (``fa2edu._torch_ops``);
#: v11's kernel tiles (v10's table) lie inside it at every head dimension.
DEFAULT_BLOCK_SIZE = (128, 64)
#: Rung v4's tile when no block mask is given.
V4_BLOCK_SIZE = (64, 64)
#: Bound arrays the kernel takes, over all mods together (its arguments A0 … A3).
ARRAY_SLOTS = 4
_SLOT_NAMES = ", ".join(f"A{k}" for k in range(ARRAY_SLOTS))
_MASK_ARGS = "b, h, q_idx, kv_idx"
_SCORE_ARGS = "score, b, h, q_idx, kv_idx"


def _name(mod) -> str:
    return getattr(mod, "__name__", type(mod).__name__)


# -- rung v4's tile --------------------------------------------------------------------------------------------

def config_for_v4(d: int, dtype: str, block_size: tuple, simulated: bool) -> Config:
    """Rung v4's constants for a BlockMask's BLOCK_SIZE = (B_r, B_c): W = B_r / 16 warps of one 16-row MMA tile
    each, B_c keys per K/V tile. Raises ValueError naming the sizes it can run."""
    B_r, B_c = block_size
    if B_r % 16 or not 16 <= B_r <= 128 or B_c % 16 or not 16 <= B_c <= 128:
        raise ValueError(f"the flex kernel runs tiles (B_r, B_c) with B_r in 16, 32, …, 128 (16 query rows per "
                         f"warp) and B_c a multiple of 16 up to 128; the block mask has BLOCK_SIZE = "
                         f"{(B_r, B_c)}: make it with create_block_mask(..., BLOCK_SIZE=(64, 64)) (or 128, "
                         f"PyTorch's default, or (16, 16) for small problems)")
    cfg = Config(d=d, warps=B_r // 16, B_c=B_c, dtype=dtype, causal=False, simulated=simulated)
    nbytes = 4 * shared_words(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"BLOCK_SIZE = {(B_r, B_c)} at d = {d} needs {nbytes} bytes of shared memory, a block may "
                         f"have {MAX_DYNAMIC_BYTES}: make the block mask with a smaller BLOCK_SIZE, e.g. (64, 64)")
    return cfg


def shared_words(cfg: Config) -> int:
    """32-bit words of shared memory: Q_i, and two stages of K_j, V_j (RS words per row), as v4."""
    return cfg.B_r * cfg.RS + 4 * cfg.B_c * cfg.RS


# -- the mods as device functions -------------------------------------------------------------------------------

def _host_types(kind: str, arrays: tuple) -> tuple:
    """The numba types a mod is called with in the kernel: a float32 score, int64 indices, the bound arrays."""
    import numba
    ints = (numba.int64,) * 4
    lead = ((numba.float32,) + ints) if kind == "score" else ints
    return lead + tuple(numba.typeof(np.asarray(a)) for a in arrays)


class _Fn:
    """A mod's function as a cache key: equal when numba would compile the same device function. numba freezes a
    closure's cells and a function's globals as constants, so two closures of one code object over equal, hashable
    cells are the same program (``causal.at_lengths`` makes a new closure for each BlockMask, each with the same
    ``offset``). Any other function is its own key."""

    __slots__ = ("fn", "key")

    def __init__(self, fn):
        self.fn = fn
        try:
            cells = tuple((type(v), v) for v in (c.cell_contents for c in (fn.__closure__ or ())))
            self.key = (fn.__code__, cells, fn.__defaults__, id(fn.__globals__))
            hash(self.key)
        except (AttributeError, TypeError, ValueError):
            self.key = (id(fn), fn)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Fn) and self.key == other.key


@functools.lru_cache(maxsize=256)
def _typed_on_host(fn: _Fn, kind: str, types: tuple):
    """numba types ``fn`` on the CPU for the kernel's argument types. The simulator runs device functions as
    Python, so without this a mod that cannot compile would first fail on a GPU. It returns numba's error message,
    or None when the mod compiles."""
    import numba
    try:
        numba.njit(fn.fn).compile(types)
    except Exception as error:          # numba's TypingError, UnsupportedError, … (and errors of the mod itself)
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    return None


def _leaf(mod, role: str, kind: str, arrays: list):
    """One mod without composition, as a plan node ``("leaf", _Fn(fn), slots)``: the function numba compiles, and
    the kernel's array slots of the arrays bound to it (``bind``). An array already in ``arrays`` (the same object:
    ALiBi's slopes, bound to the score_mod and again to its derivative) keeps its slot; the others are appended."""
    fn, bound = (mod.mod, tuple(mod.arrays)) if hasattr(mod, "mod") and hasattr(mod, "arrays") else (mod, ())
    slots = []
    for a in bound:
        slot = next((s for s, held in enumerate(arrays) if held is a), None)
        if slot is None:
            if len(arrays) == ARRAY_SLOTS:
                raise ValueError(f"the flex kernel takes at most {ARRAY_SLOTS} bound arrays over all mods together; "
                                 f"{role} {_name(mod)} would need slot {len(arrays)}")
            slot = len(arrays)
            arrays.append(a)
        slots.append(slot)
    key = _Fn(fn)
    message = _typed_on_host(key, kind, _host_types(kind, bound))
    if message is not None:
        raise TypeError(f"{role} {_name(mod)} cannot be compiled for the GPU by numba (a mod must be a scalar "
                        f"function of plain Python, math and NumPy ufuncs, indexing only the arrays bound to it "
                        f"with fa2edu.flex.bind): {message}")
    return ("leaf", key, tuple(slots))


def _is_chain(mod) -> bool:
    from fa2edu.flex import chain_score_mods
    return getattr(mod, "combine", None) is chain_score_mods and bool(getattr(mod, "mods", None))


def _score_plan(mod, arrays: list, role: str = "score_mod"):
    """A score_mod as a plan: :func:`~fa2edu.flex.chain_score_mods` becomes ``("chain", part, part, …)`` (each part
    compiled on its own, applied in turn: numba cannot loop over a tuple of different functions), recursively."""
    if _is_chain(mod):
        return ("chain",) + tuple(_score_plan(part, arrays, role) for part in mod.mods)
    return _leaf(mod, role, "score", arrays)


def _chain_grad_plan(mod, arrays: list):
    """The derivative of a chain of score_mods as a plan, the chain rule: ``("chain_grad", (f₁, g₁), (f₂, g₂), …)``
    with fₖ each part and gₖ its ``score_mod_grad``; d/ds f₂(f₁(s)) = g₁(s)·g₂(f₁(s)). A part that is a chain
    itself is planned as one (its ``score_mod_grad`` is a chain's derivative too)."""
    parts = []
    for part in mod.mods:
        f = _score_plan(part, arrays, "score_mod")
        g = (_chain_grad_plan(part, arrays) if _is_chain(part)
             else _leaf(part.score_mod_grad, "score_mod_grad", "score", arrays))
        parts.append((f, g))
    return ("chain_grad",) + tuple(parts)


def _mask_plan(mod, arrays: list):
    """A mask_mod as a plan: or_masks / and_masks become ``("or" | "and", part, part, …)``, recursively."""
    from fa2edu.flex import and_masks, or_masks
    combine = getattr(mod, "combine", None)
    if combine in (or_masks, and_masks) and getattr(mod, "mods", None):
        word = "or" if combine is or_masks else "and"
        return (word,) + tuple(_mask_plan(part, arrays) for part in mod.mods)
    return _leaf(mod, "mask_mod", "mask", arrays)


def plan_mods(mask_mod, score_mod):
    """``(plan, arrays)``: what the kernel compiles for these mods — ``(mask plan, score plan)``, None for a missing
    mod, hashable, equal for mods numba compiles alike whatever arrays they bind — and the bound arrays in slot
    order (at most :data:`ARRAY_SLOTS`), which the kernel receives as arguments. Every function is typed by numba
    on the host first (a clear ``TypeError`` naming the mod if it cannot be compiled)."""
    arrays: list = []
    mask_plan = None if mask_mod is None else _mask_plan(mask_mod, arrays)
    score_plan = None if score_mod is None else _score_plan(score_mod, arrays)
    return (mask_plan, score_plan), tuple(arrays)


def _device_call(fn, kind: str, slots: tuple, jit):
    """``fn`` as a device function with the kernel's fixed arity: ``call(<mod's args>, A0, …, A3)`` calls
    ``fn(<mod's args>, A_slot, …)`` with the arrays of its own slots. The wrapper's source is one line, made for
    the slots (numba needs a fixed argument list, and Python cannot write "pick these slots" otherwise)."""
    args = _SCORE_ARGS if kind == "score" else _MASK_ARGS
    extra = "".join(f", A{s}" for s in slots)
    namespace = {"fn": jit(fn)}
    exec(f"def call({args}, {_SLOT_NAMES}):\n    return fn({args}{extra})\n", namespace)
    return jit(namespace["call"])


def _combine_calls(first, second, combine: str, jit):
    """Two compiled masks combined, short-circuiting: ``first or second`` (or_masks), ``first and second``
    (and_masks). The second is not called when the first decides."""
    if combine == "or":
        def either(b, h, q_idx, kv_idx, A0, A1, A2, A3):
            if first(b, h, q_idx, kv_idx, A0, A1, A2, A3):
                return True
            return second(b, h, q_idx, kv_idx, A0, A1, A2, A3)
        return jit(either)

    def both(b, h, q_idx, kv_idx, A0, A1, A2, A3):
        if not first(b, h, q_idx, kv_idx, A0, A1, A2, A3):
            return False
        return second(b, h, q_idx, kv_idx, A0, A1, A2, A3)
    return jit(both)


def _compile_mask(node, jit):
    if node[0] == "leaf":
        return _device_call(node[1].fn, "mask", node[2], jit)
    calls = [_compile_mask(part, jit) for part in node[1:]]
    call = calls[-1]
    for earlier in reversed(calls[:-1]):
        call = _combine_calls(earlier, call, node[0], jit)
    return call


def _then(first, second, jit):
    """Two compiled score_mods in turn: ``second(first(score, …), …)`` (:func:`~fa2edu.flex.chain_score_mods`)."""
    def then(score, b, h, q_idx, kv_idx, A0, A1, A2, A3):
        return second(first(score, b, h, q_idx, kv_idx, A0, A1, A2, A3), b, h, q_idx, kv_idx, A0, A1, A2, A3)
    return jit(then)


def _chain_rule(f, g, rest, jit):
    """The derivative of ``rest ∘ f`` at score: ``g(score) · rest'(f(score))`` (compiled, the kernel's arity)."""
    def chained(score, b, h, q_idx, kv_idx, A0, A1, A2, A3):
        inner = f(score, b, h, q_idx, kv_idx, A0, A1, A2, A3)
        return (g(score, b, h, q_idx, kv_idx, A0, A1, A2, A3)
                * rest(inner, b, h, q_idx, kv_idx, A0, A1, A2, A3))
    return jit(chained)


def compile_score(node, jit):
    """A score plan (a leaf, a ``"chain"`` or a ``"chain_grad"``) as one device function of the kernel's arity."""
    if node[0] == "leaf":
        return _device_call(node[1].fn, "score", node[2], jit)
    if node[0] == "chain":
        call = compile_score(node[1], jit)
        for part in node[2:]:
            call = _then(call, compile_score(part, jit), jit)
        return call
    # "chain_grad": from the last part back, d/ds (fₙ ∘ … ∘ f₁) = g₁(s) · (d/ds' fₙ ∘ … ∘ f₂)(f₁(s))
    (f_last, g_last) = node[-1]
    call = compile_score(g_last, jit)
    for f, g in reversed(node[1:-1]):
        call = _chain_rule(compile_score(f, jit), compile_score(g, jit), call, jit)
    return call


def compile_mods(plan, simulated: bool):
    """``(mask_call, score_call)``: a :func:`plan_mods` plan as device functions of the kernel's fixed arity. A
    missing mod gets a stand-in that keeps every score (mask) or returns it unchanged (score). The kernel never
    calls either, because its flags HAS_MASK, HAS_SCORE are compile-time constants."""
    jit = device(simulated)
    mask_plan, score_plan = plan
    if mask_plan is None:
        def keep_all(b, h, q_idx, kv_idx, A0, A1, A2, A3):
            return True
        mask_call = jit(keep_all)
    else:
        mask_call = _compile_mask(mask_plan, jit)
    if score_plan is None:
        def unchanged(score, b, h, q_idx, kv_idx, A0, A1, A2, A3):
            return score
        score_call = jit(unchanged)
    else:
        score_call = compile_score(score_plan, jit)
    return mask_call, score_call


# -- rung v4: the kernel ----------------------------------------------------------------------------------------

def next_visited(classes: np.ndarray, i: int, j: int) -> int:
    """Host twin of the kernel's walk: the first key block j' ≥ j of row block i that is not skipped (T_c if none).
    ``classes`` is one (b, h)'s (T_r, T_c) array."""
    T_c = classes.shape[-1]
    while j < T_c and classes[i, j] == SKIPPED:
        j += 1
    return j


@functools.lru_cache(maxsize=64)
def make_kernel_v4(cfg: Config, plan):
    """Rung v4's flex kernel for one tile shape and one :func:`plan_mods` plan (compiled on first launch, once per
    argument types). The arrays bound to the mods are its arguments A0 … A3: new document ids, slopes or tables
    reuse the kernel."""
    mask_call, score_call = compile_mods(plan, cfg.simulated)
    HAS_MASK, HAS_SCORE = plan[0] is not None, plan[1] is not None
    st = make_steps(cfg)
    jit = device(cfg.simulated)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async"], st["copy_kv_async"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax_f32"], st["finish_rows_exp2"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    K_OFF = B_r * RS                         # word offsets in the one shared array: Q_i, then
    V_OFF = K_OFF + B_c * RS                 # stage 0 (K, V), then stage 1 (K, V)
    STAGE = 2 * B_c * RS
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)
    neg_inf = float32(-math.inf)
    one_log2 = float32(LOG2E)                # the scores are already scaled: exp(x) = 2^(x·log₂e)
    SKIP, PART = np.int8(SKIPPED), np.int8(PARTIAL)

    @jit
    def next_tile(C, bz, bh, i, j, T_c):
        """FA1 Alg. 5 line 8: the first key block j' ≥ j of row block i that the BlockMask does not skip."""
        while j < T_c and C[bz, bh, i, j] == SKIP:
            j += 1
        return j

    @jit
    def modify_row(s, hr, row, col0, N_q, N_k, kind, scale, z, head, A0, A1, A2, A3):
        """Alg. 1 line 8 for one of the lane's two rows (hr = 0: row g, 1: row g + 8), in place: S ← τ·S, then
        FlexAttention's MASK(score_mod(S)). mask_mod runs only in partial blocks, and score_mod only on the
        scores the mask keeps. Keys past N_k and padding rows past N_q (their mods are never called: a mod may
        index arrays of N_q or N_k entries) get −∞."""
        for n in range(NT):
            for e in range(2):
                k = 4 * n + 2 * hr + e
                col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                x = s[k] * scale
                if row >= N_q or col >= N_k:
                    x = neg_inf
                elif HAS_MASK and kind == PART and not mask_call(z, head, row, col, A0, A1, A2, A3):
                    x = neg_inf
                elif HAS_SCORE:
                    x = score_call(x, z, head, row, col, A0, A1, A2, A3)
                s[k] = x

    @cuda.jit
    def flex_forward_tc(Q, K, V, O, L, C, N_q, N_k, G, scale, A0, A1, A2, A3):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        i = cuda.blockIdx.x                   # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        h = cuda.blockIdx.y                   # query head (score_mod's and mask_mod's h)
        z = cuda.blockIdx.z                   # batch entry (the mods' b)
        hk = h // G                           # GQA: query head h reads key/value head h // G
        bz = z if C.shape[0] > 1 else 0       # a BlockMask of B = 1 or H = 1 broadcasts
        bh = h if C.shape[1] > 1 else 0
        T_c = C.shape[3]
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words
        s = cuda.local.array(S_LEN, float32)
        o = cuda.local.array(O_LEN, float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * warp + g        # this lane's first row; its second is row0 + 8

        # Alg. 1 lines 4 and 7 (first visited j): start the copies of Q_i, K_j, V_j, as one group.
        j = next_tile(C, bz, bh, i, 0, T_c)
        copy_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        if j < T_c:
            copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
            copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers).
        zero(o, O_LEN)
        init_stats(m, l)
        # Alg. 1 line 6: for j = 1 … T_c, the skipped blocks left out (FA1 Alg. 5 line 8); t counts visits.
        t = 0
        while j < T_c:
            stage = (t % 2) * STAGE
            kind = C[bz, bh, i, j]
            # Line 7 for the next visited tile, started now, lands while tile j is computed.
            j_next = next_tile(C, bz, bh, i, j + 1, T_c)
            if j_next < T_c:
                copy_kv(sm, K_OFF + STAGE - stage, K, z, hk, j_next * B_c, N_k, tid)
                copy_kv(sm, V_OFF + STAGE - stage, V, z, hk, j_next * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8: S_ij = Q_i K_jᵀ, the warp's 16 rows, two 16 × 8 tiles per ldmatrix of K.
            zero(s, S_LEN)
            for kk in range(KS):
                a0, a1, a2, a3 = ldmatrix(sm, (16 * warp + lane % 16) * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    k_row = K_OFF + stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s, 2 * p + 1, a0, a1, a2, a3, b2, b3)

            # Line 8, FlexAttention: S ← MASK(score_mod(τ·S)), mask_mod per score of a partial block only.
            modify_row(s, 0, row0, j * B_c, N_q, N_k, kind, scale, z, h, A0, A1, A2, A3)
            modify_row(s, 1, row0 + 8, j * B_c, N_q, N_k, kind, scale, z, h, A0, A1, A2, A3)
            # Lines 9-10: the online softmax on the final scores (scale 1, no mask of its own: done above).
            online_softmax(s, o, m, l, row0, j * B_c, N_k, one_log2, 0, False)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators.
            for kk in range(KV):
                a0 = pack(s[8 * kk], s[8 * kk + 1])
                a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
                a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
                a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
                for p in range(NO // 2):
                    v_row = V_OFF + stage + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o, 2 * p + 1, a0, a1, a2, a3, b2, b3)
            cuda.syncthreads()                # this stage is free for the visit after next
            j = j_next
            t += 1

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i (O = 0, L = +∞ for a row that kept no score).
        finish_rows(o, m, l, O, L, z, h, row0, N_q, one_log2)

    return flex_forward_tc


# -- checks and launch ------------------------------------------------------------------------------------------

def _check_mods(score_mod, block_mask, p) -> BlockMask | None:
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx) -> score or None, got "
                        f"{type(score_mod).__name__}")
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a fa2edu.BlockMask (from fa2edu.create_block_mask) or None, got "
                        f"{type(block_mask).__name__}")
    if (block_mask.Q_LEN, block_mask.KV_LEN) != (p.N_q, p.N_k):
        raise ValueError(f"block_mask was made for Q_LEN = {block_mask.Q_LEN}, KV_LEN = {block_mask.KV_LEN}, but q "
                         f"has N_q = {p.N_q} queries and k has N_k = {p.N_k} keys")
    if block_mask.B not in (1, p.Z) or block_mask.H not in (1, p.H_q):
        raise ValueError(f"block_mask covers (B, H) = ({block_mask.B}, {block_mask.H}); q has (B, H) = "
                         f"({p.Z}, {p.H_q}): each must match or be 1 (broadcast)")
    return block_mask


def _on_device(a):
    """A bound array as the kernel reads it: numba device arrays and CUDA-array-interface objects in place,
    anything else (NumPy, lists, CPU tensors) copied to the device, C-contiguous."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    if hasattr(a, "__cuda_array_interface__") and not rt.simulator_in_use():
        return cuda.as_cuda_array(a)
    if hasattr(a, "numpy"):                      # a CPU tensor
        a = a.detach().numpy()
    return cuda.to_device(np.ascontiguousarray(a))


def _device_copy(a):
    """:func:`_on_device` with the copies of host arrays (NumPy arrays, CPU tensors) kept per array object, so that
    a repeated call with the same bound arrays copies nothing: a host array is read once, when first seen (change
    its contents in place and the kernel keeps reading the old copy: bind a new array instead). Device arrays and
    CUDA tensors are used in place, as :func:`_on_device` does; lists (no weak references) are copied per call."""
    if getattr(a, "__cuda_ndarray__", False) or (hasattr(a, "__cuda_array_interface__")
                                                  and not rt.simulator_in_use()):
        return _on_device(a)
    key = id(a)
    found = _DEVICE_COPIES.get(key)
    if found is not None and found[0]() is a:
        return found[1]
    try:
        ref = weakref.ref(a, lambda _, key=key: _DEVICE_COPIES.pop(key, None))
    except TypeError:                            # (no weak references: a list, a tuple)
        return _on_device(a)
    copy = _on_device(a)
    _DEVICE_COPIES[key] = (ref, copy)
    return copy


#: device copies of bound host arrays: id(array) → (weak reference to it, its device copy)
_DEVICE_COPIES: dict = {}


@functools.lru_cache(maxsize=None)
def _unused_slot(simulated: bool):
    """The 1-element device array that fills the array slots no mod uses (made once)."""
    return cuda.to_device(np.zeros(1, np.float32))


def _bound_on_device(arrays: tuple) -> list:
    """The kernel's arguments A0 … A3: the bound arrays on the device (:func:`_device_copy`), then fillers."""
    bound = [_device_copy(a) for a in arrays]
    return bound + [_unused_slot(rt.simulator_in_use())] * (ARRAY_SLOTS - len(bound))


def _checked_problem(Q, K, V, score_mod, block_mask, scale, enable_gqa):
    """The checks every forward rung makes, and ``(problem, block_mask)`` (:func:`launch.prepare`'s Problem)."""
    for x, name in ((Q, "Q"), (K, "K"), (V, "V")):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must have 4 axes (B, H, N, d), as flex_attention, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if Q.shape[1] != K.shape[1] and not enable_gqa:
        raise ValueError(f"Q has H = {Q.shape[1]} heads but K and V have {K.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention, or give K and V Q's heads")
    p = launch.prepare(Q, K, V, causal=False, scale=scale)
    return p, _check_mods(score_mod, block_mask, p)


def _launch_mods(kernel, grid, threads, p, args, nbytes, mask_mod, score_mod) -> None:
    """Launch a flex kernel; numba's compile errors (a mod the kernel's types break) become a TypeError naming
    the mods."""
    try:
        driver_launch.launch(kernel, grid, threads, p.stream, args, nbytes)
    except Exception as error:
        compile_error = type(error).__module__.startswith("numba") and type(error).__name__ in (
            "TypingError", "LoweringError", "UnsupportedError", "NumbaError")
        if not compile_error:                 # (a driver error, a launch failure: not the mods' fault)
            raise
        raise TypeError(f"numba could not compile the flex kernel with mask_mod "
                        f"{'None' if mask_mod is None else _name(mask_mod)} and score_mod "
                        f"{'None' if score_mod is None else _name(score_mod)}: {error}") from error


def flex_forward_v4(Q, K, V, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    """Rung v4's FlexAttention forward (:func:`make_kernel_v4`), kept so that its measurements stay reproducible:
    :func:`flex_forward`'s arguments and result. The BlockMask's BLOCK_SIZE is the kernel's tile
    (:func:`config_for_v4`); no block mask: every block full at (64, 64). Host cost per call: the classes and the
    bound arrays copied to the device, the mods planned."""
    from kernels_gpu.flash2 import Flash2Forward

    p, block_mask = _checked_problem(Q, K, V, score_mod, block_mask, scale, enable_gqa)
    block_size = V4_BLOCK_SIZE if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    cfg = config_for_v4(p.d, p.dtype, block_size, rt.simulator_in_use())
    mask_mod = None if block_mask is None else block_mask.mask_mod
    score_mod = None if score_mod is None else at_lengths(score_mod, p.N_q, p.N_k)
    plan, arrays = plan_mods(mask_mod, score_mod)
    kernel = make_kernel_v4(cfg, plan)
    if block_mask is None:
        classes = np.full((1, 1, rt.grid_size(p.N_q, cfg.B_r), rt.grid_size(p.N_k, cfg.B_c)), FULL, np.int8)
    else:
        classes = np.ascontiguousarray(block_mask.classes, dtype=np.int8)
    bound = [_on_device(a) for a in arrays]
    bound += [cuda.to_device(np.zeros(1, np.float32))] * (ARRAY_SLOTS - len(bound))
    args = (p.Q, p.K, p.V, p.O, p.L, cuda.to_device(classes), np.int32(p.N_q), np.int32(p.N_k),
            np.int32(p.H_q // p.H_kv), np.float32(p.scale), *bound)
    grid = (rt.grid_size(p.N_q, cfg.B_r), p.H_q, p.Z)
    _launch_mods(kernel, grid, cfg.threads, p, args, 4 * shared_words(cfg), mask_mod, score_mod)
    return Flash2Forward(*launch.finish(p))


# -- rung v11: the mods on the ladder's fastest forward -----------------------------------------------------------

def flex_tile(d: int, mods: bool = True) -> tuple:
    """Rung v11's preferred tile for head dimension d: (row tiles per warp R, B_r, B_c), 4 warps. v10's table
    (:mod:`kernels_gpu.tensorcore.flash2_forward_v10`: (2, 128, 32) at d ≤ 64, (2, 128, 64) at d ≤ 128, (1, 64, 32)
    above) with one change: at 64 < d ≤ 128 a kernel that calls mods takes B_c = 32. ptxas (sm_90a, no GPU) gives
    the B_c = 64 kernel 255 registers and 56-228 bytes of spills once a mask_mod or score_mod is compiled in (the
    ladder's v11: 8 bytes, outside its loop), and the B_c = 32 kernel 241-254 registers and none; without mods,
    v10's B_c = 64 (255 registers, 4 bytes of spills, none stored in the loop)."""
    if d <= 64:
        return (2, 128, 32)
    if d <= 128:
        return (2, 128, 32 if mods else 64)
    return (1, 64, 32)


def config_for(d: int, dtype: str, block_size: tuple, simulated: bool, mods: bool = True,
               B_c: int | None = None) -> Config:
    """Rung v11's kernel constants for a BlockMask's BLOCK_SIZE = (B_r, B_c), both multiples of 16.

    The kernel tile is :func:`flex_tile`'s for ``d`` (v10's, 2 row tiles per warp up to d = 128) shrunk to the
    largest tile that divides the BlockMask's block, gcd(B_r', B_r) × gcd(B_c', B_c), so that every kernel tile
    lies inside one block and takes its class: BLOCK_SIZE = 128 (PyTorch's default) runs the preferred tiles
    unchanged, (64, 64) runs 64-row tiles (2 warps of 2 row tiles), (16, 16) one warp of one. ``mods``: whether a
    mask_mod or score_mod is compiled in (:func:`flex_tile`); ``B_c``: the preferred key-tile width instead of
    the table's (a multiple of 16; to measure the other choice). Raises ValueError naming the sizes it can run."""
    B_r, B_c_mask = block_size
    if B_r % 16 or B_r < 16 or B_c_mask % 16 or B_c_mask < 16:
        raise ValueError(f"the flex kernel runs block masks whose BLOCK_SIZE (B_r, B_c) are multiples of 16; the "
                         f"block mask has BLOCK_SIZE = {(B_r, B_c_mask)}: make it with create_block_mask(..., "
                         f"BLOCK_SIZE=128) (PyTorch's default, the kernel's fastest tiles), or (16, 16) for small "
                         f"problems")
    R, pref_r, pref_c = flex_tile(d, mods)
    if B_c is not None:
        if isinstance(B_c, bool) or not isinstance(B_c, (int, np.integer)) or B_c % 16 or not 16 <= B_c <= 128:
            raise ValueError(f"B_c must be a multiple of 16 from 16 to 128, got {B_c!r}")
        pref_c = int(B_c)
    tile_r, tile_c = math.gcd(pref_r, B_r), math.gcd(pref_c, B_c_mask)
    if tile_r < 16 * R:
        R = 1
    cfg = Config(d=d, warps=tile_r // (16 * R), B_c=tile_c, dtype=dtype, causal=False, simulated=simulated,
                 row_tiles=R)
    nbytes = 4 * shared_words(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:            # (not reached by these tiles at d ≤ 256; kept as the guard)
        raise ValueError(f"BLOCK_SIZE = {(B_r, B_c_mask)} at d = {d} needs {nbytes} bytes of shared memory, a "
                         f"block may have {MAX_DYNAMIC_BYTES}")
    return cfg


def visit_table(classes: np.ndarray, block_size: tuple, tile: tuple, N_q: int, N_k: int) -> tuple:
    """The walk of every kernel row block, worked out on the host once per BlockMask and tile (FA1 Alg. 5 line 8's
    "skip the zero blocks", as a list: PyTorch's ``kv_num_blocks`` / ``kv_indices``).

    ``classes`` (B, H, T_r, T_c) are the BlockMask's, of blocks ``block_size``; the kernel's tile (B_r', B_c')
    divides them, so kernel tile (i', j') lies inside block (i'·B_r' // B_r, j'·B_c' // B_c) and takes its class.
    Returns ``(counts, visits, order)``, int32: ``counts[b, h, i']`` the tiles row block i' visits;
    ``visits[b, h, i', t]`` the t-th of them, in increasing j', coded 2·j' + 1 for a partial tile and 2·j' for a
    full one (−1 past the count); ``order[b, h, :]`` the row blocks by decreasing count (longest first, ties in
    index order). Cost O(B·H·T_r'·T_c'·log T_c'), memory B·H·T_r'·max(counts) words."""
    B_r, B_c = block_size
    tile_r, tile_c = tile
    T_r, T_c = -(-N_q // tile_r), -(-N_k // tile_c)
    rows = (np.arange(T_r) * tile_r) // B_r               # the block each kernel row block lies in
    cols = (np.arange(T_c) * tile_c) // B_c
    kinds = np.asarray(classes, dtype=np.int8)[:, :, rows][:, :, :, cols]       # (B, H, T_r', T_c')
    visited = kinds != SKIPPED
    counts = visited.sum(axis=-1).astype(np.int32)
    width = max(1, int(counts.max()))
    # the visited tiles first, each group in increasing j' (a stable sort of "not visited")
    index = np.argsort(~visited, axis=-1, kind="stable")[..., :width]
    codes = 2 * index + (np.take_along_axis(kinds, index, axis=-1) == PARTIAL)
    codes[np.arange(width) >= counts[..., None]] = -1
    order = np.argsort(-counts, axis=-1, kind="stable")
    return tuple(np.ascontiguousarray(x, dtype=np.int32) for x in (counts, codes, order))


class _Walk:
    """A :func:`visit_table` on the device, with the classes array it was made from (``source``) and whether its
    row blocks differ in length (``ordered``: then the kernel launches the longest first)."""

    __slots__ = ("source", "host", "counts", "visits", "order", "ordered")

    def __init__(self, source, counts, visits, order):
        self.source, self.host = source, (counts, visits, order)
        self.counts, self.visits, self.order = (cuda.to_device(x) for x in (counts, visits, order))
        self.ordered = bool((counts != counts[..., :1]).any())


#: walks per BlockMask (weakly: a walk lives as long as its BlockMask), {(B_r', B_c'): _Walk}
_WALKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WALKS_LOCK = threading.Lock()


@functools.lru_cache(maxsize=64)
def _full_walk(N_q: int, N_k: int, tile: tuple, simulated: bool) -> _Walk:
    """The walk without a block mask: every tile full, every row block alike."""
    classes = np.full((1, 1, -(-N_q // tile[0]), -(-N_k // tile[1])), FULL, np.int8)
    return _Walk(None, *visit_table(classes, tile, tile, N_q, N_k))


def walk_for(block_mask, cfg: Config, N_q: int, N_k: int) -> _Walk:
    """The device walk of ``block_mask`` (None: every block full) at ``cfg``'s tile, made on the first call and
    kept with the BlockMask: a repeated call copies nothing. (A BlockMask whose ``classes`` attribute is replaced
    gets a new walk; one whose classes are changed in place keeps the old one: make a new BlockMask.)"""
    tile = (cfg.B_r, cfg.B_c)
    if block_mask is None:
        return _full_walk(N_q, N_k, tile, cfg.simulated)
    with _WALKS_LOCK:
        found = _WALKS.get(block_mask, {}).get(tile)
    if found is not None and found.source is block_mask.classes:
        return found
    walk = _Walk(block_mask.classes, *visit_table(block_mask.classes, block_mask.BLOCK_SIZE, tile, N_q, N_k))
    with _WALKS_LOCK:
        _WALKS.setdefault(block_mask, {})[tile] = walk
    return walk


#: mod plans by (mask_mod, score_mod, N_q, N_k) identity: (mask_mod, score_mod, plan, arrays), the mods held so
#: that their ids stay theirs while the entry lives
_MOD_PLANS = driver_launch.PlanCache(64)


def planned_mods(mask_mod, score_mod, N_q: int, N_k: int) -> tuple:
    """:func:`plan_mods` of ``mask_mod`` and ``score_mod`` specialised to the lengths (:func:`at_lengths`), made
    once per pair of mod objects: ``(plan, arrays)``. (A mod is planned when first seen: a closure whose captured
    variables are rebound afterwards keeps its first plan; make a new mod.)"""
    key = (id(mask_mod), id(score_mod), N_q, N_k)
    found = _MOD_PLANS.get(key)
    if found is not None and found[0] is mask_mod and found[1] is score_mod:
        return found[2], found[3]
    plan, arrays = plan_mods(mask_mod, None if score_mod is None else at_lengths(score_mod, N_q, N_k))
    _MOD_PLANS[key] = (mask_mod, score_mod, plan, arrays)
    return plan, arrays


@functools.lru_cache(maxsize=64)
def make_kernel(cfg: Config, plan, ordered: bool = False):
    """Rung v11's flex kernel for one tile shape (:func:`config_for`), one :func:`plan_mods` plan and one launch
    order (compiled on first launch, once per argument types). ``ordered``: the grid is (heads, batch, row
    blocks) and row block ``order[b, h, blockIdx.z]`` runs, the longest first; otherwise (row blocks, heads,
    batch), v10's. Arguments: Q, K, V, O, L (uint32 words, float32 L), the walk (``counts``, ``visits``,
    ``order``: :func:`visit_table`), N_q, N_k, G, τ, and the bound arrays A0 … A3."""
    mask_call, score_call = compile_mods(plan, cfg.simulated)
    HAS_MASK, HAS_SCORE = plan[0] is not None, plan[1] is not None
    ORDERED = bool(ordered)
    st = make_steps(cfg)
    jit = device(cfg.simulated)
    copy_q, copy_kv, zero, init_stats = st["copy_q_async_inc"], st["copy_kv_async_inc"], st["zero"], st["init_stats"]
    online_softmax, finish_rows, mma_into = st["online_softmax_f32"], st["finish_rows_exp2"], st["mma_into"]
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    pack = ptx.pack_f16x2 if cfg.dtype == "float16" else ptx.pack_bf16x2
    B_r, B_c, RS, NT, NO, R = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT, cfg.NO, cfg.row_tiles
    KS = cfg.D // 16                         # 16-wide k-steps of S = Q Kᵀ
    KV = B_c // 16                           # 16-wide k-steps of O += P V
    K_OFF = B_r * RS                         # word offsets of the tiles in the one shared array: Q_i, then
    V_OFF = K_OFF + B_c * RS                 # stage 0 (K, V), then stage 1 (K, V)
    STAGE = 2 * B_c * RS
    S_LEN, O_LEN = 4 * NT, 4 * NO           # register-array lengths (compile-time constants)
    S1_LEN, O1_LEN = (S_LEN, O_LEN) if R == 2 else (1, 1)   # the second row tile's arrays (a stub when R = 1)
    neg_inf = float32(-math.inf)
    log2e = float32(LOG2E)

    @jit
    def modify_half(s, hr, row, col0, N_q, N_k, partial, edge, scale, z, head, A0, A1, A2, A3):
        """Alg. 1 line 8, FlexAttention's part, for one of the lane's two rows of a row tile (hr = 0: row g,
        1: row g + 8; a constant, so that every index into ``s`` is one), in place. With a score_mod: S ← τ·S,
        then score_mod on each kept score; without one, S stays raw (τ is folded into the softmax's exponent, as
        v5). A partial tile drops what mask_mod drops (−∞). ``edge`` (the tile reaches past N_q or N_k): padding
        rows and keys get −∞ and no mod call — a mod may index arrays of N_q or N_k entries."""
        for n in range(NT):
            for e in range(2):
                k = 4 * n + 2 * hr + e
                col = col0 + 8 * n + 2 * (cuda.laneid % 4) + e
                x = s[k]
                if HAS_SCORE:
                    x = x * scale
                if edge and (row >= N_q or col >= N_k):
                    x = neg_inf
                elif HAS_MASK and partial and not mask_call(z, head, row, col, A0, A1, A2, A3):
                    x = neg_inf
                elif HAS_SCORE:
                    x = float32(score_call(x, z, head, row, col, A0, A1, A2, A3))
                s[k] = x

    @jit
    def modify_tile(s, row, col0, N_q, N_k, partial, edge, scale, z, head, A0, A1, A2, A3):
        """:func:`modify_half` for both rows of a lane in one 16-row tile (rows ``row`` and ``row + 8``)."""
        modify_half(s, 0, row, col0, N_q, N_k, partial, edge, scale, z, head, A0, A1, A2, A3)
        modify_half(s, 1, row + 8, col0, N_q, N_k, partial, edge, scale, z, head, A0, A1, A2, A3)

    @cuda.jit
    def flex_forward_tc_v11(Q, K, V, O, L, counts, visits, order, N_q, N_k, G, scale, A0, A1, A2, A3):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        if ORDERED:                           # grid (heads, batch, row blocks): the longest row blocks first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
        else:                                 # grid (row blocks, heads, batch), as up to v10
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        bz = z if counts.shape[0] > 1 else 0  # a BlockMask of B = 1 or H = 1 broadcasts
        bh = h if counts.shape[1] > 1 else 0
        if ORDERED:
            i = order[bz, bh, cuda.blockIdx.z]
        else:
            i = cuda.blockIdx.x               # row block i (FA2 Alg. 1 line 3: one block per i, in parallel)
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)     # dynamic shared memory, as 32-bit words
        # The warp's R row tiles (v7), each with its own S/P̃ and Õ accumulators and statistics: rows
        # 16R·w … 16R·w + 15 (suffix 0), and 16 more (suffix 1; stubs when R = 1).
        s0 = cuda.local.array(S_LEN, float32)
        s1 = cuda.local.array(S1_LEN, float32)
        o0 = cuda.local.array(O_LEN, float32)
        o1 = cuda.local.array(O1_LEN, float32)
        m0 = cuda.local.array(2, float32)
        m1 = cuda.local.array(2, float32)
        l0 = cuda.local.array(2, float32)
        l1 = cuda.local.array(2, float32)
        row0 = i * B_r + 16 * R * warp + g    # this lane's first row of tile 0; tile 1's is row0 + 16
        q_row = (16 * R * warp + lane % 16) * RS   # the row this lane addresses in ldmatrix of Q (tile 0)
        # The statistics' units: raw scores (τ·log₂e in the exponent, v5) without a score_mod, the modified
        # scores (log₂e) with one — the same for every tile of the row.
        soft_scale = log2e if HAS_SCORE else scale * log2e
        rows_edge = (i + 1) * B_r > N_q       # the last row block holds padding rows
        n_visits = counts[bz, bh, i]          # FA1 Alg. 5 line 8: the tiles not skipped, listed on the host

        # Alg. 1 lines 4 and 7 (first visited tile): start the copies of Q_i, K_j, V_j, as one group.
        copy_q(sm, 0, Q, z, h, i * B_r, N_q, tid)
        code = visits[bz, bh, i, 0]           # 2·j + 1 for a partial tile, 2·j for a full one
        if n_visits > 0:
            copy_kv(sm, K_OFF, K, z, hk, (code >> 1) * B_c, N_k, tid)
            copy_kv(sm, V_OFF, V, z, hk, (code >> 1) * B_c, N_k, tid)
        ptx.cp_async_commit()
        # Alg. 1 line 5: O_i = 0, ℓ_i = 0, m_i = −∞ (in registers), for each row tile.
        zero(o0, O_LEN)
        init_stats(m0, l0)
        if R == 2:
            zero(o1, O_LEN)
            init_stats(m1, l1)
        # Alg. 1 line 6: for the visited j (skipped blocks never loaded: FA1 Alg. 5 line 8).
        for t in range(n_visits):
            stage = (t % 2) * STAGE
            j = code >> 1
            partial = (code & 1) != 0
            # Line 7 for the next visited tile, started now, lands while tile j is computed.
            code_next = code
            if t + 1 < n_visits:
                code_next = visits[bz, bh, i, t + 1]
                copy_kv(sm, K_OFF + STAGE - stage, K, z, hk, (code_next >> 1) * B_c, N_k, tid)
                copy_kv(sm, V_OFF + STAGE - stage, V, z, hk, (code_next >> 1) * B_c, N_k, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_one()           # this thread's copies of tile j (and Q_i) have landed ...
            cuda.syncthreads()                # ... and everyone's

            # Line 8: S_ij = Q_i K_jᵀ for the warp's rows: each K fragment (two 16 × 8 tiles of keys) is
            # multiplied into every row tile.
            zero(s0, S_LEN)
            if R == 2:
                zero(s1, S_LEN)
            for kk in range(KS):
                # A: lanes 0-15 address rows 0-15 of the tile at word 8kk, lanes 16-31 the same rows 4 words on.
                a0, a1, a2, a3 = ldmatrix(sm, q_row + 8 * kk + 4 * (lane // 16))
                if R == 2:
                    c0, c1, c2, c3 = ldmatrix(sm, q_row + 16 * RS + 8 * kk + 4 * (lane // 16))
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    k_row = K_OFF + stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    mma_into(s0, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(s0, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                    if R == 2:
                        mma_into(s1, 2 * p, c0, c1, c2, c3, b0, b1)
                        mma_into(s1, 2 * p + 1, c0, c1, c2, c3, b2, b3)

            # Line 8, FlexAttention: S ← MASK(score_mod(τS)) — mask_mod only in a partial tile, score_mod on every
            # kept score; a full tile without a score_mod is left as it is (v11's inner loop exactly).
            ragged = (j + 1) * B_c > N_k      # the last tile holds keys past N_k
            if HAS_SCORE or (HAS_MASK and partial):
                edge = ragged or rows_edge
                modify_tile(s0, row0, j * B_c, N_q, N_k, partial, edge, scale, z, h, A0, A1, A2, A3)
                if R == 2:
                    modify_tile(s1, row0 + 16, j * B_c, N_q, N_k, partial, edge, scale, z, h, A0, A1, A2, A3)
            # Lines 9-10: the online softmax of each row tile (base 2, rescale only when the maximum moves; keys
            # past N_k masked on the ragged tile alone, v6).
            online_softmax(s0, o0, m0, l0, row0, j * B_c, N_k, soft_scale, 0, ragged)
            if R == 2:
                online_softmax(s1, o1, m1, l1, row0 + 16, j * B_c, N_k, soft_scale, 0, ragged)

            # Line 10 (second half): Õ_i += P̃_ij V_j, 16 keys per k-step; A comes straight from S's accumulators,
            # and each V fragment serves every row tile.
            for kk in range(KV):
                a0 = pack(s0[8 * kk], s0[8 * kk + 1])
                a1 = pack(s0[8 * kk + 2], s0[8 * kk + 3])
                a2 = pack(s0[8 * kk + 4], s0[8 * kk + 5])
                a3 = pack(s0[8 * kk + 6], s0[8 * kk + 7])
                if R == 2:
                    c0 = pack(s1[8 * kk], s1[8 * kk + 1])
                    c1 = pack(s1[8 * kk + 2], s1[8 * kk + 3])
                    c2 = pack(s1[8 * kk + 4], s1[8 * kk + 5])
                    c3 = pack(s1[8 * kk + 6], s1[8 * kk + 7])
                for p in range(NO // 2):
                    # B (transposed on the way): lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7,
                    # columns 16p + 8(u // 2) …
                    v_row = V_OFF + stage + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RS + 8 * p + 4 * (lane // 16)
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o0, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o0, 2 * p + 1, a0, a1, a2, a3, b2, b3)
                    if R == 2:
                        mma_into(o1, 2 * p, c0, c1, c2, c3, b0, b1)
                        mma_into(o1, 2 * p + 1, c0, c1, c2, c3, b2, b3)
            cuda.syncthreads()                # this stage is free for the visit after next
            code = code_next

        ptx.cp_async_wait_all()               # (a block with no tile to visit still started its Q_i copy)
        # Lines 12-15: O_i = diag(ℓ_i)⁻¹ Õ_i, L_i = m_i + log ℓ_i (O = 0, L = +∞ for a row that kept no score),
        # written to HBM once, per row tile.
        finish_rows(o0, m0, l0, O, L, z, h, row0, N_q, soft_scale)
        if R == 2:
            finish_rows(o1, m1, l1, O, L, z, h, row0 + 16, N_q, soft_scale)

    return flex_forward_tc_v11


def grid_for(cfg: Config, p, ordered: bool) -> tuple:
    """v11's launch grid: (heads, batch, row blocks) when the row blocks differ in length (the kernel reads
    ``order``: the longest first), else v10's (row blocks, heads, batch), whose consecutive blocks share a head's
    K and V in L2."""
    T_r = rt.grid_size(p.N_q, cfg.B_r)
    return (p.H_q, p.Z, T_r) if ordered else (T_r, p.H_q, p.Z)


#: plans of repeated calls on PyTorch CUDA tensors (the driver-level launch): what a call needs beyond its outputs
_PLANS = driver_launch.PlanCache()


def _plan_key(tensors, score_mod, block_mask, scale, enable_gqa, B_c):
    """The key of a call's :class:`_FlexPlan` (None when the call cannot take the short road: not PyTorch CUDA
    tensors, or no driver-level launch). The mods and the BlockMask by identity (the plan holds them, so their
    ids stay theirs); the tensors as :func:`kernels_gpu.tensorcore.launch.run`'s plans key them."""
    if not driver_launch.enabled():
        return None
    try:
        import torch
    except ImportError:                       # (torch is optional: no tensors to plan for)
        return None
    parts = []
    for x in tensors:
        if type(x) is not torch.Tensor or not x.is_cuda:
            return None
        parts.append((x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0))
    return ("v11", id(score_mod), id(block_mask), type(scale), scale, bool(enable_gqa), B_c, tuple(parts))


class _FlexPlan:
    """A v11 forward on PyTorch CUDA tensors of fixed shapes with fixed mods and BlockMask: the first call's
    :class:`~kernels_gpu.tensorcore.launch.ForwardPlan` (outputs allocated, five addresses written, one driver
    launch), holding the mods, the BlockMask and the device walk and bound arrays that its parameters point to."""

    __slots__ = ("forward", "keep")

    def __init__(self, forward, keep):
        self.forward, self.keep = forward, keep

    def __call__(self, Q, K, V):
        return self.forward(Q, K, V)


def flex_forward_v11(Q, K, V, score_mod=None, block_mask=None, scale=None, enable_gqa=False, B_c=None):
    """Rung v11's FlexAttention forward (:func:`make_kernel`): :func:`flex_forward`'s arguments and result;
    ``B_c`` overrides the preferred key-tile width (:func:`config_for`).

    Host cost: on the first call with a BlockMask, its walk (:func:`visit_table`) is built and copied to the
    device, and the mods are planned; both are kept (per BlockMask, per mod object), as are the device copies of
    bound host arrays. PyTorch CUDA tensors take the short road from the second call with the same shapes, mods
    and BlockMask: one plan lookup, the outputs allocated, one driver-level launch."""
    from kernels_gpu.flash2 import Flash2Forward

    key = _plan_key((Q, K, V), score_mod, block_mask, scale, enable_gqa, B_c)
    if key is not None:
        found = _PLANS.get(key)
        if found is not None:
            return found(Q, K, V)
    p, block_mask = _checked_problem(Q, K, V, score_mod, block_mask, scale, enable_gqa)
    mask_mod = None if block_mask is None else block_mask.mask_mod
    plan, arrays = planned_mods(mask_mod, score_mod, p.N_q, p.N_k)
    mods = plan != (None, None)
    # no block mask: the preferred tile itself (every block full)
    block_size = flex_tile(p.d, mods)[1:] if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    if B_c is not None and block_mask is None:
        block_size = (block_size[0], B_c)
    cfg = config_for(p.d, p.dtype, block_size, rt.simulator_in_use(), mods=mods, B_c=B_c)
    walk = walk_for(block_mask, cfg, p.N_q, p.N_k)
    kernel = make_kernel(cfg, plan, walk.ordered)
    args = (p.Q, p.K, p.V, p.O, p.L, walk.counts, walk.visits, walk.order, np.int32(p.N_q), np.int32(p.N_k),
            np.int32(p.H_q // p.H_kv), np.float32(p.scale), *_bound_on_device(arrays))
    grid, nbytes = grid_for(cfg, p, walk.ordered), 4 * shared_words(cfg)
    _launch_mods(kernel, grid, cfg.threads, p, args, nbytes, mask_mod, score_mod)
    if key is not None:
        prepared = driver_launch.Prepared(kernel, grid, cfg.threads, args, nbytes)
        _PLANS[key] = _FlexPlan(launch.ForwardPlan(p, prepared, Q, K, V), (score_mod, block_mask, walk, args))
    return Flash2Forward(*launch.finish(p))


#: the flex forward rungs: name → ``f(Q, K, V, score_mod=None, block_mask=None, scale=None, enable_gqa=False)``
FORWARD_VERSIONS = {"v4": flex_forward_v4, "v11": flex_forward_v11}


def flex_forward(Q, K, V, score_mod=None, block_mask=None, scale=None, enable_gqa=False, *, rung="v11", **tile):
    """FlexAttention forward on tensor cores: FA2 Algorithm 1 over a BlockMask, the mods compiled into the kernel.

    O = softmax(MASK(score_mod(τ·QKᵀ)))·V, the same function as :func:`fa2edu.flex.flex_attention`. Skipped blocks
    are never loaded, partial blocks call mask_mod per score, full blocks never call it. score_mod rewrites every
    visible scaled score. Cost per (batch, head): 4·d·(visited area) MMA FLOPs, one mask_mod call per score of a
    partial block, one score_mod call per visible score; HBM reads N_q·d + 2·d·CV elements (CV: key rows of the
    visited blocks), writes N_q·d + N_q (see the module docstring).

    Parameters
    ----------
    Q : array, shape (B, H_q, N_q, d)
        Queries: float16 or bfloat16 (a PyTorch tensor, a numba device array or a NumPy float16 array, as
        :func:`kernels_gpu.tensorcore.flash2_forward`); d a multiple of 8 up to 256.
    K : array, shape (B, H_kv, N_k, d)
        Keys, the same kind and dtype as Q; H_kv = H_q unless ``enable_gqa``.
    V : array, shape (B, H_kv, N_k, d)
        Values, the same kind and dtype (d_v = d).
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> score``, a scalar function numba compiles (``bind`` for arrays
        it indexes). Default None: the scores unchanged.
    block_mask : fa2edu.BlockMask, optional
        From ``fa2edu.create_block_mask(mask_mod, B, H, N_q, N_k, BLOCK_SIZE)``; its B and H are Q's or 1. Rung
        v11 runs any BLOCK_SIZE of multiples of 16 (its tile divides the block: :func:`config_for`); rung v4 runs
        the BLOCK_SIZE as its tile (:func:`config_for_v4`). Default None: no mask.
    scale : float, optional
        The softmax scale τ. Default None: 1/√d.
    enable_gqa : bool, default False
        Allow H_q ≠ H_kv (a divisor of H_q): query head h reads key/value head h // (H_q / H_kv).
    rung : str, keyword only, default "v11"
        Which kernel: a key of :data:`FORWARD_VERSIONS` ("v11": the ladder's fastest rung with the mods; "v4":
        the first flex kernel, kept for its measurements).
    **tile :
        Rung v11 only: ``B_c``, the preferred key-tile width (:func:`config_for`), to measure the other choice.

    Returns
    -------
    Flash2Forward
        ``(O, L)``: O (B, H_q, N_q, d) in Q's dtype and kind (0 on a fully masked row), L (B, H_q, N_q) float32
        natural-log log-sum-exp of the modified, masked scores (+inf on a fully masked row).
    """
    forward = FORWARD_VERSIONS.get(rung) if isinstance(rung, str) else None
    if forward is None:
        raise ValueError(f"rung must be one of {sorted(FORWARD_VERSIONS)}, got {rung!r}")
    if tile and (rung != "v11" or set(tile) - {"B_c"}):
        raise TypeError(f"flex_forward takes the tile option B_c with rung 'v11' only, got {sorted(tile)} with "
                        f"rung {rung!r}")
    return forward(Q, K, V, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, **tile)


# -- the backward pass ------------------------------------------------------------------------------------------

def backward_config_for_v1(d: int, dtype: str, block_size: tuple, simulated: bool) -> BackwardConfig:
    """Rung v1's backward kernel constants for a BlockMask's BLOCK_SIZE = (B_r, B_c): the v1 backward's shape with
    W = B_c / 16 warps (16 keys each), B_r queries per row block; two column chunks of dK_j, dV_j above d = 128.
    Raises ValueError naming the sizes it can run."""
    B_r, B_c = block_size
    rows_ok = B_r % 16 == 0 and 16 <= B_r <= 128
    warps = B_c // 16
    if not rows_ok or B_c % 16 or not 16 <= B_c <= 128 or (warps % (B_r // 16) and (B_r // 16) % warps):
        raise ValueError(f"the flex backward runs tiles (B_r, B_c) with B_r in 16, 32, …, 128, B_c a multiple of 16 "
                         f"up to 128 (16 keys per warp), and B_r / 16 dividing or divisible by B_c / 16; the block "
                         f"mask has BLOCK_SIZE = {(B_r, B_c)}: make it with BLOCK_SIZE=(64, 64) (or (16, 16) for "
                         f"small problems)")
    cfg = BackwardConfig(d=d, warps=warps, B_r=B_r, dtype=dtype, causal=False, simulated=simulated,
                         chunks=1 if d <= 128 else 2)
    nbytes = 4 * backward_v1.shared_words(cfg)
    if nbytes > MAX_DYNAMIC_BYTES:
        raise ValueError(f"BLOCK_SIZE = {(B_r, B_c)} at d = {d} needs {nbytes} bytes of shared memory in the "
                         f"backward, a block may have {MAX_DYNAMIC_BYTES}: use a smaller BLOCK_SIZE, e.g. (32, 64)")
    return cfg


def plan_backward_mods(mask_mod, score_mod, score_grad):
    """:func:`plan_mods` with the score_mod's derivative as a third plan entry (its bound arrays take the next
    slots, or the slots they already have): ``((mask plan, score plan, grad plan), arrays)``. ``score_grad`` is a
    function, or the string ``"chain"`` for the derivative a :func:`~fa2edu.flex.chain_score_mods` carries, which
    is planned part by part (:func:`_chain_grad_plan`)."""
    (mask_plan, score_plan), arrays = plan_mods(mask_mod, score_mod)
    arrays = list(arrays)
    if score_grad is None:
        grad_plan = None
    elif isinstance(score_grad, str) and score_grad == "chain":
        grad_plan = _chain_grad_plan(score_mod, arrays)
    else:
        grad_plan = _leaf(score_grad, "score_mod_grad", "score", arrays)
    return (mask_plan, score_plan, grad_plan), tuple(arrays)


@functools.lru_cache(maxsize=64)
def make_backward_kernel_v1(cfg: BackwardConfig, plan):
    """Rung v1's flex backward kernel for one tile shape and one :func:`plan_backward_mods` plan: the mma.sync backward
    v1 (one block per key block j, Sᵀ and dPᵀ per warp, dQ by atomic adds) walking the row blocks i of key block
    j that the BlockMask does not skip, with MASK(score_mod(τS)) in the probabilities and score_mod_grad(τS) in
    dS. Arguments: v1's, then the block classes C (B, H, T_r, T_c) and the bound arrays A0 … A3."""
    mask_call, score_call = compile_mods(plan[:2], cfg.simulated)
    HAS_MASK, HAS_SCORE = plan[0] is not None, plan[1] is not None
    jit = device(cfg.simulated)
    if plan[2] is None:
        def unit(score, b, h, q_idx, kv_idx, A0, A1, A2, A3):
            return score
        grad_call = jit(unit)              # (never called: HAS_SCORE is a compile-time constant)
    else:
        grad_call = compile_score(plan[2], jit)
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async"], st["copy_q_async"], st["copy_stats_async"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    softmax_gradient = st["softmax_gradient"]
    store_transposed, dq_update, store_rows = st["store_transposed"], st["dq_update"], st["store_rows"]
    B_r, B_c, RS, RSS = cfg.B_r, cfg.B_c, cfg.RS, cfg.RSS
    CHUNKS, DC, NT = cfg.chunks, cfg.DC, cfg.NT
    K_OFF = 0                                # shared memory laid out as v1's
    V_OFF = B_c * RS
    Q_OFF = 2 * B_c * RS
    DO_OFF = Q_OFF + B_r * RS
    DS_OFF = DO_OFF + B_r * RS
    L_OFF = DS_OFF + B_c * RSS
    D_OFF = L_OFF + B_r
    S_LEN, C_LEN, A_LEN = 4 * NT, 4 * cfg.NC, 4 * (B_c // 16)
    G_LEN = S_LEN if HAS_SCORE else 1
    log2e = float32(LOG2E)
    SKIP, PART = np.int8(SKIPPED), np.int8(PARTIAL)
    ex2 = ptx.ex2

    @jit
    def flex_probabilities(s, gr, smf, key0, col0, N_q, N_k, scale, kind, z, h, A0, A1, A2, A3):
        """Alg. 2 line 11, transposed, FlexAttention's way: for the lane's keys ``key0``, ``key0 + 8`` and the
        tile's queries ``col0 + …``, x = τSᵀ, Pᵀ = exp(MASK(score_mod(x)) − L) = 2^(score_mod(x)·log₂e − L·log₂e),
        and (score_mod) gr = score_mod_grad(x), in place. mask_mod only in partial blocks; no mod is called for
        keys past N_k or queries past N_q (P = 0 there, and where the mask drops the score)."""
        t = cuda.laneid % 4
        for n in range(NT):
            for hh in range(2):
                for e in range(2):
                    k = 4 * n + 2 * hh + e
                    key = key0 + 8 * hh
                    col = 8 * n + 2 * t + e
                    q = col0 + col
                    x = s[k] * scale
                    p = float32(0.0)
                    if q >= N_q or key >= N_k:
                        p = float32(0.0)
                    elif HAS_MASK and kind == PART and not mask_call(z, h, q, key, A0, A1, A2, A3):
                        p = float32(0.0)
                    else:
                        y = x
                        if HAS_SCORE:
                            y = score_call(x, z, h, q, key, A0, A1, A2, A3)
                            gr[k] = grad_call(x, z, h, q, key, A0, A1, A2, A3)
                        p = ex2(float32(y) * log2e - smf[L_OFF + col])
                    s[k] = p

    @jit
    def chain_rule(s, gr):
        """Alg. 2 line 14, FlexAttention: dSᵀ = dS'ᵀ ∘ score_mod_grad(τSᵀ), in place (0 where P = 0)."""
        for k in range(S_LEN):
            if s[k] != 0.0:
                s[k] = s[k] * gr[k]

    @cfg.jit()
    def flex_backward_tc(Q, K, V, dO, stats, dQacc, dK, dV, N_q, N_k, G, scale, scale_log2, C, A0, A1, A2, A3):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        j = cuda.blockIdx.x // CHUNKS         # key block j (Alg. 2 line 5: one block per j, in parallel)
        c = cuda.blockIdx.x - j * CHUNKS      # the column chunk of dK_j, dV_j, dQ_i this block computes
        hk = cuda.blockIdx.y
        z = cuda.blockIdx.z
        bz = z if C.shape[0] > 1 else 0       # a BlockMask of B = 1 or H = 1 broadcasts
        sm = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        gr = cuda.local.array(G_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        afrag = cuda.local.array(A_LEN, uint32)
        acc = cuda.local.array(8, float32)
        key0 = j * B_c + 16 * warp
        col_word = c * (DC // 2)

        # Alg. 2 line 6: K_j, V_j to SRAM, for the whole block; line 7: dK_j = dV_j = 0.
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        ptx.cp_async_commit()
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        # Alg. 2 line 8: the row blocks i of each of the G query heads of this key/value head; the block classes
        # C[b, h, i, j] read by i for the fixed j (FA1 Alg. 5 line 8: skipped pairs are not visited).
        T_r = C.shape[2]
        for step in range(G * T_r):
            gq = step // T_r
            i = step - gq * T_r
            h = hk * G + gq
            bh = h if C.shape[1] > 1 else 0
            kind = C[bz, bh, i, j]
            if kind == SKIP:                  # (uniform over the block: every thread skips alike)
                continue
            # Lines 9-10: Q_i, dO_i, L_i, D_i to SRAM, waited for at once (v1's schedule).
            copy_q(sm, Q_OFF, Q, z, h, i * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, h, i * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, h, i * B_r, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait_all()
            cuda.syncthreads()
            # Line 11: Sᵀ = K_j Q_iᵀ; then Pᵀ = exp(MASK(score_mod(τSᵀ)) − L_i), and score_mod_grad(τSᵀ).
            product_transposed(s, sm, K_OFF, Q_OFF, warp, lane)
            flex_probabilities(s, gr, smf, key0 + lane // 4, i * B_r, N_q, N_k, scale, kind, z, h, A0, A1, A2, A3)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, DO_OFF, col_word, lane)
            # Line 17: dPᵀ = V_j dO_iᵀ; line 19: dS'ᵀ = Pᵀ ∘ (dPᵀ − D_i); through the mod: dSᵀ = dS'ᵀ ∘ grad.
            product_transposed(dp, sm, V_OFF, DO_OFF, warp, lane)
            softmax_gradient(s, dp, smf, D_OFF)
            if HAS_SCORE:
                chain_rule(s, gr)
            # Line 21: dK_j += dSᵀ Q_i (τ once, at the end); line 20: dQ_i += dS K_j, atomically (τ at conversion).
            product_accumulate(dk, s, sm, Q_OFF, col_word, lane)
            store_transposed(sm, DS_OFF, s, warp, lane)
            cuda.syncthreads()
            dq_update(dQacc, sm, DS_OFF, K_OFF, col_word, afrag, acc, z, h, i * B_r, c * DC, N_q, warp, lane)

        ptx.cp_async_wait_all()
        # Line 24: dK_j = τ Σ dSᵀ Q_i, dV_j to HBM, once.
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flex_backward_tc


def flex_backward_v1(Q, K, V, O, L, dO, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                     score_mod_grad=None):
    """Rung v1's FlexAttention backward (:func:`make_backward_kernel_v1`), kept so that its results stay
    reproducible (``flex_backward(..., rung="v1")``): :func:`flex_backward`'s arguments and result.

    The same function as :func:`fa2edu.flex.flex_attention_backward`: with S = τQKᵀ, P = exp(MASK(score_mod(S))
    − L), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D) ∘ score_mod_grad(S), D = rowsum(dO ∘ O), dQ = τ dS K, dK = τ dSᵀ Q.
    Built on the mma.sync backward v1 (:mod:`kernels_gpu.tensorcore.flash2_backward_v1`) and its three launches
    (preprocess, one block per key block, dQ's conversion): a key block j walks the row blocks i whose class
    C[b, h, i, j] is not SKIPPED; partial pairs call mask_mod per score, full pairs never do; score_mod and its
    derivative are called once per visible score. Cost per (batch, head): 10·d·(visited area) MMA FLOPs, the
    dQ atomic adds of the visited pairs, and the mods' calls.

    Parameters
    ----------
    Q, K, V, O, L, dO :
        As :func:`kernels_gpu.tensorcore.flash2_backward`: Q, O, dO (B, H_q, N_q, d), K, V (B, H_kv, N_k, d)
        float16 or bfloat16, L (B, H_q, N_q) float32 from :func:`flex_forward` (+inf on fully masked rows).
    score_mod, block_mask, scale, enable_gqa :
        The forward's (:func:`flex_forward`). The BlockMask's BLOCK_SIZE (B_r, B_c) is the backward's tile
        (:func:`backward_config_for_v1`); no block mask: every block full at v1's tile (64 or 32, 64).
    score_mod_grad : callable, optional
        ``score_mod_grad(score, b, h, q_idx, kv_idx)``, d score_mod / d score at the scaled score. Default None:
        ``score_mod.score_mod_grad``; a score_mod with neither raises ValueError.

    Returns
    -------
    Flash2Backward
        ``(dQ, dK, dV)`` in the input dtype and kind; dK, dV summed over each GQA group; dQ = 0 on fully masked
        rows.
    """
    from fa2edu.flex import _score_mod_derivative

    for x, name in ((Q, "Q"), (K, "K"), (V, "V")):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must have 4 axes (B, H, N, d), as flex_attention, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if Q.shape[1] != K.shape[1] and not enable_gqa:
        raise ValueError(f"Q has H = {Q.shape[1]} heads but K and V have {K.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention, or give K and V Q's heads")
    grad = _score_mod_derivative(score_mod, score_mod_grad)
    p = launch.prepare(Q, K, V, causal=False, scale=scale)
    block_mask = _check_mods(score_mod, block_mask, p)
    if block_mask is None:
        block_size = (64 if p.d <= 64 else 32, 64)
    else:
        block_size = tuple(block_mask.BLOCK_SIZE)
    cfg = backward_config_for_v1(p.d, p.dtype, block_size, rt.simulator_in_use())
    mask_mod = None if block_mask is None else block_mask.mask_mod
    score_mod = None if score_mod is None else at_lengths(score_mod, p.N_q, p.N_k)
    if score_mod_grad is None and _is_chain(score_mod):
        grad = "chain"                     # the chain's own derivative, compiled part by part
    else:
        grad = None if grad is None else at_lengths(grad, p.N_q, p.N_k)
    plan, arrays = plan_backward_mods(mask_mod, score_mod, grad)
    if block_mask is None:
        classes = np.full((1, 1, rt.grid_size(p.N_q, cfg.B_r), rt.grid_size(p.N_k, cfg.B_c)), FULL, np.int8)
    else:
        classes = np.ascontiguousarray(block_mask.classes, dtype=np.int8)
    bound = [_on_device(a) for a in arrays]
    bound += [cuda.to_device(np.zeros(1, np.float32))] * (ARRAY_SLOTS - len(bound))
    return backward_launch.run_backward(lambda _cfg: make_backward_kernel_v1(_cfg, plan),
                                        lambda *args: cfg, backward_v1.shared_words, Q, K, V, O, L, dO,
                                        causal=False, scale=scale, extra_args=(cuda.to_device(classes), *bound))


# -- backward rung v7: the mods on the ladder's fastest backward ---------------------------------------------------

#: bits of a key-block walk entry (:func:`kv_visit_table`): ``(gq << GQ_SHIFT) | (i << 1) | partial``
GQ_SHIFT = 23
_MAX_ROW_BLOCKS = 1 << (GQ_SHIFT - 1)
_MAX_GROUP = 1 << (31 - GQ_SHIFT)
#: n-tiles (8 query columns each) per loop of the backward's mod steps (see make_backward_kernel)
MOD_TILES = 2


def backward_tile(d: int) -> tuple:
    """Backward rung v7's preferred tile for head dimension d: (W warps, B_r), the ladder's v7
    (:func:`kernels_gpu.tensorcore.flash2_backward_v7.config_for`): 4 warps, so key blocks of B_c = 64 keys in the
    key-block kernel and query blocks of 64 rows in the dQ kernel; B_r = 64 queries per row block (keys per tile in
    the dQ kernel) up to d = 64, 32 beyond."""
    return (4, 64 if d <= 64 else 32)


def backward_config_for_v7(d: int, dtype: str, block_size: tuple, simulated: bool) -> BackwardConfig:
    """Backward rung v7's constants for a BlockMask's BLOCK_SIZE = (B_r, B_c), both multiples of 16.

    The two kernels' tiles must each lie inside one block of the mask, so that each takes its block's class. The
    key-block kernel's tile is B_r' queries × 16·W keys, the dQ kernel's 16·W queries × B_r' keys; both
    sides divide both of the mask's sizes, so the tile is :func:`backward_tile`'s shrunk to the largest one that
    divides g = gcd(B_r, B_c): W = gcd(64, g) / 16, B_r' = gcd(64 or 32, g). BLOCK_SIZE 128 (PyTorch's default)
    and (64, 64) run the ladder's tiles unchanged, (16, 16) one warp with B_r' = 16. Register caps as the ladder's
    v7 (the key-block kernel at 248 for d ≤ 64 at its full tile, the dQ kernel at 168 for d ≤ 128, 4 warps); two
    column chunks above d = 128. Raises ValueError naming the sizes it can run."""
    B_r_mask, B_c_mask = block_size
    if B_r_mask % 16 or B_r_mask < 16 or B_c_mask % 16 or B_c_mask < 16:
        raise ValueError(f"the flex backward runs tiles inside block masks whose BLOCK_SIZE (B_r, B_c) are multiples "
                         f"of 16; the block mask has BLOCK_SIZE = {(B_r_mask, B_c_mask)}: make it with "
                         f"create_block_mask(..., BLOCK_SIZE=128) (PyTorch's default), (64, 64), or (16, 16) for "
                         f"small problems")
    W, B_r = backward_tile(d)
    g = math.gcd(B_r_mask, B_c_mask)
    W, B_r = math.gcd(16 * W, g) // 16, math.gcd(B_r, g)
    full = W == 4
    cfg = BackwardConfig(d=d, warps=W, B_r=B_r, dtype=dtype, causal=False, simulated=simulated,
                         chunks=1 if d <= 128 else 2,
                         max_registers=248 if d <= 64 and B_r == 64 and full else None,
                         max_registers_dq=168 if d <= 128 and full else None)
    nbytes = 4 * max(backward_v7.shared_words(cfg), backward_v7.dq_shared_words(cfg))
    if nbytes > MAX_DYNAMIC_BYTES:            # (not reached at d ≤ 256 by these tiles; kept as the guard)
        raise ValueError(f"BLOCK_SIZE = {(B_r_mask, B_c_mask)} at d = {d} needs {nbytes} bytes of shared memory in "
                         f"the backward, a block may have {MAX_DYNAMIC_BYTES}")
    return cfg


def backward_config_for(d: int, dtype: str, block_size: tuple, simulated: bool, *, rung: str = "v7"):
    """The backward constants of ``rung`` (a key of :data:`BACKWARD_VERSIONS`) for a BlockMask's BLOCK_SIZE:
    :func:`backward_config_for_v7` or :func:`backward_config_for_v1`. Raises ValueError naming the sizes the rung
    can run (``fa2edu._torch_ops`` retiles a mask on that error)."""
    if rung == "v7":
        return backward_config_for_v7(d, dtype, block_size, simulated)
    if rung == "v1":
        return backward_config_for_v1(d, dtype, block_size, simulated)
    raise ValueError(f"rung must be one of {sorted(BACKWARD_VERSIONS)}, got {rung!r}")


def kv_visit_table(classes: np.ndarray, block_size: tuple, tile: tuple, N_q: int, N_k: int, G: int) -> tuple:
    """The walk of every key block of the key-block kernel over its GQA group, worked out on the host once per
    BlockMask, tile and G (FA1 Alg. 5 line 8 from the key side: PyTorch's ``q_num_blocks`` / ``q_indices``).

    ``classes`` (B, H, T_r, T_c) are the BlockMask's, of blocks ``block_size``, H = 1 or H_q = H_kv·G; ``tile`` =
    (B_r', B_c') the kernel's row block and key block, dividing the mask's blocks. Key block j' of key/value head
    hk visits, for each query head hk·G + gq of its group in turn, the row blocks i' that are not skipped, in
    increasing i'. Returns ``(counts, visits, order)``, int32: ``counts[b, hk, j']`` the (gq, i') pairs visited
    (hk is 0 when H = 1: the walk is alike for every group); ``visits[b, hk, j', t]`` the t-th, coded
    ``(gq << 23) | (i' << 1) | partial`` (shifts, not a division, to decode; −1 past the count); ``order[b, hk,
    :]`` the key blocks by decreasing count. Cost O(B·H·T_r'·T_c'·log T_r'), memory B·H·T_c'·max(counts) words.
    Raises ValueError beyond 2²² row blocks or 256 query heads per group."""
    B_r, B_c = block_size
    tile_r, tile_c = tile
    counts, visits, _ = visit_table(np.asarray(classes).transpose(0, 1, 3, 2), (B_c, B_r), (tile_c, tile_r), N_k, N_q)
    T_r = -(-N_q // tile_r)
    if T_r > _MAX_ROW_BLOCKS or G > _MAX_GROUP:
        raise ValueError(f"the flex backward's walk codes up to {_MAX_ROW_BLOCKS} row blocks and {_MAX_GROUP} query "
                         f"heads per key/value head; this problem has {T_r} row blocks of {tile_r} and G = {G}")
    Bm, Hm, T_c, width = visits.shape
    if Hm == 1:                               # one walk for every head: each group visits it G times
        visits = np.broadcast_to(visits[:, :, None], (Bm, 1, G, T_c, width))
    else:
        visits = visits.reshape(Bm, Hm // G, G, T_c, width)
    valid = visits >= 0
    gq = np.arange(G, dtype=np.int32)[None, None, :, None, None]
    codes = np.where(valid, (gq << GQ_SHIFT) | visits, -1).transpose(0, 1, 3, 2, 4).reshape(Bm, -1, T_c, G * width)
    counts = valid.sum(axis=(2, 4)).astype(np.int32)
    span = max(1, int(counts.max()))
    index = np.argsort(codes < 0, axis=-1, kind="stable")[..., :span]      # the valid ones first, in (gq, i') order
    codes = np.take_along_axis(codes, index, axis=-1)
    order = np.argsort(-counts, axis=-1, kind="stable")
    return tuple(np.ascontiguousarray(x, dtype=np.int32) for x in (counts, codes, order))


def _backward_tables(classes, block_size, cfg: BackwardConfig, N_q: int, N_k: int, G: int):
    """The two walks on the device: the key-block kernel's (:func:`kv_visit_table`, tile B_r × B_c) and the dQ
    kernel's (:func:`visit_table`, tile B_c queries × B_r keys: query blocks of 16·W rows, key tiles of B_r)."""
    kv = _Walk(classes, *kv_visit_table(classes, block_size, (cfg.B_r, cfg.B_c), N_q, N_k, G))
    dq = _Walk(classes, *visit_table(classes, block_size, (cfg.B_c, cfg.B_r), N_q, N_k))
    return kv, dq


@functools.lru_cache(maxsize=64)
def _full_backward_walks(N_q: int, N_k: int, cfg: BackwardConfig, G: int):
    """The backward walks without a block mask: every tile full."""
    tile = math.lcm(cfg.B_r, cfg.B_c)
    classes = np.full((1, 1, -(-N_q // tile), -(-N_k // tile)), FULL, np.int8)
    return _backward_tables(classes, (tile, tile), cfg, N_q, N_k, G)


def backward_walks_for(block_mask, cfg: BackwardConfig, N_q: int, N_k: int, G: int) -> tuple:
    """``(kv walk, dq walk)`` of ``block_mask`` (None: every block full) for backward rung v7 at ``cfg``'s tiles,
    made on the first call and kept with the BlockMask, as :func:`walk_for` keeps the forward's."""
    if block_mask is None:
        return _full_backward_walks(N_q, N_k, cfg, G)
    key = ("backward", cfg.B_r, cfg.B_c, G)
    with _WALKS_LOCK:
        found = _WALKS.get(block_mask, {}).get(key)
    if found is not None and found[0].source is block_mask.classes:
        return found
    walks = _backward_tables(block_mask.classes, tuple(block_mask.BLOCK_SIZE), cfg, N_q, N_k, G)
    with _WALKS_LOCK:
        _WALKS.setdefault(block_mask, {})[key] = walks
    return walks


def _grad_device_call(node, jit):
    """The score_mod's derivative as a device function of the kernel's arity (a stand-in returning 1 when there is
    no score_mod: the kernels never call it then, HAS_SCORE being a compile-time constant)."""
    if node is None:
        def unit(score, b, h, q_idx, kv_idx, A0, A1, A2, A3):
            return score
        return jit(unit)
    return compile_score(node, jit)


@functools.lru_cache(maxsize=64)
def make_backward_kernel(cfg: BackwardConfig, plan, ordered: bool = False):
    """Backward rung v7's key-block kernel (dK_j, dV_j) for one tile (:func:`backward_config_for_v7`), one
    :func:`plan_backward_mods` plan and one launch order: the ladder's v7 key-block kernel
    (:mod:`kernels_gpu.tensorcore.flash2_backward_v7`) walking the list of :func:`kv_visit_table` instead of every
    row block. ``ordered``: the grid is (H_kv, batch, key blocks · chunks) and key block ``order[b, hk,
    blockIdx.z // chunks]`` runs, the longest first; otherwise (key blocks · chunks, H_kv, batch). Arguments: Q, K,
    V, dO, stats, dK, dV, the walk (``counts``, ``visits``, ``order``), N_q, N_k, G, τ, τ·log₂e, A0 … A3."""
    mask_call, score_call = compile_mods(plan[:2], cfg.simulated)
    HAS_MASK, HAS_SCORE = plan[0] is not None, plan[1] is not None
    ORDERED = bool(ordered)
    jit = device(cfg.simulated)
    grad_call = _grad_device_call(plan[2], jit)
    st = make_backward_steps(cfg)
    copy_kv, copy_q, copy_stats, zero = st["copy_kv_async_inc"], st["copy_q_async_inc"], st["copy_stats_async"], \
        st["zero"]
    product_pair, product_accumulate = st["product_transposed_pair"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities_at"], st["softmax_gradient_at"], st["store_rows"]
    B_r, B_c, RS = cfg.B_r, cfg.B_c, cfg.RS
    CHUNKS, DC, NT = cfg.chunks, cfg.DC, cfg.NT
    K_OFF = 0                                # word offsets (v7's): K_j, V_j, stage 0 (Q_i, dO_i), stage 1 (Q_i,
    V_OFF = B_c * RS                         # dO_i), then (as floats) stage 0 (L_i·log₂e, D_i), stage 1
    Q_OFF = 2 * B_c * RS
    DO_OFF = Q_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    L_OFF = Q_OFF + 2 * STAGE
    D_OFF = L_OFF + B_r
    FSTAGE = 2 * B_r
    S_LEN, C_LEN = 4 * NT, 4 * cfg.NC
    ROW_MASK = _MAX_ROW_BLOCKS - 1
    log2e = float32(LOG2E)
    ex2 = ptx.ex2

    def make_part(N0, N1):
        @jit
        def part(s, dp, smf, l_lane, d_lane, key0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1,
                 A2, A3):
            """Alg. 2 line 13 (and line 19's first half) for the n-tiles N0 … N1 − 1 (``flex_probabilities``
            below); cost per element: a compare, at most one mask_mod, score_mod and score_mod_grad call, an ex2."""
            t = cuda.laneid % 4
            for n in range(N0, N1):
                for e in range(2):
                    ell = smf[l_lane + uint32(8 * n + e)]
                    dee = float32(0.0)
                    if HAS_SCORE:
                        dee = smf[d_lane + uint32(8 * n + e)]
                    q = col0 + 8 * n + 2 * t + e
                    for hh in range(2):
                        k = 4 * n + 2 * hh + e
                        key = key0 + 8 * hh
                        p = float32(0.0)
                        gd = float32(0.0)
                        if edge and (q >= N_q or key >= N_k):
                            p = float32(0.0)
                        elif HAS_MASK and partial and not mask_call(z, h, q, key, A0, A1, A2, A3):
                            p = float32(0.0)
                        elif HAS_SCORE:
                            x = s[k] * scale
                            y = float32(score_call(x, z, h, q, key, A0, A1, A2, A3))
                            gd = float32(grad_call(x, z, h, q, key, A0, A1, A2, A3))
                            p = ex2(y * log2e - ell)
                        else:
                            p = ex2(s[k] * scale_log2 - ell)
                        s[k] = p
                        if HAS_SCORE:
                            dp[k] = (dp[k] - dee) * gd
        return part

    def then(first, second):
        @jit
        def both(s, dp, smf, l_lane, d_lane, key0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1,
                 A2, A3):
            first(s, dp, smf, l_lane, d_lane, key0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1,
                  A2, A3)
            second(s, dp, smf, l_lane, d_lane, key0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1,
                   A2, A3)
        return both

    # flex_probabilities(s, dp, smf, l_lane, d_lane, key0, col0, N_q, N_k, τ, τ·log₂e, partial, edge, z, h, A0 … A3):
    # Alg. 2 line 13, transposed, FlexAttention's way, for the lane's keys key0, key0 + 8 and the tile's queries
    # col0 + …: Pᵀ = exp(MASK(score_mod(τSᵀ)) − L_i), in place in s. With a score_mod, also the first half of line
    # 19 through its derivative, in place in dp (which v7's pair has ready): dPᵀ ← (dPᵀ − D_i) ∘ score_mod_grad(τSᵀ),
    # so that dSᵀ = Pᵀ ∘ dPᵀ later and the derivative needs no registers of its own. mask_mod runs only in a
    # partial tile; on an edge tile (past N_q or N_k) padding queries and keys get P = 0 and no mod call (a mod may
    # index arrays of N_q or N_k entries). L_i·log₂e and D_i at the lane's unsigned indices (v6's).
    # The tile in parts of MOD_TILES n-tiles, each a loop of its own: a loop over all NT n-tiles with a mod call
    # in its body grows past what LLVM unrolls at B_r = 64 (ptxas then keeps s and dp in local memory, a 256-byte
    # stack frame with softcap at d = 64); parts of 2 n-tiles unroll, and every index into s, dp is a constant.
    flex_probabilities = functools.reduce(then, [make_part(n0, min(n0 + MOD_TILES, NT))
                                                 for n0 in range(0, NT, MOD_TILES)])

    @jit
    def gradient_through(s, dp):
        """Alg. 2 line 19 with the mod's derivative already in ``dp`` (``flex_probabilities``): dSᵀ = Pᵀ ∘ dPᵀ,
        in place."""
        for k in range(S_LEN):
            s[k] = s[k] * dp[k]

    @cfg.jit()
    def flex_backward_kv_tc(Q, K, V, dO, stats, dK, dV, counts, visits, order, N_q, N_k, G, scale, scale_log2,
                            A0, A1, A2, A3):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        if ORDERED:                           # grid (H_kv, batch, key blocks · chunks): the longest key blocks first
            hk = cuda.blockIdx.x
            z = cuda.blockIdx.y
            slot = cuda.blockIdx.z // CHUNKS
            c = cuda.blockIdx.z - slot * CHUNKS
        else:                                 # grid (key blocks · chunks, H_kv, batch), as the ladder's v3
            slot = cuda.blockIdx.x // CHUNKS
            c = cuda.blockIdx.x - slot * CHUNKS
            hk = cuda.blockIdx.y
            z = cuda.blockIdx.z
        bz = z if counts.shape[0] > 1 else 0  # a BlockMask of B = 1 or H = 1 broadcasts
        bk = hk if counts.shape[1] > 1 else 0
        j = order[bz, bk, slot] if ORDERED else slot    # key block j (Alg. 2 line 5: one block per j, in parallel)
        sm = cuda.shared.array(0, uint32)
        smf = cuda.shared.array(0, float32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dk = cuda.local.array(C_LEN, float32)
        dv = cuda.local.array(C_LEN, float32)
        key0 = j * B_c + 16 * warp
        col_word = c * (DC // 2)
        ragged = (j + 1) * B_c > N_k          # the key block holds keys past N_k

        # Alg. 2 line 8's loop over (query head of the GQA group, row block i), flattened, as the ladder's — only
        # the pairs the BlockMask does not skip, listed on the host (FA1 Alg. 5 line 8).
        n_steps = counts[bz, bk, j]
        code = visits[bz, bk, j, 0]           # (gq << 23) | (i << 1) | partial
        # Alg. 2 line 6, and lines 9-10 for the first step, as one group.
        copy_kv(sm, K_OFF, K, z, hk, j * B_c, N_k, tid)
        copy_kv(sm, V_OFF, V, z, hk, j * B_c, N_k, tid)
        if n_steps > 0:
            h0 = hk * G + (code >> GQ_SHIFT)
            i0 = (code >> 1) & ROW_MASK
            copy_q(sm, Q_OFF, Q, z, h0, i0 * B_r, N_q, tid)
            copy_q(sm, DO_OFF, dO, z, h0, i0 * B_r, N_q, tid)
            copy_stats(smf, L_OFF, stats, z, h0, i0 * B_r, tid)
        ptx.cp_async_commit()
        # Alg. 2 line 7: dK_j = 0, dV_j = 0.
        zero(dk, C_LEN)
        zero(dv, C_LEN)
        t2 = uint32(2 * (lane % 4))           # the lane's first query column in a row block's L_i, D_i
        for step in range(n_steps):
            stage = step & 1
            h = hk * G + (code >> GQ_SHIFT)   # this step's query head (the mods' h) and row block, decoded by shifts
            i = (code >> 1) & ROW_MASK
            partial = (code & 1) != 0
            ptx.cp_async_wait_all()           # this step's tiles have landed (the only group in flight) ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            # Lines 9-10 for the next visited pair, into the other stage, land while this one is computed.
            code_next = code
            if step + 1 < n_steps:
                code_next = visits[bz, bk, j, step + 1]
                h_next = hk * G + (code_next >> GQ_SHIFT)
                i_next = (code_next >> 1) & ROW_MASK
                other = 1 - stage
                copy_q(sm, Q_OFF + other * STAGE, Q, z, h_next, i_next * B_r, N_q, tid)
                copy_q(sm, DO_OFF + other * STAGE, dO, z, h_next, i_next * B_r, N_q, tid)
                copy_stats(smf, L_OFF + other * FSTAGE, stats, z, h_next, i_next * B_r, tid)
            ptx.cp_async_commit()
            q_off = Q_OFF + stage * STAGE
            do_off = DO_OFF + stage * STAGE
            l_lane = uint32(L_OFF + stage * FSTAGE) + t2
            d_lane = uint32(D_OFF + stage * FSTAGE) + t2

            # Line 11: Sᵀ = K_j Q_iᵀ and line 17: dPᵀ = V_j dO_iᵀ, in one loop over the k-steps (v7).
            product_pair(s, dp, sm, K_OFF, q_off, V_OFF, do_off, warp, lane)
            # Line 13, FlexAttention: Pᵀ = exp(MASK(score_mod(τSᵀ)) − L_i), mask_mod in a partial tile only; with a
            # score_mod, dPᵀ ← (dPᵀ − D_i) ∘ score_mod_grad(τSᵀ) too. A full tile without a score_mod runs the
            # ladder's step, the key test only on the ragged last key block.
            if HAS_SCORE or (HAS_MASK and partial):
                edge = ragged or (i + 1) * B_r > N_q
                flex_probabilities(s, dp, smf, l_lane, d_lane, key0 + lane // 4, i * B_r, N_q, N_k, scale,
                                   scale_log2, partial, edge, z, h, A0, A1, A2, A3)
            else:
                probabilities(s, smf, l_lane, key0 + lane // 4, i * B_r, N_k, scale_log2, 0, ragged)
            # Line 16: dV_j += Pᵀ dO_i.
            product_accumulate(dv, s, sm, do_off, col_word, lane)
            # Line 19: dSᵀ = Pᵀ ∘ (dPᵀ − D_i) (∘ score_mod_grad, already in dPᵀ with a score_mod).
            if HAS_SCORE:
                gradient_through(s, dp)
            else:
                softmax_gradient(s, dp, smf, d_lane)
            # Line 21: dK_j += dSᵀ Q_i. (Line 20, dQ_i, is the dQ kernel's.)
            product_accumulate(dk, s, sm, q_off, col_word, lane)
            code = code_next

        ptx.cp_async_wait_all()
        # Line 24: write dK_j = τ Σ dSᵀQ, dV_j to HBM, once (zeros for a key block that no query sees).
        store_rows(dv, dV, z, hk, key0, N_k, col_word, float32(1.0), lane)
        store_rows(dk, dK, z, hk, key0, N_k, col_word, scale, lane)

    return flex_backward_kv_tc


@functools.lru_cache(maxsize=64)
def make_backward_dq_kernel(cfg: BackwardConfig, plan, ordered: bool = False):
    """Backward rung v7's dQ kernel for one tile, plan and launch order: the ladder's v7 dQ kernel (v5's: one block
    per query block of 16·W rows, a warp per 16 rows, key tiles of B_r keys double-buffered) walking the list of
    :func:`visit_table` at its tile. ``ordered``: grid (H_q, batch, query blocks · chunks), query block ``order[b,
    h, blockIdx.z // chunks]``, the longest first; otherwise (query blocks · chunks, H_q, batch). Arguments: Q, K,
    V, dO, stats, dQ, the walk (``counts``, ``visits``, ``order``), N_q, N_k, G, τ, τ·log₂e, A0 … A3."""
    mask_call, score_call = compile_mods(plan[:2], cfg.simulated)
    HAS_MASK, HAS_SCORE = plan[0] is not None, plan[1] is not None
    ORDERED = bool(ordered)
    jit = device(cfg.simulated)
    grad_call = _grad_device_call(plan[2], jit)
    st = make_backward_steps(cfg)
    # 16·W rows, B_r rows: the copies with their addresses stepped by constants (v5's)
    copy_rows, copy_tile, zero = st["copy_kv_async_inc"], st["copy_q_async_inc"], st["zero"]
    product_transposed, product_accumulate = st["product_transposed"], st["product_accumulate"]
    probabilities, softmax_gradient, store_rows = st["probabilities_rows"], st["softmax_gradient_rows"], \
        st["store_rows"]
    B_r, B_q, RS, NT = cfg.B_r, cfg.B_c, cfg.RS, cfg.NT    # keys per tile; queries per block (16 per warp)
    CHUNKS, DC = cfg.chunks, cfg.DC
    Q_OFF = 0                                # word offsets: Q_i, dO_i, stage 0 (K_j, V_j), stage 1 (K_j, V_j)
    DO_OFF = B_q * RS
    K_OFF = 2 * B_q * RS
    V_OFF = K_OFF + B_r * RS
    STAGE = 2 * B_r * RS
    S_LEN, C_LEN = 4 * NT, 4 * cfg.NC
    log2e = float32(LOG2E)
    ex2 = ptx.ex2

    def make_part(N0, N1):
        @jit
        def part(s, lrow, row0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1, A2, A3):
            """Alg. 2 line 13 (through the mod) for the n-tiles N0 … N1 − 1 (``flex_probabilities_rows`` below);
            cost per element: a compare, at most one mask_mod, score_mod and score_mod_grad call, an ex2."""
            t = cuda.laneid % 4
            for n in range(N0, N1):
                for e in range(2):
                    key = col0 + 8 * n + 2 * t + e
                    for hh in range(2):
                        k = 4 * n + 2 * hh + e
                        q = row0 + 8 * hh
                        p = float32(0.0)
                        if edge and (q >= N_q or key >= N_k):
                            p = float32(0.0)
                        elif HAS_MASK and partial and not mask_call(z, h, q, key, A0, A1, A2, A3):
                            p = float32(0.0)
                        elif HAS_SCORE:
                            x = s[k] * scale
                            y = float32(score_call(x, z, h, q, key, A0, A1, A2, A3))
                            gd = float32(grad_call(x, z, h, q, key, A0, A1, A2, A3))
                            p = ex2(y * log2e - lrow[hh]) * gd
                        else:
                            p = ex2(s[k] * scale_log2 - lrow[hh])
                        s[k] = p
        return part

    def then(first, second):
        @jit
        def both(s, lrow, row0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1, A2, A3):
            first(s, lrow, row0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1, A2, A3)
            second(s, lrow, row0, col0, N_q, N_k, scale, scale_log2, partial, edge, z, h, A0, A1, A2, A3)
        return both

    # flex_probabilities_rows(s, lrow, row0, col0, N_q, N_k, τ, τ·log₂e, partial, edge, z, h, A0 … A3): Alg. 2
    # line 13 in the forward's orientation (the warp's 16 query rows × B_r keys), FlexAttention's way: P =
    # exp(MASK(score_mod(τS)) − L), in place, times score_mod_grad(τS) with a score_mod — the dQ kernel needs P only
    # inside dS = P ∘ (dP − D) ∘ g, so P ∘ g is kept and the ladder's softmax gradient finishes it. mask_mod in a
    # partial tile only; on an edge tile, queries past N_q and keys past N_k get 0 and no mod call. lrow: L·log₂e
    # of the lane's rows row0, row0 + 8. In parts of MOD_TILES n-tiles, as the key-block kernel's (unrolled: at
    # d = 64 one loop kept s in local memory with causal + ALiBi, 128 bytes).
    flex_probabilities_rows = functools.reduce(then, [make_part(n0, min(n0 + MOD_TILES, NT))
                                                      for n0 in range(0, NT, MOD_TILES)])

    @cfg.jit(dq=True)
    def flex_backward_dq_tc(Q, K, V, dO, stats, dQ, counts, visits, order, N_q, N_k, G, scale, scale_log2,
                            A0, A1, A2, A3):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        if ORDERED:                           # grid (H_q, batch, query blocks · chunks): the longest first
            h = cuda.blockIdx.x
            z = cuda.blockIdx.y
            slot = cuda.blockIdx.z // CHUNKS
            c = cuda.blockIdx.z - slot * CHUNKS
        else:                                 # grid (query blocks · chunks, H_q, batch), as the ladder's v3
            slot = cuda.blockIdx.x // CHUNKS
            c = cuda.blockIdx.x - slot * CHUNKS
            h = cuda.blockIdx.y
            z = cuda.blockIdx.z
        bz = z if counts.shape[0] > 1 else 0
        bh = h if counts.shape[1] > 1 else 0
        i = order[bz, bh, slot] if ORDERED else slot    # query block i: one block per i (FA2 Section 3.2)
        hk = h // G                           # GQA: query head h reads key/value head h // G
        sm = cuda.shared.array(0, uint32)
        s = cuda.local.array(S_LEN, float32)
        dp = cuda.local.array(S_LEN, float32)
        dq = cuda.local.array(C_LEN, float32)
        lrow = cuda.local.array(2, float32)
        drow = cuda.local.array(2, float32)
        first_row = i * B_q + 16 * warp
        row0 = first_row + lane // 4          # this lane's first row; its second is row0 + 8
        col_word = c * (DC // 2)
        rows_edge = (i + 1) * B_q > N_q       # the last query block holds padding rows
        # Alg. 2 line 10 for the lane's two rows: L·log₂e and D (+∞ and 0 past N_q: P = 0, dS = 0).
        for hh in range(2):
            lrow[hh] = stats[z, h, 0, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(math.inf)
            drow[hh] = stats[z, h, 1, row0 + 8 * hh] if row0 + 8 * hh < N_q else float32(0.0)

        # The key tiles the BlockMask does not skip, listed on the host (FA1 Alg. 5 line 8).
        n_tiles = counts[bz, bh, i]
        code = visits[bz, bh, i, 0]           # 2·j + 1 for a partial tile, 2·j for a full one
        copy_rows(sm, Q_OFF, Q, z, h, i * B_q, N_q, tid)
        copy_rows(sm, DO_OFF, dO, z, h, i * B_q, N_q, tid)
        if n_tiles > 0:
            copy_tile(sm, K_OFF, K, z, hk, (code >> 1) * B_r, N_k, tid)
            copy_tile(sm, V_OFF, V, z, hk, (code >> 1) * B_r, N_k, tid)
        ptx.cp_async_commit()
        zero(dq, C_LEN)                       # Alg. 2 line 3 for this block's rows: dQ_i = 0, in registers
        for t in range(n_tiles):
            stage = (t & 1) * STAGE
            jt = code >> 1
            partial = (code & 1) != 0
            ptx.cp_async_wait_all()           # this tile (and Q_i, dO_i) has landed ...
            cuda.syncthreads()                # ... for everyone, and nobody still reads the other stage
            code_next = code
            if t + 1 < n_tiles:               # the next visited tile's copy runs under this tile's products
                code_next = visits[bz, bh, i, t + 1]
                copy_tile(sm, K_OFF + STAGE - stage, K, z, hk, (code_next >> 1) * B_r, N_k, tid)
                copy_tile(sm, V_OFF + STAGE - stage, V, z, hk, (code_next >> 1) * B_r, N_k, tid)
            ptx.cp_async_commit()
            # Alg. 2 line 11: S = Q_i K_jᵀ (the warp's 16 rows × B_r keys); line 13, FlexAttention: P =
            # exp(MASK(score_mod(τS)) − L_i) (∘ score_mod_grad with a score_mod); a full tile without a
            # score_mod runs the ladder's step.
            product_transposed(s, sm, Q_OFF, K_OFF + stage, warp, lane)
            ragged = (jt + 1) * B_r > N_k
            if HAS_SCORE or (HAS_MASK and partial):
                flex_probabilities_rows(s, lrow, row0, jt * B_r, N_q, N_k, scale, scale_log2, partial,
                                        ragged or rows_edge, z, h, A0, A1, A2, A3)
            else:
                probabilities(s, lrow, row0, jt * B_r, N_k, scale_log2, 0, ragged)
            # Lines 17, 19: dP = dO_i V_jᵀ, dS = P ∘ (dP − D_i) (P ∘ g with a score_mod: dS through the mod).
            product_transposed(dp, sm, DO_OFF, V_OFF + stage, warp, lane)
            softmax_gradient(s, dp, drow)
            # Line 20: dQ_i += dS K_j — dS's accumulators are the A operand, K_j the B operand (transposed load).
            product_accumulate(dq, s, sm, K_OFF + stage, col_word, lane)
            code = code_next

        ptx.cp_async_wait_all()
        # dQ_i = τ Σ_j dS K_j, written once in the input dtype (0 on a row block that visits nothing).
        store_rows(dq, dQ, z, h, first_row, N_q, col_word, scale, lane)

    return flex_backward_dq_tc


def backward_grids(cfg: BackwardConfig, p, kv_ordered: bool, dq_ordered: bool) -> tuple:
    """Backward rung v7's two launch grids: the key-block kernel's (H_kv, Z, key blocks · chunks) when its key
    blocks differ in length (the longest first, read from ``order``), else (key blocks · chunks, H_kv, Z); the dQ
    kernel's likewise over query blocks of 16·W rows and H_q."""
    kv = rt.grid_size(p.N_k, cfg.B_c) * cfg.chunks
    dq = rt.grid_size(p.N_q, cfg.B_c) * cfg.chunks
    return (((p.H_kv, p.Z, kv) if kv_ordered else (kv, p.H_kv, p.Z)),
            ((p.H_q, p.Z, dq) if dq_ordered else (dq, p.H_q, p.Z)))


def flex_backward_v7(Q, K, V, O, L, dO, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                     score_mod_grad=None):
    """Backward rung v7's FlexAttention backward (:func:`make_backward_kernel`, :func:`make_backward_dq_kernel`):
    :func:`flex_backward`'s arguments and result. Three launches — the ladder's preprocessing (D, L·log₂e), the
    key-block kernel (dK, dV), the dQ kernel (dQ, written once: no atomics, no conversion launch). The BlockMask
    may have any BLOCK_SIZE of multiples of 16 (:func:`backward_config_for_v7`); no block mask: every block full
    at the ladder's tiles.

    Host cost: the walks (:func:`kv_visit_table`, :func:`visit_table`) are built and copied on the first call per
    BlockMask, tile and G, and kept with the BlockMask; the bound arrays' device copies per array
    (:func:`_device_copy`)."""
    from fa2edu.flex import _score_mod_derivative

    for x, name in ((Q, "Q"), (K, "K"), (V, "V")):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must have 4 axes (B, H, N, d), as flex_attention, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if Q.shape[1] != K.shape[1] and not enable_gqa:
        raise ValueError(f"Q has H = {Q.shape[1]} heads but K and V have {K.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention, or give K and V Q's heads")
    grad = _score_mod_derivative(score_mod, score_mod_grad)
    bp = backward_launch.prepare_backward(Q, K, V, O, L, dO, causal=False, scale=scale)
    p = bp.fwd
    block_mask = _check_mods(score_mod, block_mask, p)
    block_size = (64, 64) if block_mask is None else tuple(block_mask.BLOCK_SIZE)
    cfg = backward_config_for_v7(p.d, p.dtype, block_size, rt.simulator_in_use())
    mask_mod = None if block_mask is None else block_mask.mask_mod
    score_mod = None if score_mod is None else at_lengths(score_mod, p.N_q, p.N_k)
    if score_mod_grad is None and _is_chain(score_mod):
        grad = "chain"                     # the chain's own derivative, compiled part by part
    else:
        grad = None if grad is None else at_lengths(grad, p.N_q, p.N_k)
    plan, arrays = plan_backward_mods(mask_mod, score_mod, grad)
    G = p.H_q // p.H_kv
    kv_walk, dq_walk = backward_walks_for(block_mask, cfg, p.N_q, p.N_k, G)
    # Alg. 2 line 4: D = rowsum(dO ∘ O), L·log₂e (padded to whole row blocks: P = 0, dS = 0 past N_q).
    stats, _ = backward_launch._preprocess(bp, cfg, None)
    common = (np.int32(p.N_q), np.int32(p.N_k), np.int32(G), np.float32(p.scale),
              np.float32(p.scale * math.log2(math.e)), *_bound_on_device(arrays))
    kv_grid, dq_grid = backward_grids(cfg, p, kv_walk.ordered, dq_walk.ordered)
    # Alg. 2 lines 5-24 without line 20: dK_j, dV_j, one block per key block j (and column chunk).
    kv_args = (p.Q, p.K, p.V, bp.dO, stats, bp.dK, bp.dV, kv_walk.counts, kv_walk.visits, kv_walk.order) + common
    _launch_mods(make_backward_kernel(cfg, plan, kv_walk.ordered), kv_grid, cfg.threads, p, kv_args,
                 4 * backward_v7.shared_words(cfg), mask_mod, score_mod)
    # Alg. 2 line 20 as a pass over query blocks: dQ_i = τ Σ_j dS_ij K_j, written once.
    dq_args = (p.Q, p.K, p.V, bp.dO, stats, p.O, dq_walk.counts, dq_walk.visits, dq_walk.order) + common
    _launch_mods(make_backward_dq_kernel(cfg, plan, dq_walk.ordered), dq_grid, cfg.threads, p, dq_args,
                 4 * backward_v7.dq_shared_words(cfg), mask_mod, score_mod)
    return backward_launch.finish_backward(bp)


#: the flex backward rungs: name → ``f(Q, K, V, O, L, dO, score_mod=None, block_mask=None, scale=None,
#: enable_gqa=False, score_mod_grad=None)``
BACKWARD_VERSIONS = {"v1": flex_backward_v1, "v7": flex_backward_v7}


def flex_backward(Q, K, V, O, L, dO, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                  score_mod_grad=None, *, rung="v7"):
    """FlexAttention backward on tensor cores: FA2 Algorithm 2 over a BlockMask, the mods compiled into the kernels.

    The same function as :func:`fa2edu.flex.flex_attention_backward`: with S = τQKᵀ, P = exp(MASK(score_mod(S))
    − L), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D) ∘ score_mod_grad(S), D = rowsum(dO ∘ O), dQ = τ dS K, dK = τ dSᵀ Q.
    Skipped blocks are never loaded, partial blocks call mask_mod per score, full blocks never call it; score_mod
    and its derivative are called once per visible score and kernel (twice in all on rung v7: its dQ kernel
    recomputes them). Cost per (batch, head), rung v7: 14·d·(visited area) MMA FLOPs (the key-block kernel's 4
    products, the dQ kernel's 3), no atomics; rung v1: 10·d·(visited area) and the dQ atomic adds.

    Parameters
    ----------
    Q, K, V, O, L, dO :
        As :func:`kernels_gpu.tensorcore.flash2_backward`: Q, O, dO (B, H_q, N_q, d), K, V (B, H_kv, N_k, d)
        float16 or bfloat16, L (B, H_q, N_q) float32 from :func:`flex_forward` (+inf on fully masked rows).
    score_mod, block_mask, scale, enable_gqa :
        The forward's (:func:`flex_forward`). Rung v7 runs any BLOCK_SIZE of multiples of 16
        (:func:`backward_config_for_v7`); rung v1 runs the BLOCK_SIZE as its tile (:func:`backward_config_for_v1`).
    score_mod_grad : callable, optional
        ``score_mod_grad(score, b, h, q_idx, kv_idx)``, d score_mod / d score at the scaled score. Default None:
        ``score_mod.score_mod_grad``; a score_mod with neither raises ValueError.
    rung : str, keyword only, default "v7"
        Which kernels: a key of :data:`BACKWARD_VERSIONS` ("v7": the ladder's fastest backward with the mods;
        "v1": the first flex backward, kept so that its results stay reproducible).

    Returns
    -------
    Flash2Backward
        ``(dQ, dK, dV)`` in the input dtype and kind; dK, dV summed over each GQA group; dQ = 0 on fully masked
        rows.
    """
    backward = BACKWARD_VERSIONS.get(rung) if isinstance(rung, str) else None
    if backward is None:
        raise ValueError(f"rung must be one of {sorted(BACKWARD_VERSIONS)}, got {rung!r}")
    return backward(Q, K, V, O, L, dO, score_mod=score_mod, block_mask=block_mask, scale=scale,
                    enable_gqa=enable_gqa, score_mod_grad=score_mod_grad)
