"""The FLOP model behind every TFLOP/s figure of the harness: the FA2 paper's (FA2 Section 4.1).

The model lives in one place, ``fa2edu.flops.model_flops``; this module re-exports it beside the conversion to
TFLOP/s. It counts only the matrix products, per (batch, head) ``S = QKᵀ`` and ``O = PV`` at ``2·N²·d`` each:

    forward  = 4 · N² · d · heads · batch          (halved with a causal mask: about half of S is computed)
    backward = 2.5 · forward                         (5 matrix products instead of 2, because of recomputation)

These are *model* FLOPs: an implementation that skips masked blocks does fewer, one that recomputes does more,
and TFLOP/s = model FLOPs / time either way, so all implementations are compared on the same work.
"""

from fa2edu.flops import model_flops

__all__ = ["PASSES", "model_flops", "tflops"]

PASSES = ("forward", "backward")


def tflops(flops, ms):
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds (None when the time is missing)."""
    if ms is None or flops is None:
        return None
    if ms <= 0:
        raise ValueError(f"ms must be positive, got {ms!r}")
    return flops / (ms * 1e-3) / 1e12
