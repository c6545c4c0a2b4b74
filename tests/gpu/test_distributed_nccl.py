"""fa2edu.distributed on CUDA tensors over NCCL: ring attention, forward and backward, against the float64 oracle.

Each world size W starts **one** NCCL process group in fresh processes (one GPU per rank: NCCL refuses two ranks
on one device), whose workers run every case in turn and write their shards to files; the checks run here, in
the test process, on the unsharded results. W = 1 runs on any machine with a GPU (the ring of one rank: every
step's arithmetic on kernels_gpu, the agreement check gathered through NCCL); W = 2 and W = 4 need two and four
GPUs and are skipped otherwise (``FA2EDU_NCCL_WORLD_SIZES=2,4`` picks the sizes). Every process runs with
NVLink multicast off (``NCCL_NVLS_ENABLE=0``), every collective and point-to-point wait under the group's
timeout, and the workers are killed past a deadline: nothing can hang.

The rule is flash-attn's: in float16, bfloat16 and float32 the output and the three gradients are within twice
the error of PyTorch's own attention in the same dtype (``scaled_dot_product_attention``, with autograd), plus a
small slack, both measured against float64 attention on the unsharded inputs.

Run on the device from the repository root::

    FA2EDU_GPU=1 python -m pytest -m gpu tests/gpu/test_distributed_nccl.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math
import os
import queue as queue_module
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if os.environ.get("FA2EDU_GPU") != "1":  # the conftest skips these too; never start NCCL or compile kernels here
    pytest.skip("GPU tests run with FA2EDU_GPU=1", allow_module_level=True)

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the device)", allow_module_level=True)
if not (dist.is_available() and dist.is_nccl_available()):
    pytest.skip("needs torch.distributed with the NCCL backend", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tolerances import assert_same_nan_and_inf, baseline_error  # noqa: E402

from fa2edu import distributed as cp  # noqa: E402

GROUP_TIMEOUT_S = 180         # every collective and point-to-point wait (the first steps also compile kernels)
DEADLINE_S = 360              # the whole group, from spawn to the last shard written
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}     # NVLink multicast off, in every process of the group

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The slack of the rule, relative to max(1, max |reference|): about one rounding of a value near 1 in float16
# (the tensor-core steps round each partial output to the input dtype before the merge), float32's floor.
SLACK = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-5}


# ----------------------------------------------------------------------------------------------------------------
# Cases: each one a dict, run by every rank of the ring
# ----------------------------------------------------------------------------------------------------------------

SHAPES = [  # (B, H_q, H_kv, N, d): N divisible by 2W for W = 1, 2, 4 (both layouts) and by no tile size
    (1, 8, 2, 1000, 64),      # GQA, 4 query heads per K/V head; zigzag chunks of 250 tokens at W = 2
    (2, 4, 2, 520, 128),      # GQA at d = 128, two sequences
    (1, 6, 1, 264, 64),       # MQA, chunks of 66 tokens
]


def _cases() -> list[dict]:
    cases = []
    for dtype in DTYPES:
        for causal in (False, True):
            for layout in cp.LAYOUTS:
                B, H_q, H_kv, N, d = SHAPES[len(cases) % len(SHAPES)]
                cases.append(dict(name=f"{dtype}-{'causal' if causal else 'full'}-{layout}", dtype=dtype,
                                  causal=causal, layout=layout, B=B, H_q=H_q, H_kv=H_kv, N=N, d=d, scale=None,
                                  q_gain=1.0, k_gain=1.0, seed=len(cases)))
    # Extreme logits: scores of standard deviation ~50 (maxima in the hundreds) under an explicit scale.
    for dtype in ("float16", "bfloat16"):
        cases.append(dict(name=f"{dtype}-causal-zigzag-extreme", dtype=dtype, causal=True, layout="zigzag", B=1,
                          H_q=4, H_kv=2, N=1000, d=64, scale=0.2, q_gain=8.0, k_gain=4.0, seed=100 + len(cases)))
    return cases


CASES = {case["name"]: case for case in _cases()}


def _inputs(case: dict) -> dict[str, "torch.Tensor"]:
    """The full (unsharded) q, k, v, dO of a case: float64 CPU tensors whose values the case's dtype holds."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H_q, H_kv, N, d = (case[key] for key in ("B", "H_q", "H_kv", "N", "d"))
    x = {"q": torch.randn(B, H_q, N, d, generator=g, dtype=torch.float64) * case["q_gain"],
         "k": torch.randn(B, H_kv, N, d, generator=g, dtype=torch.float64) * case["k_gain"],
         "v": torch.randn(B, H_kv, N, d, generator=g, dtype=torch.float64),
         "do": torch.randn(B, H_q, N, d, generator=g, dtype=torch.float64)}
    return {name: t.to(DTYPES[case["dtype"]]).double() for name, t in x.items()}


# ----------------------------------------------------------------------------------------------------------------
# The worker: one process of the NCCL group, one GPU
# ----------------------------------------------------------------------------------------------------------------

def _count_pytorch_steps(calls: dict) -> None:
    """Count the steps that fell back to fa2edu.distributed's PyTorch step on CUDA tensors (this process only)."""
    def counting(function, key):
        def wrapped(q, *args, **kwargs):
            if q.is_cuda:
                calls[key] += 1
            return function(q, *args, **kwargs)
        return wrapped
    cp.block_attention = counting(cp.block_attention, "forward")
    cp.block_attention_backward = counting(cp.block_attention_backward, "backward")


def _run_case(case: dict, rank: int, W: int, calls: dict) -> tuple[dict, dict]:
    dtype, layout, device = DTYPES[case["dtype"]], case["layout"], torch.device("cuda", rank)
    local = {name: cp.shard(t, rank, W, layout).to(device=device, dtype=dtype) for name, t in _inputs(case).items()}
    q, k, v = (local[name].requires_grad_() for name in ("q", "k", "v"))
    calls.update(forward=0, backward=0)
    o = cp.ring_attention(q, k, v, causal=case["causal"], scale=case["scale"], layout=layout)
    forward_fallbacks = calls["forward"]
    o.backward(local["do"])
    torch.cuda.synchronize(device)
    meta = {"dtypes": [str(t.dtype) for t in (o, q.grad, k.grad, v.grad)],
            "devices": [str(t.device) for t in (o, q.grad, k.grad, v.grad)],
            "forward_fallbacks": forward_fallbacks, "backward_fallbacks": calls["backward"]}
    # float32 holds every float16, bfloat16 and float32 value exactly: the shards are saved without rounding.
    shards = {name: t.detach().float().cpu().numpy() for name, t in (("o", o), ("dq", q.grad), ("dk", k.grad),
                                                                      ("dv", v.grad))}
    return shards, meta


def _worker(rank: int, W: int, init_method: str, cases: list, out_dir: str, results) -> None:
    try:
        os.environ.update(NCCL_ENV)
        torch.set_num_threads(2)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=W,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S), device_id=torch.device("cuda", rank))
        calls = {"forward": 0, "backward": 0}
        _count_pytorch_steps(calls)
        metas = {}
        for case in cases:
            shards, metas[case["name"]] = _run_case(case, rank, W, calls)
            np.savez(Path(out_dir) / f"{case['name']}-rank{rank}.npz", **shards)
        metas["nccl_env"] = {key: os.environ.get(key) for key in NCCL_ENV}
        dist.barrier(device_ids=[rank])
        dist.destroy_process_group()
        results.put((rank, metas, None))
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with the traceback
        results.put((rank, None, traceback.format_exc()))


def _run_group(W: int, cases: list, tmp_path: Path) -> dict:
    """Spawn the W ranks, run every case, return {rank: metadata}; fail (never hang) otherwise."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    with pytest.MonkeyPatch.context() as env:         # inherited by the spawned ranks, restored afterwards
        for key, value in NCCL_ENV.items():
            env.setenv(key, value)
        processes = [ctx.Process(target=_worker, args=(r, W, init_method, cases, str(tmp_path), results),
                                 daemon=True) for r in range(W)]
        for p in processes:
            p.start()
    deadline = time.monotonic() + DEADLINE_S
    received, failures = {}, []
    try:
        while len(received) + len(failures) < W:
            try:
                rank, metas, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                pytest.fail(f"the W = {W} NCCL group did not finish within {DEADLINE_S} s (ranks that died: {dead})")
            if error is not None:
                failures.append(f"rank {rank}:\n{error}")
            else:
                received[rank] = metas
        for p in processes:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    if failures:
        pytest.fail("\n".join(failures))
    return received


#: The ring sizes to run, from FA2EDU_NCCL_WORLD_SIZES (default "1,2,4"); those beyond the GPUs are skipped.
WORLD_SIZES = [int(w) for w in os.environ.get("FA2EDU_NCCL_WORLD_SIZES", "1,2,4").split(",") if w.strip()]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda W: f"W{W}")
def nccl_run(request, tmp_path_factory):
    W = request.param
    if torch.cuda.device_count() < W:
        pytest.skip(f"W = {W} needs {W} GPUs (NCCL refuses two ranks on one device); this machine has "
                    f"{torch.cuda.device_count()}")
    out_dir = tmp_path_factory.mktemp(f"nccl{W}")
    return W, out_dir, _run_group(W, list(CASES.values()), out_dir)


# ----------------------------------------------------------------------------------------------------------------
# The checks, in the test process
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_tf32():
    # The float32 baseline must be true float32 (TF32 would make PyTorch's own error look larger than it is).
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _attention_with_grads(q, k, v, do, causal: bool, scale, *, oracle: bool) -> dict[str, np.ndarray]:
    """O, dQ, dK, dV of single-device attention on the GPU: the float64 oracle written out (masked scores,
    softmax, GQA by repeating K/V heads), or PyTorch's own attention in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    G = q.shape[-3] // k.shape[-3]
    if oracle:
        tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        S = tau * q @ k.repeat_interleave(G, -3).transpose(-1, -2)
        if causal:
            N = S.shape[-1]
            S = S.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=S.device).tril(), -math.inf)
        o = torch.softmax(S, dim=-1) @ v.repeat_interleave(G, -3)
    else:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                             enable_gqa=G > 1)
    o.backward(do)
    return {name: t.detach().double().cpu().numpy() for name, t in (("o", o), ("dq", q.grad), ("dk", k.grad),
                                                                     ("dv", v.grad))}


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_on_nccl_matches_the_float64_oracle(nccl_run, name):
    """Output and gradients, unsharded, within 2× PyTorch's same-dtype error of float64 attention on the
    unsharded inputs; results in the inputs' dtype on each rank's GPU; every forward step (and every float32
    backward step) ran on kernels_gpu, none on the PyTorch fallback step."""
    W, out_dir, metas = nccl_run
    case = CASES[name]
    assert all(metas[r]["nccl_env"] == NCCL_ENV for r in range(W))
    for r in range(W):
        meta = metas[r][name]
        assert meta["dtypes"] == [str(DTYPES[case["dtype"]])] * 4, (r, meta)
        assert meta["devices"] == [f"cuda:{r}"] * 4, (r, meta)
        assert meta["forward_fallbacks"] == 0, f"rank {r}: {meta['forward_fallbacks']} forward steps on PyTorch"
        if case["dtype"] == "float32":
            assert meta["backward_fallbacks"] == 0, f"rank {r}: {meta['backward_fallbacks']} backward steps on PyTorch"
    shards = [np.load(out_dir / f"{name}-rank{r}.npz") for r in range(W)]
    x = {key: t.cuda() for key, t in _inputs(case).items()}
    expected = _attention_with_grads(x["q"], x["k"], x["v"], x["do"], case["causal"], case["scale"], oracle=True)
    dtype = DTYPES[case["dtype"]]
    same_dtype = _attention_with_grads(*(x[key].to(dtype) for key in ("q", "k", "v", "do")), case["causal"],
                                       case["scale"], oracle=False)
    for key, want in expected.items():
        got = cp.unshard([s[key] for s in shards], layout=case["layout"]).astype(np.float64)
        assert got.shape == want.shape, (key, got.shape, want.shape)
        assert_same_nan_and_inf(got, want, f"{name} {key}")
        err = float(np.max(np.abs(got - want)))
        baseline = baseline_error(same_dtype[key], want)
        slack = SLACK[case["dtype"]] * max(1.0, float(np.max(np.abs(want))))
        assert err <= 2 * baseline + slack, (f"{name} {key} (W = {W}): max error {err:.3e} > 2 × PyTorch's "
                                             f"{case['dtype']} error {baseline:.3e} + slack {slack:.1e}")
