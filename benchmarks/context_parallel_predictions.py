"""The simulator's predictions for the multi-GPU ring, written down before any multi-GPU run.

    python -m benchmarks.context_parallel_predictions --out benchmarks/results/predictions/ring_predictions.json
    python -m benchmarks.context_parallel_predictions --set training \
        --out benchmarks/results/predictions/ring_predictions_h200_training.json
    python -m benchmarks.context_parallel_predictions --set eight \
        --out benchmarks/results/predictions/ring_predictions_h200_x8.json

For the configurations ``benchmarks.context_parallel`` measures (W = 1, 2, 4, 8 GPUs; strong scaling at a fixed
total length and weak scaling at a fixed length per GPU; contiguous and zigzag; causal; d = 128, H200-class
NVLink), :func:`fa2edu.simulate_context_parallel` gives each rank's predicted time, the idle fraction against the
busiest rank, and whether every step's compute hides its transfer. A run on a machine with several GPUs is then
compared with this file, not with numbers produced after the fact.

``--set training`` (issue 39, :func:`training_predictions`): the run ``benchmarks.context_parallel``'s defaults
make on four (and later eight) H200s — forward and forward + backward, bf16 and fp32, W = 1, 2, 4, 8, strong
scaling at N = 131072 and weak at N_local = 32768, H = 16, d = 128, causal, both layouts — with the rates measured
on H200s before the run, read from the committed results files (:func:`measured_rates` says which and why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.results_io import utc_now
from fa2edu import simulate_context_parallel
from fa2edu.flops import model_flops


def predictions(d: int = 128, heads: int = 16, strong_N: int = 65536, weak_N_local: int = 16384) -> list[dict]:
    """One record per (scaling, layout, W): predicted per-rank time, idle fractions, communication hidden."""
    records = []
    for scaling in ("strong", "weak"):
        for layout in ("contiguous", "zigzag"):
            for W in (1, 2, 4, 8):
                N = strong_N if scaling == "strong" else weak_N_local * W
                report = simulate_context_parallel(N, d, W, causal=True, layout=layout, heads=heads)
                records.append(dict(scaling=scaling, layout=layout, world_size=W, N=N, d=d, heads=heads,
                                    predicted_ms=report.time_s * 1e3,
                                    predicted_compute_ms=report.compute_time_s * 1e3,
                                    predicted_rank_ms=[t.finish_s * 1e3 for t in report.ranks],
                                    idle_fractions=list(report.idle_fractions),
                                    comm_hidden=bool(report.hides_communication),
                                    bandwidth_to_hide=report.bandwidth_to_hide))
    return records


RESULTS = Path(__file__).resolve().parent / "results"


def _load(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _record_tflops(path: str, **match) -> float:
    """The TFLOP/s of the one ok record of ``path`` whose fields equal ``match``, in FLOP/s."""
    found = [r for r in _load(path)["records"]
             if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise ValueError(f"{path}: expected one ok record with {match}, found {len(found)}")
    return found[0]["tflops"] * 1e12


def measured_rates() -> dict:
    """The link and step rates of the training predictions, each read from a committed results file.

    * **link**: 235.3 GB/s per direction, the smaller of the two ring-exchange measurements on four H200s over
      NVLink (``nvidia-h200/context_parallel_4gpu.json`` and ``..._w24_bf16.json``, 2026-11-26: 235 and 254
      GB/s): the slowest link sets a ring's pace, and the larger came from a shorter run.
    * **forward**: the rate of one full (non-causal) ring step on one H200, per dtype and N_local, from
      ``context_parallel_4gpu.json`` (the only run that measured 32768 tokens and float32): 313 TFLOP/s bf16 and
      39.6 fp32 at 32768 tokens, used for every shard of 32768 tokens or more (the rate grows by 8 % from 16384
      to 32768 and is taken as saturated beyond); 290 / 36.9 at 16384 (strong scaling at W = 8).
    * **backward**: no ring backward has been timed; the rate of the kernels the ring's backward steps run,
      non-causal (a full step), at the longest sequence measured (N = 8192, batch 2, 16 heads, d = 128): bf16
      ``kernels_gpu.tensorcore`` v7 (the op's backward), 198.7 TFLOP/s in ``nvidia-h100/tensorcore_backward_v7.json``
      — an H100; the H200 has the same SMs and clocks and more memory bandwidth, which a compute-bound backward
      does not use —, fp32 3xTF32, 34.1 TFLOP/s on an H200 in ``nvidia-h200/fast_backward_3xtf32.json``.
    """
    four = _load("nvidia-h200/context_parallel_4gpu.json")["summary"]
    w24 = _load("nvidia-h200/context_parallel_4gpu_w24_bf16.json")["summary"]
    forward = {(r["dtype"], r["N_local"]): r["flop_rate"] for r in four["step_flop_rate"]}
    backward = {"bfloat16": _record_tflops("nvidia-h100/tensorcore_backward_v7.json", impl="v7", dtype="bfloat16",
                                           causal=False, N=8192, d=128),
                "float32": _record_tflops("nvidia-h200/fast_backward_3xtf32.json", impl="fast_3xtf32",
                                          causal=False, N=8192, d=128)}
    return {"link": min(four["link_bytes_per_s"], w24["link_bytes_per_s"]), "forward": forward,
            "backward": backward}


def _forward_rate(rates: dict, dtype: str, N_local: int) -> float:
    """The measured forward rate at N_local tokens per rank: the longest measured shard at or below it (the rate
    is taken as saturated beyond 32768), else the shortest measured."""
    known = sorted(n for d, n in rates["forward"] if d == dtype)
    at = max([n for n in known if n <= N_local], default=known[0])
    return rates["forward"][dtype, at]


#: The issue's configurations: W, the strong total and the weak per-GPU length, the shapes, the dtypes.
TRAINING = dict(world_sizes=(1, 2, 4, 8), strong_N=131072, weak_N_local=32768, d=128, heads=16,
                dtypes=(("bfloat16", 2), ("float32", 4)), passes=("forward", "forward+backward"))
#: Issue 41's run on eight H200s: bf16, W = 1 … 8, strong scaling at N = 262144, weak at N_local = 32768.
EIGHT = dict(TRAINING, strong_N=262144, dtypes=(("bfloat16", 2),))


def training_predictions(rates: dict | None = None, config: dict | None = None) -> list[dict]:
    """One record per (pass, dtype, scaling, layout, W): per-rank time, idle fractions, communication, and for
    strong scaling the efficiency time(W = 1) / (W · time(W)), predicted with :func:`measured_rates`, for the
    configurations ``config`` (default :data:`TRAINING`; :data:`EIGHT` for the eight-GPU run)."""
    rates = measured_rates() if rates is None else rates
    t = TRAINING if config is None else config
    records = []
    for pass_ in t["passes"]:
        for dtype, e in t["dtypes"]:
            for scaling in ("strong", "weak"):
                for layout in ("zigzag", "contiguous"):
                    one = None
                    for W in t["world_sizes"]:
                        N = t["strong_N"] if scaling == "strong" else t["weak_N_local"] * W
                        forward = _forward_rate(rates, dtype, N // W)
                        report = simulate_context_parallel(
                            N, t["d"], W, causal=True, layout=layout, heads=t["heads"], dtype_bytes=e,
                            link=rates["link"], flop_rate=forward, backward_flop_rate=rates["backward"][dtype],
                            pass_=pass_)
                        ms = report.time_s * 1e3
                        one = ms if W == 1 else one
                        records.append(dict(
                            scaling=scaling, layout=layout, world_size=W, N=N, N_local=N // W, d=t["d"],
                            heads=t["heads"], dtype=dtype, **{"pass": pass_}, predicted_ms=ms,
                            predicted_compute_ms=report.compute_time_s * 1e3,
                            predicted_comm_ms=(report.time_s - report.compute_time_s) * 1e3,
                            predicted_rank_ms=[r.finish_s * 1e3 for r in report.ranks],
                            idle_fractions=list(report.idle_fractions), comm_hidden=bool(report.hides_communication),
                            bandwidth_to_hide=report.bandwidth_to_hide, flop_rate=forward,
                            backward_flop_rate=rates["backward"][dtype] if pass_ != "forward" else None,
                            tflops=model_flops(1, t["heads"], N, t["d"], True, pass_) / ms / 1e9,
                            strong_efficiency=one / (W * ms) if scaling == "strong" else None))
    return records


def harness_seconds(records: list[dict], world: int = 4, calls: int = 4, torch_cp: float = 1.0) -> float:
    """A rough device-time estimate for ``benchmarks.context_parallel``'s timed part at its defaults on ``world``
    GPUs: ``calls`` (warm-up + repeats) of every ring up to W = world (fa2edu's, and ``torch_cp`` times as long for
    PyTorch's), plus SDPA on one GPU at the same lengths taken as fast as the W = 1 ring. Compilation, checks and
    the rate measurements come on top."""
    rings = sum(r["predicted_ms"] for r in records if r["world_size"] <= world)
    single = sum(r["predicted_ms"] for r in records if r["world_size"] <= world and r["layout"] == "zigzag"
                 and (r["scaling"] == "weak" or r["world_size"] == 1))
    return calls * (rings * (1 + torch_cp) + single) / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", choices=("forward", "training", "eight"), default="forward",
                        help="forward: the first predictions (H100 peak rates, forward only); training: issue 39's "
                             "run, forward and forward + backward at the rates measured on H200s; eight: issue "
                             "41's run on eight H200s (bf16, strong scaling at N = 262144)")
    args = parser.parse_args(argv)
    if args.set in ("training", "eight"):
        config = TRAINING if args.set == "training" else EIGHT
        rates = measured_rates()
        records = training_predictions(rates, config)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rates_json = dict(link=rates["link"], backward=rates["backward"],
                          forward=[dict(dtype=d, N_local=n, flop_rate=v) for (d, n), v in rates["forward"].items()])
        args.out.write_text(json.dumps(dict(
            date=utc_now(), model="fa2edu.simulate_context_parallel (causal, pass_ forward and forward+backward)",
            rates=rates_json, rates_source=measured_rates.__doc__, configurations=dict(config),
            estimated_harness_seconds={f"W<={w}": harness_seconds(records, w) for w in (2, 4, 8)},
            records=records), indent=1))
        for r in records:
            eff = "" if r["strong_efficiency"] is None else f"  efficiency {r['strong_efficiency']:.3f}"
            print(f"{r['pass']:16s} {r['dtype']:8s} {r['scaling']:6s} {r['layout']:10s} W={r['world_size']} "
                  f"N={r['N']:7d} {r['predicted_ms']:9.2f} ms  hidden={r['comm_hidden']}{eff}")
        return 0
    records = predictions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(date=utc_now(), model="fa2edu.simulate_context_parallel (causal, "
                                        "link NVLink4-H100, flop rate H100-SXM)", records=records), indent=1))
    for r in records:
        print(f"{r['scaling']:6s} {r['layout']:10s} W={r['world_size']} N={r['N']:6d} "
              f"{r['predicted_ms']:8.2f} ms  max idle {max(r['idle_fractions']):.2f}  hidden={r['comm_hidden']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
