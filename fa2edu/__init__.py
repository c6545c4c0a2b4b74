"""fa2edu: a runnable textbook of FlashAttention (FA1) and FlashAttention-2 (FA2).

Every algorithm of the two papers, in NumPy, reading like the pseudo-code, counting its own HBM traffic on a
simulated memory hierarchy, and proven exact against a float64 oracle::

    import fa2edu
    O, L = fa2edu.attention_reference(Q, K, V, causal=True)          # the float64 oracle
    fwd = fa2edu.flash2_forward(Q, K, V, M=49_152, causal=True)        # FA2 Alg. 1: .O, .L
    grads = fa2edu.flash2_backward(Q, K, V, fwd.O, fwd.L, dO, causal=True)
    print(fa2edu.simulate_io(4096, 64, 98_304))                        # HBM traffic, by execution

Modules, bottom-up (the dependency direction is one-way): ``memory`` ← ``softmax``, ``masks``, ``dropout``,
``blocks`` ← ``reference``, ``standard``, ``flash1``, ``flash2`` ← ``io``, ``flops`` ← ``cli``. Inference:
``softmax`` ← ``merge`` (the one merge of partial attentions); ``flash2``, ``merge`` ← ``inference`` (KV-cache
decoding, paged and split-KV; packed variable-length batches). Scores and masks as code: ``masks``, ``flash2`` ←
``flex`` (FlexAttention: a mask_mod classified into a ``BlockMask``, a score_mod, FA2's loops over the blocks) ←
``io`` (``simulate_flex_io``). Across devices: ``io`` ← ``context_parallel`` (what a ring of W ranks computes,
moves and waits for, predicted without running it; ``fa2edu.distributed`` runs the ring on ``torch.distributed``
and is imported only on demand). Low precision: ``flash2``, ``reference`` ← ``fp8`` (FlashAttention-3's FP8: exact
float8 rounding, per-head, per-block and incoherent quantisation, FA2 Alg. 1 on 1-byte inputs, an error study).
"""

from fa2edu import exercises  # noqa: F401,I001  (the chapters' exercise checkers, last: it uses the rest)
from fa2edu.blocks import DEFAULT_M, block_sizes_kv_outer, block_sizes_q_outer
from fa2edu.context_parallel import ContextParallelReport, simulate_context_parallel
from fa2edu.flash1 import flash1_backward, flash1_block_sparse_backward, flash1_block_sparse_forward, flash1_forward
from fa2edu.flash2 import flash2_backward, flash2_forward
from fa2edu.flex import BlockMask, create_block_mask, flex_attention, flex_attention_backward
from fa2edu.flops import count_flops
from fa2edu.fp8 import Fp8Tensor, flash2_forward_fp8, fp8_attention, fp8_error_study, quantize_fp8, round_to_fp8
from fa2edu.inference import DecodeResult, decode_attention, padded_batch_io, varlen_attention
from fa2edu.io import IOReport, simulate_io
from fa2edu.memory import HBM, SRAM, FlopCounter, SRAMOverflowError
from fa2edu.merge import merge_attention_states
from fa2edu.reference import attention_reference, attention_reference_backward
from fa2edu.standard import standard_attention, standard_attention_backward
from fa2edu.validation import AttentionOverflowError

__version__ = "0.1.0"

__all__ = [
    "attention_reference", "attention_reference_backward",
    "standard_attention", "standard_attention_backward",
    "flash1_forward", "flash1_backward", "flash1_block_sparse_forward", "flash1_block_sparse_backward",
    "flash2_forward", "flash2_backward",
    "flex_attention", "flex_attention_backward", "create_block_mask", "BlockMask",
    "quantize_fp8", "round_to_fp8", "Fp8Tensor", "fp8_attention", "flash2_forward_fp8", "fp8_error_study",
    "merge_attention_states", "decode_attention", "DecodeResult", "varlen_attention", "padded_batch_io",
    "simulate_io", "IOReport", "count_flops", "simulate_context_parallel", "ContextParallelReport",
    "HBM", "SRAM", "FlopCounter", "SRAMOverflowError", "AttentionOverflowError",
    "DEFAULT_M", "block_sizes_kv_outer", "block_sizes_q_outer",
]
