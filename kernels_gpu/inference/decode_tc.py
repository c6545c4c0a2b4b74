"""Split-KV decoding on tensor cores: the split program of :mod:`kernels_gpu.inference.decode`, second version.

:func:`kernels_gpu.decode_attention` launches this program for float16 and bfloat16 caches whose head sizes are
multiples of 8 (up to 256) and whose rows are 16-byte aligned; everything else (float32, odd sizes or strides) runs
the CUDA-core program of :mod:`kernels_gpu.inference.decode`, which stays reachable with ``kernel="cuda_core"``. Both
programs write the same partials, merged by the same launch, so everything around them (the split cut, the split
rule, the merge, paged lookups, the checks) is shared.

**Why a second program.** The CUDA-core program does the dot products on the FMA units: for each key a group of
16 lanes holds a slice of the key's row, multiplies it into the R query rows, and sums the slices with a butterfly
of shuffles. That is about 69 warp-instructions per key at R = 4, d = 128 (the first program's header counts
them) — for 512 bytes of K and V. At batch 32 there are enough warps on every SM to issue them while the loads are
in flight, and it streams at 0.88-0.91 of the copy rate; at batch 1 a 16k-key step has 8 KV heads × 32 splits
= 256 programs, two per SM, eight warps that cannot both keep the loads going and issue that many instructions:
it reached 0.34 of the copy rate. On tensor cores a warp multiplies 16 keys into a 16-row query tile with
``D/16`` MMAs for S = Q Kᵀ and ``D_v/8`` for O += P V: about 11 warp-instructions per key, 6× fewer, and the
loads go from HBM to shared memory by ``cp.async`` without passing through registers.

**The program** (one per split, KV head, sequence and 16-row tile of the R = G·N_new query rows; W warps):

1. The query tile: rows r0 … r0 + 15 of the group (row r is query head h·G + r // N_new, new token r % N_new;
   rows past R are zeros) go from HBM straight into MMA A-fragments in registers, once (FA2 Alg. 1 line 4).
2. **Split-K inside the program.** The split's keys are cut into tiles of ``TILE`` keys; warp w takes tiles
   w, w + W, w + 2W, … Each warp has its own two shared-memory stages and runs its own pipeline — it starts the
   copy of its next tile (``cp.async``, 16 bytes per lane and copy) before computing this one, and meets only
   its own lanes (``bar.warp.sync``): no block-wide barrier in the loop. A paged tile lies in one page
   (``page_size`` a multiple of ``TILE``), so one block-table lookup serves its 16 rows.
3. Per tile, FA2 Alg. 1 lines 8-10 on the warp's 16 × TILE scores: S = Q Kᵀ (``ldmatrix`` of K, MMAs into float32
   accumulators), keys past the split (and, causal, past a row's last visible key) masked to −∞, the online
   softmax in base 2 — the forward ladder's own step (``steps.row_softmax_f32``) —, Õ += P̃ V (P̃ from the
   accumulators, V by ``ldmatrix.trans``).
4. The W warps merge their (m, ℓ, Õ) through shared memory by the (m, ℓ) rule of FA1 Section 3.1, and the
   program writes its partial (O_s, L_s) in float32 — or, with a single split, O and L themselves. The merge of
   the splits is :func:`kernels_gpu.inference.decode.merge_kernel`, the launch both programs share — or, where the GPU
   holds a (sequence, KV head)'s S programs as one thread-block cluster, the programs themselves, through each other's
   shared memory (the last section below).

Costs as the first program: per (sequence, KV head), n_b·(d + d_v) cache elements read once; the tensor cores do
16/R times the useful FLOPs (the rows past R are zeros), which costs nothing here: at R = 4 and d = 128 a 16k-key
step is 2·16·(d + d_v)·16384·8 = 1.1 GFLOP, 3 µs at the MMA rate against 22 µs for its 67 MB at the copy rate.

**Prediction** (written before the first GPU run; H100, the ``benchmarks.decode`` grid, graph replay): the stream
becomes bound by HBM at every batch: at batch 1, 0.75-0.85 of the copy rate at 16k keys and 0.85-0.95 at 64k (the
first program: 0.34 and 0.59); at batch 32, 0.95-1.05 (the first: 0.88-0.91), within ±5 % of SDPA's best backend.
Registers: ~110 per thread at d = 128 (Q fragments 32, Õ 64, S 8); shared memory 2 stages × W warps × 16 keys ×
(d + d_v + 16) × 2 bytes = 70 KB at d = 128: 3 programs per SM, 12 warps, each with a 8 KB tile on its way.

**Measured** (H100 80GB HBM3, 2026-11-26, ``python -m benchmarks.decode``: the full grid, CUDA-graph replay, the
copy rate 3002 GB/s in the same run; ``benchmarks/results/nvidia-h100/decode.json``; two earlier runs of the same
code, before the plan of repeated calls, gave the same figures within ±0.02). The bytes that must move over the
time, as a fraction of the copy rate, at contexts 4k / 8k / 16k / 32k / 64k / 128k:

* batch 1: 0.33 / 0.46 / 0.58 / 0.71 / 0.83 / 0.89 (predicted 0.75-0.85 at 16k: missed; 0.85-0.95 at 64k:
  0.83, just under);
* batch 8: 0.63 / 0.83 / 0.88 / 0.94 / 0.94 / 0.97; batch 32: 0.77 / 0.94 / 0.95 / 0.96 / 0.98 / 0.95
  (predicted 0.95-1.05: met from 16k but at 128k, 0.95 — 0.98 in the earlier runs).

The CUDA-core program, in the same run with its own split rule, is slower by 1.07-1.16× at batch 1, 1.05-1.08× at
batch 8 and 1.05-1.08× at batch 32 from 16k keys: a smaller gain than the 6× fewer instructions per key of the
prediction promised — this program issues ~44 per key, not ~11 (below). Against SDPA's best backend (cuDNN, at
batch 8 and 128k flash) it runs at 0.81-0.915 of its speed at batch 1 and 0.78-0.94 at batch 8 and 32: cuDNN
reaches 1.01-1.04× the copy rate from 32k keys where this program reaches 0.94-0.98 (predicted within ±5 %:
missed). Registers: the compiler took 198 at d = 128, so ``max_registers`` caps it at 168 (3 programs per SM;
ptxas reports 8 bytes of spill).

Why batch 1 stays below the prediction (Nsight Compute on an H200, batch 1, 16k keys, 32 splits:
``benchmarks/results/nvidia-h200/decode_tc_ncu_*.txt``): the grid is 256 programs — two per SM, 8 warps — and
DRAM ran at 42-49 % of its peak. Each warp issued ~700 instructions per 16-key tile — ~44 per key, where the
prediction counted the MMAs, copies and softmax at ~11 and left out the 64-bit address arithmetic of every copy and
``ldmatrix``, the largest part — ~5.5 cycles apart: waiting on fixed-latency dependencies (1.6
cycles per issue) and on memory (1.0-1.7). So a tile takes a warp ~2 µs and its 8 tiles ~16 µs, plus the program's
prologue and epilogue; shared memory (17 KB per warp for two stages) and registers cap an SM at 12 warps, so more
splits do not add warps (48 splits: slower). What was tried, one change at a time (H200, same harness,
``decode_tc_explore_*.log``):

* the split rule of the first version saw one resident slot — the occupancy was asked before the function was
  allowed more than 48 KB of shared memory — and launched one split at batch 1 (417 µs at 16k keys); fixed in
  ``driver_launch.resident_blocks``;
* the merge launch: one warp per row taking one split per trip cost 8.0 µs at batch 1, 16k, 32 splits (the split
  programs: 25.2 µs); a block per row with 8 splits' loads in flight per warp, folded by the online (m, ℓ) rule:
  3.2 µs (profiled); graph time 47.4 → 35.7 µs;
* a lane's copy addresses computed once per tile and stepped by constants (no division per copy): 35.7 → 32.5 µs
  at batch 1 and 16k, 92.5 → 83.4 µs at 64k, 573 → 522 µs at batch 32;
* whole tiles copied without bounds tests or address selects: 12 % fewer instructions (6.6 M → 5.8 M at batch 1,
  16k), time unchanged (32.5 → 32.6 µs; batch 32: 522 → 523 µs) — kept, as the simpler loop for the common tile;
* three stages per warp (two tiles on their way): no gain anywhere (batch 1, 16k: 32.6 → 34.4 µs) — the warps wait
  on their own instruction chains as much as on memory;
* the program that finishes a group's splits last merging them (an atomic counter per group, no merge launch):
  no gain (36.9 µs at 32 splits, 32.1 at 16): its tail read the partials a few splits per round trip, as slowly as
  the launch it replaced; taken out again.

**Second round: the fixed costs of a program** (H100, 2026-11-26). Read off the SASS (``cuobjdump -sass`` of the
ptxas output, no GPU needed): a warp issued ~1500 instructions before its first copy — 32 scalar loads of the
query fragments, each with 64-bit index arithmetic, behind five 64-bit divisions — and in the epilogue every
shared-memory store of Õ paid numba's negative-index test. Changes: the
query tile now travels like a K tile (``cp.async`` into the warp's last stage, the first request the program
makes, then ``ldmatrix`` into A-fragments); the divisions by ``row_tiles`` and ``N_new`` run only when they are
not 1 and q's row offset needs none (b·H_q·N_new + h·R); the epilogue indexes with unsigned integers (its stores
become ``STS.64``); the merge is a programmatic dependent launch (``griddepcontrol``, which the program triggers
after its loop). The machine code (float16, d = 128, causal, 256-key pages; ``decode_tc_sass.json``, from
:mod:`kernels_gpu.inference.decode_inspect`): 4048 → 2480 instructions, 1518 → 203 of them before the first copy.
Predicted: batch 1 at 16k keys 38.6 → 34-35.5 µs. Measured (``--quick``, one machine, the three in a row:
``decode_tc_prologue_ab_*.json`` and ``.log``): batch 1 at 4k / 16k / 64k, 0.33 / 0.58 / 0.80 of the copy rate
before, 0.37 / 0.62 / 0.83 after without the early merge, 0.40 / 0.63 / 0.84 with it (16k: 38.1 → 35.2 µs, within
the prediction); batch 32 unchanged (0.95-0.98): the fixed costs weigh only where programs are short.

Where the rest of a batch-1 step goes — ``globaltimer`` stamps of every warp (a traced copy of this program, 16k
keys, 32 splits; ``decode_tc_trace.json``, the shortest of 5 launches): the programs start within 0.2 µs of each
other; a warp's query rows land after 2.1 µs (median) and its first tile after 4.7 µs (up to 12.2: all 1024 warps
ask at once and the memory serves them in turn); the loops end at 24.5 µs (median), the last at 27.6; the split
launch spans 28.6 µs against the 22.4 µs its bytes take at the copy rate. In one launch's stamps of every warp
(``decode_tc_trace_16k_S32.npy``: start, query rows, first tile, loop end, end in ns, SM, tiles) the SMs that hold
one program (8 of 132) end their loops at 20.4 µs (median), those that hold two at 25.1: the step waits for the
doubled SMs. Hence the split rule of
:func:`kernels_gpu.inference.decode.default_num_splits`, at most one program per SM — measured over split counts
(``decode_split_sweep.json``): batch 1, 16 splits (128 programs) against 32, 33.9 against 35.2 µs at 16k and 56.7
against 59.6 at 32k; 22 splits (176 programs) slower than both. Eight warps per program, or three stages, with
one program per SM: no gain (``decode_split_sweep_warps_stages.json``: within −1 to +4 % of four warps and two
stages).

What the memory sees (Nsight Compute, ``--clock-control none``, one step each: ``decode_tc_ncu_dram_vs_cudnn.txt``):
at batch 32 and 16k keys this program and cuDNN's read the same 2.15 GB from DRAM — nothing is fetched twice — but
cuDNN's kernel keeps DRAM at 91.9 % of its peak for 698 µs and this one at 86.4 % for 742 µs, with 1.33× as many
L2 read sectors (134 M against 101 M) of which 34 % hit (cuDNN's: 0.01 %): this program's 16-byte copies reach the
L2 as more, smaller requests. Telling the L2 to fetch whole 128-byte lines (``cp.async … .L2::128B``) made every
shape 0.6-2.1 % faster (``decode_tc_l2_prefetch_ab.json``; ``.L2::256B``: a little less), and the copies now
carry it. The full grid after these changes is in ``benchmarks.decode``'s header: batch 1 at 16k and 32k reaches
0.66 and 0.78 of the copy rate (target 0.8: still missed; cuDNN 0.69 and 0.73 in the same run), batch 32 at 16k
and more 0.97-1.00 (cuDNN 1.02-1.03). (Those runs timed graphs of a single call at batch 1 from 32k keys, which
adds the graph's launch latency; with at least four calls per graph, the harness since: 0.71 and 0.82 — the
32k target met —, cuDNN 0.73 and 0.86.)

**Bulk copies, tried** (H100, 2026-11-26; :data:`COPY` = "bulk", kept as a choice, not the default). Whole tiles
by the copy engine: lane r asks for K's row r, lane 16 + r for V's, one ``cp.async.bulk`` of 256 bytes each (the
padded shared-memory rows rule out one copy per tile), completing on an mbarrier per stage that lane 0 arms with
the tile's 8 KB (``ptx.bulk_copy``, ``mbar_*``; the split's partial last tile and the query rows keep
``cp.async``, which fills zeros). Prediction: one request per row instead of 16 lane-sized ones brings the DRAM
rate toward cuDNN's — batch 32, 16k keys 1-6 % faster — and batch 1 within ±3 %. Measured
(``python -m benchmarks.profilers.decode_variants``, graph replay, median of 5 rounds in turn with cuDNN:
``decode_tc_bulk_ab.json``), bulk against ``cp.async``: batch 1, 16k 39.5 against 33.1 µs, 64k 124.2 against
100.0; batch 8, 32k 474.3 against 371.4; batch 32, 4k 194.0 against 190.8, 16k 753.2 against 734.0 — slower at
every shape (prediction failed). Why, from the machine code and Nsight Compute (``decode_tc_ncu_sections_b32_16k
.txt``, one call each at batch 32, 16k): a bulk copy takes its operands from uniform registers, so 16 lanes with 16
different rows become a loop the compiler writes around the copy (``ELECT``, four ``R2UR``, ``UBLKCP``, a branch:
SASS of ``decode_inspect``), twice per tile — the warps issue 1.7× as often (0.24 against 0.14 instructions per
scheduler and cycle) for a lower DRAM rate (85.8 % of peak against 88.4 %; cuDNN 92.1 %). Where a program holds
an SM alone (batch 1 and 8: four warps per SM) the loop is on every tile's critical path and costs 19-28 %.
The same profile puts this program's L2 hit rate at 48 % (cuDNN's: 1 %) for the same DRAM bytes — likely the lines
its ``.L2::128B`` hint fetches whole, found there by the next requests (not separated by a counter yet) — and counts
265 k local-memory requests from ptxas's 8 bytes of spill, small beside 67 M sectors of K and V. What is left of the
gap to cuDNN's 92 % of peak at batch 32 is not in the number of copy instructions; one bulk copy per tile (an
unpadded tile, or a tensor map with a swizzle so ``ldmatrix`` stays free of bank conflicts) is the next thing to
try.

**Tensor copies** (:data:`COPY` = "tensor"; H100, 2026-11-26). One instruction per box of the tile, from one lane:
the copy engine reads K's and V's 16 rows × 64 columns through a tensor map (:mod:`kernels_gpu.tensor_map`,
dims column, row, head, sequence or page: contiguous and paged caches alike) and writes them **swizzled** — chunk
c of row r at chunk c ^ (r % 8) of its 128-byte row —, so the rows need no padding for ``ldmatrix`` to stay free of
bank conflicts, and one tile is four requests (d = 128) where ``cp.async`` makes 16 instructions of 32 lanes. Lane
0 arms the stage's mbarrier with the tile's bytes; the query rows and a split's last, partial tile keep ``cp.async``
(the copy engine fills zeros only past the tensor's edge, not past the split) into the same swizzled layout. ptxas
(``decode_inspect``, no GPU): 8 tensor copies, 33 ``cp.async`` (the partial tile, the query rows), 168 registers
with 40 bytes of spill (the ``cp.async`` program: 8), 64.1 KB of shared memory (68.1). **Prediction** (before the
GPU run): the DRAM sees whole boxes, as from cuDNN's kernel: batch 32 from 16k keys 1-4 % faster (0.97-1.00 of the
copy rate → 1.00-1.03), batch 1 at 16k keys 2-8 % faster (fewer instructions per tile on the critical path).

**Measured** (H100 80GB HBM3, ``python -m benchmarks.profilers.decode_variants``, graph replay, median of 3 rounds with
cuDNN in turn; ``decode_tc_tensor_ab.json``): against ``cp.async``, batch 32 at 4k / 16k keys 180.7 / 700.3 µs
against 191.1 / 723.7 (5.5 % and 3.3 % faster; 0.99 and 1.02 of the copy rate), batch 8 at 32k 357.0 against
372.1 (4 %), batch 1 at 64k 96.4 against 99.6 (3 %) — the batch-32 prediction met, 1-2 points above it —, but
batch 1 at 16k 32.1 against 32.1: unchanged (predicted 2-8 % faster: missed). cuDNN in the same rounds: 178.6 /
695.7, 352.0, 95.2, 30.7 µs — this program is now within 0.6-1.4 % of it from batch 8 on, 4.5 % behind at batch 1
and 16k keys (before: 3-6 % behind everywhere). Every output is bit-identical to the ``cp.async`` program's (288
cases: both dtypes, d = 64, 128, 256, paged and contiguous, causal, GQA, N_new up to 3, split counts; then
``test_tensor_copies_give_the_bits_of_cp_async``); compute-sanitizer memcheck: 0 errors
(``sanitizer_decode_tensor_copies_memcheck.log``). Nsight Compute, one call each (``decode_tc_tensor_ncu_vs_cudnn
.txt``): at batch 32, 16k keys this program keeps DRAM at 92.05 % of its peak for 697.2 µs, cuDNN's kernel (an
sm80 ``wmma`` kernel, 256 blocks of 128 threads, 86 KB of shared memory) at 92.13 % for 696.3 — the stream is at
the memory's limit for both; at batch 1 and 16k keys the split programs take 30.4 µs against cuDNN's 29.0 (cuDNN
runs 32 splits, 256 blocks, where the split rule here runs 16) and the merge 5.6 µs against cuDNN's reduction's
4.5. What did not help, with tensor copies (``decode_tc_tensor_stages_warps.json``, ``decode_tc_tensor_knobs
.json``): 3 or 4 stages (0-2 % slower), 8 warps (within ±0.3 %), 3 warps (1-7 % slower), 2 warps (batch 1 and 8:
17-21 % slower; batch 32: 0.2-0.9 % faster), the L2 asked for 128-byte lines or none instead of 256 (within
±2 %), 8 or 32 splits at batch 1 (slower: the split rule's 16 stands), 3 or 4 splits at batch 8, with 2, 4 or 8
warps (4k to 16k keys: within 0.5 % or up to 6 % slower than the rule's 2 splits of 4 warps,
``decode_tc_tensor_b8_splits.json``), letting the merge launch be scheduled at
the programs' start instead of after their loops (``griddepcontrol.launch_dependents`` moved; batch 1 and 8, 4k to
64k keys, 5 rounds: within ±0.3 %, ``decode_tc_tensor_trigger_start.json``, from a ``trigger`` knob of
``benchmarks.profilers.decode_variants`` taken out again — the merge's launch was already hidden). The full grid with
tensor copies (the two-warp programs of :func:`kernels_gpu.inference.decode.tc_warps` at batch 32, and — below — no
register cap) was (the run of 19:16; ``benchmarks.decode``'s header has the latest): batch 1 at 16k / 32k keys 0.71 /
0.84 of the copy rate, batch 8 and 32 from 16k 0.98-1.05; against cuDNN 1.002-1.008× at batch 32 from 16k keys and batch
8 from 64k, 0.975-0.997× elsewhere but at batch 1 with 4k keys (0.945). In numba's simulator the copy engine is a twin
and the tensor maps stand-ins (:mod:`kernels_gpu.tensor_map`), so CI runs this path as the GPU does
(``test_tensorcore_program_tensor_copies``: the bits of ``cp.async``).

Where batch 1 stands (Nsight Compute, one call each, ``decode_tc_tensor_ncu_b1_splits.txt``): the split
programs take 12.3 µs at 4k keys and 30.2 at 16k with the rule's 16 splits, 12.7 and 30.6 with cuDNN's 32, 12.7
and 31.5 with 24; cuDNN's split kernel 11.5 and 28.9. So the gap is not the split count: this program's own time
is 0.8-1.3 µs longer than cuDNN's kernel's, for the same bytes, at the same 69-72 % of the DRAM peak over the
launch — fixed costs of a program (its prologue, its epilogue's merge of the warps through shared memory), which
the graph step cannot hide. The merge launch (5.6 µs alone, against cuDNN's 4.5) is mostly hidden behind it. One
such cost tried: the sequence's length, on which the split's first copy waits, loaded before the query rows' copies
instead of after them (an inline-PTX block is a barrier to the compiler, so the load stayed where it was written):
no change, 14.2-14.5 against 14.2-14.3 µs at 4k keys, 32.2 against 32.1-32.2 at 16k (the trees alternated twice,
``decode_tc_seqlen_first_{old,new}_{1,2}.json``; not kept). Per SM (Nsight Compute metrics, batch 1, 16k keys,
``decode_tc_tensor_ncu_b1_16k_sm_activity.txt``): this program's SMs are active 47.7 k cycles on average and 50.9 k
at most, 4 SMs not at all (128 programs on 132 SMs), in 54.9 k cycles elapsed; cuDNN's 45.4 k and 49.5 k (its 256
blocks leave no SM idle: the 8 SMs with one block are active 37.4 k) in 53.4 k — the same 67 MB from DRAM, 3.4 M
against 3.2 M warp instructions, one warp per scheduler here against 1.9 there (7.1 against 13.6 cycles between a
warp's instructions). The busiest SM streams the same 1024 keys in both; the difference is how fast it does.

**No register cap with tensor copies** (same day). Nsight Compute's stall sampling (``decode_tc_tensor_ncu_stalls
.txt``, batch 1 at 16k and batch 32 at 4k) put the largest share of a warp's 7.0 cycles between instructions on
the L1TEX scoreboard, 2.7 (38 %): waits for local or global memory — and with tensor copies the loop reads no
global memory, but it did read the 40 bytes ptxas spilled under the cap of 168 registers. That cap bought three
programs per SM, which the split rule and :func:`kernels_gpu.inference.decode.tc_warps` no longer ask for (at most one
four-warp program per SM, or two-warp ones), so tensor copies are compiled uncapped (:func:`register_cap`): 206
registers, no spill. Prediction: batch 1 and 8 a few per cent faster, batch 32 unchanged. Measured (the two trees
alternated twice, cuDNN in every run; ``decode_tc_tensor_nocap_{old,new}_{1,2}.json``), time over cuDNN's before →
after: batch 1 at 16k 1.040-1.041 → 1.015-1.018, at 64k 1.014-1.015 → 1.000-1.004, at 4k 1.050-1.053 →
1.014-1.047; batch 8 at 4k 1.031-1.034 → 1.016-1.018, at 32k 1.019-1.022 → 1.009-1.013; batch 32 at 4k
1.007 → 0.995-1.003, at 16k 0.998-1.007 → 0.993-1.002. Sampled again uncapped (batch 1, 16k keys,
``decode_tc_tensor_ncu_stalls_nocap.txt``): the split programs take 29.8 µs against cuDNN's 28.9 (30.2 before);
of 3004 stall samples 1295 wait on the long scoreboard — now the tiles themselves (mbarrier) — and 792 on
fixed-latency dependencies ("wait": 26 %, cuDNN's kernel 7.5 %): S = Q Kᵀ is two chains of 8 dependent MMAs per
16-key tile. Next to try: S's even and odd k-steps into two sets of accumulators (four chains of 4), or 32-key
tiles.

**Two accumulator chains for S** (:data:`CHAINS` = 2, 2026-11-26). S's odd k-steps go into a second set of eight
accumulators, added to the first after the last k-step: four chains of four MMAs per tile instead of two of eight.
ptxas: the same 206 registers, no spill, 32 MMAs. Prediction: the fixed-latency share of the stalls halved, the
split programs at batch 1, 16k keys 29.8 → 29.0-29.3 µs (2-3 %). Measured (``python -m
benchmarks.profilers.decode_variants
--variants chains=1 chains=2 --rounds 5``, seven shapes, cuDNN in every round; ``decode_tc_chains_ab.json``):
graph time 31.3 → 31.1 µs at batch 1, 16k keys, 95.2 → 94.9 at 64k, 52.8 → 52.5 at batch 8, 4k, 353.2 → 352.8 at
batch 8, 32k, 698.1 → 697.3 at batch 32, 16k, unchanged at batch 1, 4k and batch 32, 4k: faster at five shapes of
seven, by 0.1-0.7 %, a third of the prediction. Kept (the default). cuDNN in the same rounds: 30.6, 95.3, 51.9,
351.5, 695.2 µs. GPU tests with it (``gpu_tests_decode_chains.log``): 56 passed; compute-sanitizer memcheck of
``kernels_gpu.inference.decode_sanitize`` (``sanitizer_decode_chains_memcheck.log``): 0 errors.

**Tried, not kept: the tensor maps prefetched.** Lane 0 of each warp issuing ``prefetch.tensormap`` for K's and
V's maps at the program's start, before the query rows' copy, so that the first tensor copy would not wait for
the map's 128 bytes (the maps live in global memory, not in the launch's parameters). Prediction: batch 1 at 4k
keys 14.1 → 13.8 µs, 16k 0.5-1 % faster, batch 8 and 32 unchanged. Measured (a ``prefetch`` knob of
``benchmarks.profilers.decode_variants``, 0 against 1, six shapes, 5 rounds; ``decode_tc_prefetch_maps_ab.json``): 14.1
/ 20.7 / 31.6 / 52.8 µs without, 14.1 / 20.9 / 31.4 / 52.9 with, at batch 1 with 4k / 8k / 16k / 32k keys; batch 8
and 32 at 4k within 0.1 µs — no change: the map's fetch is not on the program's critical path. Taken out again.

**Tried, not kept: 32-key tiles** (:data:`TILE`, 2026-11-27). A warp's stage holds two 16-key blocks of K and V
(boxes of 32 rows), so the waits, the copies' issue and the online softmax's rescale of Õ (64 multiplies a lane)
come once per 32 keys, and a warp has twice the bytes on their way. Prediction (before the run): batch 8 and 32
from 16k keys 0-2 % faster, batch 1 within ±2 % at 16k and up to 3 % slower at 4k (a warp's last tile, computed
after it lands, is twice as long). Measured (H100, ``python -m benchmarks.profilers.decode_variants --variants tile=16
tile=32 --rounds 5``, seven shapes, cuDNN in every round; ``decode_tile_ab.json``): 32-key tiles slower at every
shape — batch 1 at 4k / 16k / 64k keys 14.4 / 31.2 / 95.9 µs against 14.0 / 30.7 / 95.3, batch 8 at 4k and 32k
52.9 and 355.1 against 52.6 and 354.3, batch 32 at 4k and 16k 180.3 and 698.9 against 179.1 and 691.4 (0.2-2.9 %):
the large-batch prediction failed. The instructions saved per byte were not what held the stream back where the
batch fills the GPU (DRAM already ran at cuDNN's 92 % of its peak there); the tile stays 16, the knob stays (the
simulator tests run 32 and 48).

**The splits merged inside their cluster** (``cluster`` = S; :func:`kernels_gpu.inference.decode._cluster_merge`
decides; 2026-11-27). What the merge launch costs a step, measured first (``python -m
benchmarks.profilers.decode_merge_cost``, H100, graph replays of the whole step against the same plan with its merge
launch replaced by nothing;
``decode_merge_cost.json``): 2.6-3.0 µs at batch 1 with 4k / 8k / 16k / 32k keys (14.0 → 11.0, 20.0 → 17.1, 31.0 → 28.3,
52.1 → 49.5 µs) and 2.9-3.0 µs at batch 8 — more than this program trails cuDNN by. So the S programs of a
(sequence, KV head) run as one thread-block cluster: each keeps its partial (O_s, L_s) in its own shared memory,
the cluster meets at a barrier (``barrier.cluster`` arrive.release / wait.acquire), program s merges its share of
the group's outputs reading the S partials from the other programs' shared memory (``mapa`` + ``ld.shared::cluster``:
distributed shared memory) by the merge launch's rule, and a second barrier keeps every program's memory alive
until the reads are done. No partials in HBM, no second launch. Each program asks for more than half an SM's shared
memory (:data:`kernels_gpu.inference.decode.CLUSTER_SHARED_BYTES`), so that an SM holds one, as the split rule plans,
and the path is taken only where ``cuOccupancyMaxActiveClusters`` says every cluster of the grid fits at once.
Prediction: 2-2.5 µs less a step wherever it applies (two barriers and one round of reads from a neighbour's shared
memory, ~0.5-1 µs, for the merge's 3). Measured (``python -m benchmarks.profilers.decode_variants --variants cluster=1
cluster=0 --rounds 5``, cuDNN in every round; ``decode_cluster_ab.json``): batch 8 with 4k and 16k keys (2 splits,
clusters of 2) 50.9 and 180.8 µs against 52.9 and 183.0 with the merge launch — 2.0 and 2.2 µs, as predicted, and
ahead of cuDNN's 52.1 and 181.3 —; batch 1 unchanged (14.0 / 30.9 / 95.0 µs at 4k / 16k / 64k): its 8 clusters of 16
programs do not fit an H100 one program per SM (``cuOccupancyMaxActiveClusters``: 7 for clusters of 10 to 16
programs, 15 of 8: ``decode_cluster_occupancy.log``, ``benchmarks.profilers.decode_variants --cluster-occupancy``), so
the call keeps the merge launch. Letting two programs share an SM
so that they fit (``cluster_shared=0``, ``decode_cluster_shared_ab.json``) made batch 1 slower — 14.8 against 14.1
µs at 4k keys, 32.4 against 30.9 at 16k, 103.0 against 95.0 at 64k —: the cluster is placed on half as many SMs.
Bit for bit, the cluster's merge adds the S terms in split order where the merge launch folds them in two warps'
blocks: the two agree within float16 rounding, and each meets the oracle's rule (GPU tests:
``test_splits_merged_in_their_cluster``; memcheck and racecheck of :mod:`kernels_gpu.inference.decode_sanitize`, whose
first launch is clustered: 0 errors, 0 hazards, ``sanitizer_decode_cluster_*.log``). numba's simulator runs one block
at a time, so the cluster path is GPU-only; CI runs the merge launch.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int64, uint32, uint64

from kernels_gpu import ptx, tensor_map
from kernels_gpu.inference.decode_io import cache_rows
from kernels_gpu.tensorcore.steps import Config, make_steps

__all__ = ["TILE", "supports", "split_kernel_tc", "shared_bytes", "layout", "register_cap"]

#: keys per warp tile (a multiple of 16: 16 is one ``ldmatrix`` row block of K and the k-extent of one O += P̃ V
#: step; a larger tile is that many of each per stage). A paged cache whose pages do not hold whole tiles of TILE
#: keys runs tiles of 16 (:func:`tile_for`).
TILE = 16
#: shared-memory stages per warp (the tile being computed and the next one on its way)
STAGES = 2
#: how whole tiles travel: "tensor" (one ``cp.async.bulk.tensor`` per box of 16 rows × 64 columns, by the copy
#: engine through a tensor map, swizzled; completion on an mbarrier per stage), "bulk" (one ``cp.async.bulk`` per
#: row) or "cp.async" (16 bytes per lane and instruction, completion by commit groups). A split's last, partial
#: tile, the query rows and head sizes that are not multiples of 16 always take ``cp.async`` (zero fill); "tensor"
#: applies to head sizes multiples of 64, on PyTorch CUDA caches (and in numba's simulator, with stand-in maps):
#: kernels_gpu.inference.decode falls back to "cp.async" elsewhere.
COPY = "tensor"
#: independent accumulator sets of S = Q Kᵀ per warp tile: 1 (each 16 × 8 tile of S one chain of d / 16 dependent
#: MMAs) or 2 (even and odd k-steps apart, two chains of half the length, added after the last k-step)
CHAINS = 2
LN2 = 0.6931471805599453
#: registers per thread asked of the compiler for head sizes ≤ 128 (None: its own choice). Uncapped it takes 198
#: at d = 128 (ptxas): 2 programs per SM by registers; 168 fits 3 (3 · 128 · 168 ≤ 65 536, as the 70 KB of shared
#: memory does) for 8 bytes of spill (``python -m kernels_gpu.inference.decode_inspect``).
REGISTER_CAP = 168


def register_cap(d: int, d_v: int, copy: str = COPY) -> int | None:
    """The ``max_registers`` the program is compiled with: :data:`REGISTER_CAP` for head sizes up to 128 with
    ``cp.async`` or bulk copies, else None (the compiler's own choice). Tensor copies take no cap: the split rule
    and :func:`kernels_gpu.inference.decode.tc_warps` never ask an SM for more than one four-warp program (or two of two
    warps), so 206 registers (ptxas, d = 128) cost no residency, where the cap of 168 spilled 40 bytes."""
    return REGISTER_CAP if max(d, d_v) <= 128 and copy != "tensor" else None


def tile_for(page: int) -> int:
    """Keys per warp tile for a cache of ``page``-key pages (0: contiguous): :data:`TILE` where the pages hold
    whole tiles of it, else 16."""
    return TILE if page % TILE == 0 else 16


def supports(storage: str, d: int, d_v: int, page: int, vec: int) -> bool:
    """Whether the tensor-core program takes this call: 16-bit storage, head sizes multiples of 8 up to 256 (16-byte
    chunks), rows of q and of the caches 16-byte aligned (``vec`` = 4 words, from the strides and addresses), and a
    page size (paged caches) that is a multiple of 16, so that a tile never straddles two pages."""
    return (storage in ("float16", "bfloat16") and d % 8 == 0 and d_v % 8 == 0 and 8 <= d <= 256
            and 8 <= d_v <= 256 and vec == 4 and page % 16 == 0)


def layout(d: int, d_v: int, warps: int, stages: int = STAGES, copy: str = COPY, tile: int = 16,
           cluster: int = 0) -> dict:
    """The shared-memory layout (32-bit words): rows of K and V tiles padded by 4 words (``ldmatrix`` reads 8 rows in
    8 different bank groups), ``stages`` stages per warp; after the loop the same memory holds the warps' (m, ℓ,
    Õ). Then, from word ``BARS`` on, one 8-byte mbarrier per stage and warp (for bulk and tensor copies); with
    ``cluster``, from word ``CL`` on, the program's partial for the cluster's merge: L_s of 16 rows, then O_s
    (DV floats a row). With
    ``copy="tensor"`` the rows are not padded but swizzled (:mod:`kernels_gpu.tensor_map`): a stage is K's then V's
    boxes of ``tile`` rows × 64 columns (32·tile words each), every stage 1024-byte aligned."""
    D, DV = -(-d // 16) * 16, -(-d_v // 16) * 16
    if copy == "tensor":
        RS, RSV = D // 2, DV // 2
        stage = -(-tile * (RS + RSV) // 256) * 256
    else:
        RS, RSV = D // 2 + 4, DV // 2 + 4
        stage = tile * (RS + RSV)
    OS = DV + 4                                          # floats per Õ row in the merge area
    merge = 2 * 16 * warps + 16 * warps * OS
    bars = -(-max(warps * stages * stage, merge) // 4) * 4       # 16-byte aligned
    cl = -(-(bars + 2 * stages * warps) // 4) * 4
    words = cl + (16 + 16 * DV if cluster else 0)
    return dict(D=D, DV=DV, RS=RS, RSV=RSV, STAGE=stage, WARP_WORDS=stages * stage, OS=OS, BARS=bars, CL=cl,
                words=words)


def tensor_copy_applies(d: int, d_v: int, simulator: bool) -> bool:
    """Whether whole tiles may travel by tensor copies (``copy="tensor"``): head sizes multiples of 64 (boxes of 64
    columns, 128 bytes). (In numba's simulator too: its tensor maps are stand-ins, kernels_gpu.tensor_map.)"""
    return d % 64 == 0 and d_v % 64 == 0


def shared_bytes(d: int, d_v: int, warps: int, stages: int = STAGES, copy: str = COPY, tile: int = 16,
                 cluster: int = 0) -> int:
    """Dynamic shared memory of one program, in bytes."""
    return 4 * layout(d, d_v, warps, stages, copy, tile, cluster)["words"]


@functools.lru_cache(maxsize=None)
def split_kernel_tc(storage: str, d: int, d_v: int, warps: int, page: int, causal: bool, simulator: bool,
                    stages: int = STAGES, copy: str = COPY, chains: int = CHAINS, tile: int = 16,
                    cluster: int = 0):
    """Compile-time specialisation: storage dtype, head sizes, warps per program, page size (0: contiguous cache),
    causal masking, shared-memory stages per warp (2 to 4: 1 to 3 tiles on their way while one is computed), how
    whole tiles are copied (:data:`COPY`), keys per warp tile (``tile``: 16 to 64, dividing the page), and
    ``cluster``: 0, or the split count S when the S programs of a (sequence, KV head) run as one thread-block
    cluster and merge their partials through distributed shared memory (one row tile; GPU only). Parameters
    as :func:`kernels_gpu.inference.decode.split_kernel` (flat word arrays; the same launch arguments), then ``ktm``,
    ``vtm``: the tensor maps of K and V (16 uint64 words each; read only with ``copy="tensor"``); grid (num_splits ·
    row_tiles, H_kv, B) with row tiles of 16 rows; block 32·warps threads; :func:`shared_bytes` of dynamic shared
    memory."""
    if stages not in (2, 3, 4):
        raise ValueError(f"stages must be 2, 3 or 4, got {stages}")
    if chains not in (1, 2):
        raise ValueError(f"chains must be 1 or 2, got {chains}")
    if copy not in ("bulk", "cp.async", "tensor"):
        raise ValueError(f"copy must be 'bulk', 'cp.async' or 'tensor', got {copy!r}")
    if copy == "tensor" and not tensor_copy_applies(d, d_v, simulator):
        raise ValueError(f"tensor copies need head sizes multiples of 64, got d = {d}, d_v = {d_v}")
    if tile % 16 or not 16 <= tile <= 64 or page % tile:
        raise ValueError(f"tile must be 16, 32, 48 or 64 keys and divide the page size {page}, got {tile}")
    if cluster and not 2 <= cluster <= 16:
        raise ValueError(f"cluster must be 0 or a split count from 2 to 16, got {cluster}")
    TILE = tile
    CLUSTER = cluster
    W = warps
    THREADS = 32 * W
    NS = stages
    CHAINS = chains
    lay = layout(d, d_v, W, NS, copy, TILE, CLUSTER)
    D, DV, RS, RSV, STAGE, WARP_WORDS, OS, BARS, CL = (lay[k] for k in ("D", "DV", "RS", "RSV", "STAGE",
                                                                        "WARP_WORDS", "OS", "BARS", "CL"))
    CL_O = CL + 16                           # (cluster merge: L_s of 16 rows at CL, then O_s, DV floats a row)
    POS_INF = float32(math.inf)
    DW, DVW = d // 2, d_v // 2               # words of a real row of K (and q), of V (and O)
    CH_K, CH_V = D // 8, DV // 8             # 16-byte chunks of a padded row
    KS = D // 16                             # 16-wide k-steps of S = Q Kᵀ
    NT = TILE // 8                           # 16 × 8 accumulator tiles of S per warp tile
    KV = TILE // 16                          # 16-key k-steps of Õ += P̃ V
    NOV = DV // 8                            # 16 × 8 accumulator tiles of Õ
    V_OFF = TILE * RS                        # V's rows follow K's in a stage
    Q_LEN, S_LEN, O_LEN = 4 * KS, 4 * NT, 4 * NOV
    L_AREA, O_AREA = 16 * W, 32 * W          # merge area (floats): m of 16W rows, then ℓ, then Õ (OS per row)
    CAUSAL = causal
    NEG_INF = float32(-math.inf)
    # Whole tiles by the copy engine: lane r < 16 asks for K's row r, lane 16 + r for V's (TILE = 16 rows each),
    # one bulk copy of the row's d (d_v) values; the stage's mbarrier completes when all TILE·(d + d_v) values
    # have landed. Only where every chunk of a row is data (the padding columns are never written).
    BULK = copy == "bulk" and D == d and DV == d_v and TILE == 16
    # Whole tiles by tensor copies: lane 0 asks the copy engine for K's and V's boxes of TILE rows × 64 columns
    # (the tensor maps ``ktm``, ``vtm``: kernels_gpu.tensor_map), which land swizzled; every other copy (query
    # rows, a split's last tile) then writes the same swizzled layout, and every ldmatrix reads it.
    TENSOR = copy == "tensor"
    MBAR = BULK or TENSOR                    # whole tiles complete on an mbarrier per stage
    BOX = TILE * 32                          # words of one swizzled box: TILE rows × 128 bytes
    PAGE = page
    TILE_BYTES = TILE * (d + d_v) * 2
    # The forward ladder's steps (chapter 14), for a tile of TILE keys: the MMA into an accumulator tile, and the
    # online softmax of one of a lane's two rows — sized by d_v, the width of the Õ it rescales.
    st = make_steps(Config(d=d_v, warps=W, B_c=TILE, dtype=storage, causal=causal, simulated=simulator))
    mma_into, zero, row_softmax = st["mma_into"], st["zero"], st["row_softmax_f32"]
    pack = ptx.pack_f16x2 if storage == "float16" else ptx.pack_bf16x2
    ldmatrix, ldmatrix_trans = ptx.ldmatrix_x4, ptx.ldmatrix_x4_trans
    shfl_xor, ex2 = ptx.shfl_xor, ptx.ex2
    # all but the NS − 1 newest groups
    wait_oldest = {2: ptx.cp_async_wait_one, 3: ptx.cp_async_wait_two, 4: ptx.cp_async_wait_three}[NS]
    # 16-byte copies with the L2 told to fetch whole 128-byte lines (0.6-2.1 % faster than without the hint, batch
    # 1 to 32: ``decode_tc_l2_prefetch_ab.json``)
    copy16 = ptx.cp_async16_l2_128
    dev = cuda.jit(device=True) if simulator else cuda.jit(device=True, forceinline=True)

    # The swizzled layout's addresses (kernels_gpu.tensor_map, where the CPU tests check them): the word of chunk
    # ``chunk`` of row ``row`` of a tile at ``base``, and the step from a lane's word at chunk 0 or 1 to an even one.
    swizzled_word, swizzled_step = dev(tensor_map.swizzled_word), dev(tensor_map.swizzled_step)

    @dev
    def sw(base, row, chunk):
        return swizzled_word(base, row, chunk, BOX)

    @dev
    def sw_even(lane_word, chunk):
        return swizzled_step(lane_word, chunk, BOX)

    def make_copy_rows(CH: int, RSX: int, DWX: int, swizzled: bool = False):
        """A device function ``copy_rows(sm, dst, X, first, sn, left, lane)``: start the copy of the TILE rows of X
        from word ``first`` on (row stride ``sn`` words) into shared memory at word ``dst`` (row stride RSX, or —
        ``swizzled`` — the tensor copies' swizzled layout, ``sw``), CH chunks of 16 bytes per row (columns past DWX
        words and rows from ``left`` on are zero-filled: source size 0, the address then ``first``, which
        exists)."""
        SWIZZLED = swizzled
        if not swizzled and 32 % CH == 0 and TILE % (32 // CH) == 0:
            RP = 32 // CH                    # rows one copy instruction of the warp covers
            STEPS = TILE // RP

            FULL_COLS = 4 * CH == DWX            # every chunk of a row is data (d a multiple of 16)

            @dev
            def copy_rows(sm, dst, X, first, sn, left, lane):
                # A lane always copies chunk lane % CH of rows lane // CH + k·RP: its addresses are computed once
                # and stepped by constants (no division per copy).
                r0 = lane // CH
                c = lane - r0 * CH
                src = first + r0 * sn + 4 * c
                to = dst + r0 * RSX + 4 * c
                if FULL_COLS and left >= TILE:
                    # A whole tile of whole rows (every tile but a split's last): no bounds to test, no address to
                    # select — the copy is address arithmetic and the copies alone.
                    for k in range(STEPS):
                        copy16(sm, to + k * RP * RSX, X, src + k * RP * sn, 16)
                else:
                    col_ok = 4 * c < DWX
                    for k in range(STEPS):
                        ok = col_ok and r0 + k * RP < left
                        copy16(sm, to + k * RP * RSX, X, src + k * RP * sn if ok else first,
                                       16 if ok else 0)
            return copy_rows

        @dev
        def copy_rows_any(sm, dst, X, first, sn, left, lane):
            # (chunk counts that do not divide a warp: d = 40, 48, 80, …; and the swizzled layout, used only for
            # the query rows and a split's last tile)
            for e in range(lane, TILE * CH, 32):
                r = e // CH
                c = e - r * CH
                ok = r < left and 4 * c < DWX
                to = sw(dst, r, c) if SWIZZLED else dst + r * RSX + 4 * c
                copy16(sm, to, X, first + r * sn + 4 * c if ok else first, 16 if ok else 0)
        return copy_rows_any

    copy_k_rows, copy_v_rows = make_copy_rows(CH_K, RS, DW, TENSOR), make_copy_rows(CH_V, RSV, DVW, TENSOR)
    rows = cache_rows(page, simulator)

    @dev
    def copy_tile(sm, dst, bar, Kw, Vw, table, j0, hi, b, h, lane, max_pages, num_pages, k_so, k_sh, k_sn, v_so,
                  v_sh, v_sn, ktm, vtm):
        """Alg. 1 line 7: start the copy of keys j0 … j0 + TILE − 1 (K and V rows) into the stage at word ``dst``.
        A whole tile (BULK): one bulk copy per row, completing on the mbarrier at word ``bar``; otherwise 16 bytes
        per ``cp.async``, keys at or past ``hi`` and the columns between d and D zero-filled."""
        if TENSOR and hi - j0 >= TILE:
            # A whole tile by the copy engine: lane 0 announces its bytes and asks for K's and V's boxes at
            # coordinates (column, row in the page or sequence, head, physical page or sequence).
            if lane == 0:
                phys = b
                jr = j0
                if PAGE > 0:
                    p = j0 // PAGE
                    phys = min(max(int64(table[uint64(b * max_pages + p)]), int64(0)), num_pages - 1)
                    jr = j0 - p * PAGE
                ptx.mbar_arrive_expect_tx(sm, bar, TILE_BYTES)
                for x in range(D // 64):
                    ptx.tensor_copy_4d(sm, dst + x * BOX, ktm, 64 * x, jr, h, phys, bar)
                for x in range(DV // 64):
                    ptx.tensor_copy_4d(sm, dst + V_OFF + x * BOX, vtm, 64 * x, jr, h, phys, bar)
            return
        # the tile's first key in K and V; a paged tile lies in one page, so its rows follow at the row stride
        k_first, v_first = rows(table, b, h, j0, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn)
        if BULK and hi - j0 >= TILE:
            if lane == 0:                       # one arrival, and the tile's bytes to come
                ptx.mbar_arrive_expect_tx(sm, bar, TILE_BYTES)
            if lane < TILE:
                ptx.bulk_copy(sm, dst + lane * RS, Kw, k_first + lane * k_sn, 2 * d, bar)
            else:
                ptx.bulk_copy(sm, dst + V_OFF + (lane - TILE) * RSV, Vw, v_first + (lane - TILE) * v_sn, 2 * d_v,
                              bar)
        else:
            copy_k_rows(sm, dst, Kw, k_first, k_sn, hi - j0, lane)
            copy_v_rows(sm, dst + V_OFF, Vw, v_first, v_sn, hi - j0, lane)

    cap = None if simulator else register_cap(d, d_v, copy)

    @cuda.jit(**({} if cap is None else dict(max_registers=cap)))
    def decode_split_tc(Qw, Kw, Vw, table, seqlens, Ow, L, Opart, Lpart, H_q, H_kv, N_new, R, S, row_tiles, block,
                        max_pages, num_pages, capacity, k_so, k_sh, k_sn, v_so, v_sh, v_sn, scale2, ktm, vtm):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = cuda.laneid
        g = lane // 4
        t = lane % 4
        split = int64(cuda.blockIdx.x)
        r0 = int64(0)
        if row_tiles > 1:                       # (one 16-row tile, the common case: no division)
            split = cuda.blockIdx.x // row_tiles
            r0 = (cuda.blockIdx.x - split * row_tiles) * 16
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        # The flat row of the group's row 0 in q, O and L: (b·H_q + h·G)·N_new = b·H_q·N_new + h·R.
        q_base = b * H_q * N_new + h * R
        sm = cuda.shared.array(0, uint32)       # the stages, as 32-bit words ...
        smf = cuda.shared.array(0, float32)     # ... and the same memory as floats, for the final merge
        mine = warp * WARP_WORDS
        q_stage = mine + (NS - 1) * STAGE       # the warp's last stage: no tile lands there before iteration 0
        bars = BARS + warp * 2 * NS             # the warp's mbarriers, one per stage (8 bytes each)
        if MBAR:
            if lane == 0:
                for i in range(NS):
                    ptx.mbar_init(sm, bars + 2 * i, 1)
                ptx.fence_mbarrier_init()
            ptx.syncwarp()

        # Alg. 1 line 4, first half: the tile's 16 query rows r0 … r0 + 15 — consecutive rows of q (row r is query
        # head h·G + r // N_new, new token r % N_new), those past R zero-filled — copied into the warp's last stage,
        # the first thing the program asks of memory: one commit group, in flight with the split's first tiles.
        copy_k_rows(sm, q_stage, Qw, (q_base + r0) * DW, DW, R - r0, lane)
        ptx.cp_async_commit()

        # Sequence b's keys 0 … n − 1 (clamped to the cache) and this split's [lo, hi): whole key blocks, the cut of
        # fa2edu.inference.split_ranges.
        n = min(max(int64(seqlens[b]), int64(0)), capacity)
        T = (n + block - 1) // block
        lo = (split * T // S) * block
        hi = min(n, ((split + 1) * T // S) * block)
        # Causal: row r is new token r % N_new, which sees keys up to n − N_new + r % N_new — the forward's
        # bottom-right rule "key ≤ row + diag" with row = the token and diag = n − N_new.
        token0 = int64(0)
        token1 = int64(0)
        if N_new > 1:                           # (one new token, the common case: no division)
            token0 = (r0 + g) % N_new
            token1 = (r0 + g + 8) % N_new
        diag = n - N_new

        # Alg. 1 line 5, per warp: Õ = 0, ℓ = 0, m = −∞.
        o = cuda.local.array(O_LEN, float32)
        s = cuda.local.array(S_LEN, float32)
        s2 = cuda.local.array(S_LEN, float32)   # (CHAINS = 2: S's odd k-steps)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        zero(o, O_LEN)
        for hh in range(2):
            m[hh] = NEG_INF
            l[hh] = float32(0.0)

        # Alg. 1 line 6, split-K inside the program: warp w takes the tiles w, w + W, … of the split.
        n_tiles = (hi - lo + TILE - 1) // TILE if hi > lo else 0
        count = (n_tiles - warp + W - 1) // W if n_tiles > warp else 0
        # Line 7 for the warp's first NS − 1 tiles, one commit group each.
        for i in range(NS - 1):
            if i < count:
                copy_tile(sm, mine + i * STAGE, bars + 2 * i, Kw, Vw, table, lo + (warp + i * W) * TILE, hi, b, h,
                          lane, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn, ktm, vtm)
            ptx.cp_async_commit()
        # Line 4, second half: once the query rows have landed (the oldest group; the tiles' may still be in
        # flight), ldmatrix makes them A-fragments (lane: rows g, g + 8; words t, t + 4 of each 16-wide k-step).
        qa = cuda.local.array(Q_LEN, uint32)
        wait_oldest()
        ptx.syncwarp()
        # (swizzled tiles: the lane's ldmatrix row at chunk 0 or 1, from which sw_even steps; row % 8 = lane % 8)
        q_lane = sw(0, lane % 16, lane // 16)
        k_lane = sw(0, lane % 8 + 8 * (lane // 16), (lane // 8) % 2)
        v_lane = sw(V_OFF, lane % 8 + 8 * ((lane // 8) % 2), lane // 16)
        for kk in range(KS):
            # lanes 8u … 8u+7 address rows 8(u % 2) + 0…7, words 8kk + 4(u // 2): the fragment's four 8 × 8 tiles
            if TENSOR:
                q_at = sw_even(q_stage + q_lane, 2 * kk)
            else:
                q_at = q_stage + (lane % 16) * RS + 8 * kk + 4 * (lane // 16)
            qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3] = ldmatrix(sm, q_at)
        ptx.syncwarp()                          # every lane holds its fragments before iteration 0 refills the stage
        if MBAR:
            ptx.fence_proxy_async()             # (the stage's cp.async writes ordered before the bulk copies')
        for i in range(count):
            j0 = lo + (warp + i * W) * TILE
            stage = mine + (i % NS) * STAGE
            # Line 7 for the warp's tile i + NS − 1, started now: it lands while tiles i … are computed (its stage
            # held tile i − 1, which every lane finished with at the last syncwarp).
            if i + NS - 1 < count:
                nxt = (i + NS - 1) % NS
                copy_tile(sm, mine + nxt * STAGE, bars + 2 * nxt, Kw, Vw, table, j0 + (NS - 1) * W * TILE, hi, b,
                          h, lane, max_pages, num_pages, k_so, k_sh, k_sn, v_so, v_sh, v_sn, ktm, vtm)
            ptx.cp_async_commit()               # (an empty group at the end: the count stays regular)
            wait_oldest()                       # this lane's cp.async copies of tile i have landed ...
            if MBAR and hi - j0 >= TILE:
                # ... or, a bulk-copied tile, the stage's barrier has completed its (i // NS)-th phase: every tile
                # before a split's last is whole, so a stage's bulk tiles are its first uses
                while ptx.mbar_try_wait(sm, bars + 2 * (i % NS), (i // NS) % 2) == 0:
                    pass
            ptx.syncwarp()                      # ... and the other lanes' too

            # Line 8: S = Q Kᵀ, the warp's 16 rows × TILE keys; with CHAINS = 2 the even k-steps accumulate into
            # s and the odd ones into s2, added at the end: each accumulator tile's MMAs form two chains of KS / 2
            # that overlap, instead of one chain of KS, each MMA waiting on the one before.
            zero(s, S_LEN)
            if CHAINS == 2:
                zero(s2, S_LEN)
            for kk in range(KS):
                for p in range(NT // 2):
                    # B: lanes 8u … 8u+7 address keys 16p + 8(u // 2) + 0…7, words 8kk + 4(u % 2).
                    if TENSOR:
                        k_row = sw_even(stage + k_lane + 16 * 32 * p, 2 * kk)       # (16 rows × 32 words)
                    else:
                        k_row = stage + (16 * p + lane % 8 + 8 * (lane // 16)) * RS + 8 * kk + 4 * ((lane // 8) % 2)
                    b0, b1, b2, b3 = ldmatrix(sm, k_row)
                    if CHAINS == 2 and kk % 2 == 1:
                        mma_into(s2, 2 * p, qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b0, b1)
                        mma_into(s2, 2 * p + 1, qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b2, b3)
                    else:
                        mma_into(s, 2 * p, qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b0, b1)
                        mma_into(s, 2 * p + 1, qa[4 * kk], qa[4 * kk + 1], qa[4 * kk + 2], qa[4 * kk + 3], b2, b3)
            if CHAINS == 2:
                for e in range(S_LEN):
                    s[e] += s2[e]

            # Lines 9-10: the online softmax; the mask only where a key of the tile can be invisible to a row:
            # past the split, or (causal) past n − N_new, the first new token's last key.
            # (steps.row_softmax_f32: FA2 Alg. 1 lines 9-10 for the lane's row g + 8·hh, base 2, the scale folded
            # in; keys at or past hi masked, as keys past N_k are in the forward)
            masked = j0 + TILE > hi or (CAUSAL and j0 + TILE - 1 > diag)
            row_softmax(s, o, m, l, 0, token0, j0, hi, scale2, diag, masked)
            row_softmax(s, o, m, l, 1, token1, j0, hi, scale2, diag, masked)

            # Line 10 (second half): Õ += P̃ V, A straight from the accumulators, V transposed by ldmatrix.
            for kk in range(KV):
                a0 = pack(s[8 * kk], s[8 * kk + 1])
                a1 = pack(s[8 * kk + 2], s[8 * kk + 3])
                a2 = pack(s[8 * kk + 4], s[8 * kk + 5])
                a3 = pack(s[8 * kk + 6], s[8 * kk + 7])
                for p in range(NOV // 2):
                    # B: lanes 8u … 8u+7 address keys 16kk + 8(u % 2) + 0…7, columns 16p + 8(u // 2) …
                    if TENSOR:
                        v_row = sw_even(stage + v_lane + 16 * 32 * kk, 2 * p)
                    else:
                        v_row = (stage + V_OFF + (16 * kk + lane % 8 + 8 * ((lane // 8) % 2)) * RSV + 8 * p
                                 + 4 * (lane // 16))
                    b0, b1, b2, b3 = ldmatrix_trans(sm, v_row)
                    mma_into(o, 2 * p, a0, a1, a2, a3, b0, b1)
                    mma_into(o, 2 * p + 1, a0, a1, a2, a3, b2, b3)
            ptx.syncwarp()                      # every lane is done with this stage before it is refilled
        ptx.cp_async_wait_all()
        # The merge launch (programmatic dependent launch) may be scheduled once every program is this far.
        ptx.griddep_launch_dependents()

        # The warps' (m, ℓ, Õ) merged by the (m, ℓ) rule (FA1 Section 3.1) through shared memory, which the stages
        # no longer need once every warp is here. ℓ: the group's four partial sums first.
        for hh in range(2):
            total = l[hh] + shfl_xor(l[hh], 1)
            l[hh] = total + shfl_xor(total, 2)
        # (Indices from here on are cast to unsigned: numba then skips the negative-index wraparound test that a
        # signed index costs per access — most of this epilogue's instructions before, SASS.)
        cuda.syncthreads()
        for hh in range(2):
            row = warp * 16 + g + 8 * hh
            if r0 + g + 8 * hh < R:             # (rows past R are padding: nothing reads them)
                if t == 0:
                    smf[uint64(row)] = NEG_INF if m[hh] == NEG_INF else m[hh] * scale2
                    smf[uint64(L_AREA + row)] = l[hh]
                for nn in range(NOV):
                    for e in range(2):
                        smf[uint64(O_AREA + row * OS + 8 * nn + 2 * t + e)] = o[4 * nn + 2 * hh + e]
        cuda.syncthreads()
        # One thread per (row, word of output): M = max_w m_w, ℓ = Σ_w 2^(m_w − M) ℓ_w, O = Σ_w 2^(m_w − M) Õ_w / ℓ
        # (Alg. 1 lines 12-13; ℓ = 0: the split saw no key for this row, O = 0, L = +inf).
        rows_here = min(16, R - r0)
        for e in range(tid, rows_here * DVW, THREADS):
            rr = e // DVW
            w = e - rr * DVW
            M = NEG_INF
            for x in range(W):
                M = max(M, smf[uint64(x * 16 + rr)])
            M_use = float32(0.0) if M == NEG_INF else M
            lt = float32(0.0)
            a_lo = float32(0.0)
            a_hi = float32(0.0)
            for x in range(W):
                wgt = ex2(smf[uint64(x * 16 + rr)] - M_use)
                lt += wgt * smf[uint64(L_AREA + x * 16 + rr)]
                a_lo += wgt * smf[uint64(O_AREA + (x * 16 + rr) * OS + 2 * w)]
                a_hi += wgt * smf[uint64(O_AREA + (x * 16 + rr) * OS + 2 * w + 1)]
            inv = float32(0.0) if lt == 0.0 else float32(1.0) / lt
            L_r = float32(math.inf) if lt == 0.0 else float32(LN2) * (M + math.log2(lt))
            r = r0 + rr
            if CLUSTER:
                # This program's partial (O_s, L_s), kept in its own shared memory for the cluster's merge.
                smf[uint64(CL_O + rr * DV + 2 * w)] = a_lo * inv
                smf[uint64(CL_O + rr * DV + 2 * w + 1)] = a_hi * inv
                if w == 0:
                    smf[uint64(CL + rr)] = L_r
            elif S == 1:
                # Alg. 1 lines 14-15: the only split writes O and L.
                Ow[uint64((q_base + r) * DVW + w)] = pack(a_lo * inv, a_hi * inv)
                if w == 0:
                    L[uint64(q_base + r)] = L_r
            else:
                # Flash-Decoding: this split's partial (O_s, L_s) in float32, for
                # kernels_gpu.inference.decode.merge_kernel.
                part = ((b * H_kv + h) * S + split) * R + r
                Opart[uint64(part * d_v + 2 * w)] = a_lo * inv
                Opart[uint64(part * d_v + 2 * w + 1)] = a_hi * inv
                if w == 0:
                    Lpart[uint64(part)] = L_r
        if CLUSTER:
            # Flash-Decoding's merge inside the launch: the S programs of this (sequence, KV head) are one
            # thread-block cluster. Once every program's partial is in its shared memory (the cluster barrier,
            # release then acquire), program s merges its share of the (row, word) outputs, reading the S partials
            # from the programs' shared memories (distributed shared memory) by fa2edu.merge_attention_states'
            # rule — M = max_s L_s, O = Σ_s e^{L_s − M} O_s / Σ_s e^{L_s − M}, L = M + log Σ_s e^{L_s − M}; a split
            # with L_s = +inf weighs 0, and no key at all gives O = 0, L = +inf.
            ptx.cluster_arrive()
            ptx.cluster_wait()
            Ls = cuda.local.array(CLUSTER, float32)
            for e in range(split * THREADS + tid, rows_here * DVW, CLUSTER * THREADS):
                rr = e // DVW
                w = e - rr * DVW
                M = NEG_INF
                for x in range(CLUSTER):
                    Ls[x] = ptx.ld_cluster_f32(smf, uint64(CL + rr), uint32(x))
                    if Ls[x] != POS_INF:
                        M = max(M, Ls[x])
                out_lo = float32(0.0)
                out_hi = float32(0.0)
                L_r = POS_INF
                if M != NEG_INF:
                    total = float32(0.0)
                    for x in range(CLUSTER):
                        wgt = float32(0.0) if Ls[x] == POS_INF else float32(math.exp(Ls[x] - M))
                        total += wgt
                        out_lo += wgt * ptx.ld_cluster_f32(smf, uint64(CL_O + rr * DV + 2 * w), uint32(x))
                        out_hi += wgt * ptx.ld_cluster_f32(smf, uint64(CL_O + rr * DV + 2 * w + 1), uint32(x))
                    out_lo /= total
                    out_hi /= total
                    L_r = M + float32(math.log(total))
                Ow[uint64((q_base + r0 + rr) * DVW + w)] = pack(out_lo, out_hi)
                if w == 0:
                    L[uint64(q_base + r0 + rr)] = L_r
            # No program leaves while another may still read its shared memory.
            ptx.cluster_arrive()
            ptx.cluster_wait()

    return decode_split_tc
