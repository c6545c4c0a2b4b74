"""The small GPT of examples/gpt trains the same with fa2edu's FlashAttention-2 as with PyTorch's SDPA.

A short run of a tiny model on the CPU: same initial weights, same batches, three attentions — SDPA, SDPA forced
to its MATH backend (the noise reference) and fa2edu's FA2. The noise reference's divergence from SDPA measures
float rounding as training amplifies it; fa2edu's divergence stays within ``k · envelope + floor``
(``examples.gpt.train.agreement_bounds``) at every step while the loss goes down. The bound is shown to have
teeth: an attention with a fault (no causal mask, or 1% of dQ taken from the wrong row) breaks it. In float64
the same rule holds with a bound near 1e-14.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

# examples/ is not an installed package: make the repository root importable however pytest was started.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fa2edu.torch as op  # noqa: E402
from examples.gpt import plot, train  # noqa: E402
from examples.gpt.data import CharData, generate_text  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These tensors are tiny: extra intra-op threads only spin-wait, badly so on a busy shared CI machine.
    # Module-scoped and autouse, so it is in force before the module-scoped run below is made.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = dict(batch=8, context=32, n_layer=1, n_head=2, d_model=32, lr=3e-3, block_sizes=(8, 8))
STEPS = 30


@pytest.fixture(scope="module")
def honest():
    """The three honest float32 runs of the tiny model (trained once for the whole module)."""
    return train.compare(STEPS, text_chars=20_000, **TINY)


def exceeded(fa2_loss, result, dtype=torch.float32) -> list[int]:
    """The steps at which |loss_fa2edu − loss_sdpa| is above the bound, recomputed from the curves."""
    sdpa, reference = result["runs"]["sdpa"]["loss"], result["runs"]["reference"]["loss"]
    bounds = train.agreement_bounds(reference, sdpa, dtype)
    return [step for step, (f, s, b) in enumerate(zip(fa2_loss, sdpa, bounds)) if abs(f - s) > b]


def test_text_is_deterministic_and_small():
    text = generate_text(20_000, seed=3)
    assert text == generate_text(20_000, seed=3) and text != generate_text(20_000, seed=4)
    assert 20_000 <= len(text) < 20_200
    data = CharData(text)
    assert data.vocab_size < 40 and data.decode(data.ids[:50]) == text[:50]
    (x, y), = data.batches(1, 4, 16, seed=0)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_noise_envelope_is_a_running_max():
    reference, sdpa = [1.0, 2.5, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.25, 5.0]
    assert train.noise_envelope(reference, sdpa) == [0.0, 0.5, 0.5, 0.5, 0.5]   # does not dip back with |Δ|
    bounds = train.agreement_bounds(reference, sdpa, torch.float64)
    k, ulps = train.NOISE_FACTOR, train.FLOOR_ULPS
    assert bounds[0] == ulps * 2.0**-52 and bounds[1] == k * 0.5 + ulps * 2.0**-51
    assert train.agreement_bounds([3.3], [3.3], torch.float32)[0] == ulps * 2.0**-22   # float32 ulp at 3.3
    with pytest.raises(ValueError, match="equal lengths"):
        train.noise_envelope([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="attention must be one of"):
        train.train("math", CharData("abcdef" * 20), steps=1)


def test_float32_curves_agree_and_loss_decreases(honest):
    runs = honest["runs"]
    sdpa, reference, fa2 = (runs[name]["loss"] for name in train.RUNS)
    assert honest["same_initial_weights"]
    # The noise reference is not degenerate: MATH rounds differently from SDPA's fused CPU kernel.
    assert honest["max_noise"] > 0 and honest["noise"] == [abs(r - s) for r, s in zip(reference, sdpa)]
    assert not exceeded(fa2, honest), f"max |Δloss| {honest['max_abs_diff']:.2e}"
    assert honest["within_bound"] and honest["max_ratio"] <= 1
    assert honest["bound"] == train.agreement_bounds(reference, sdpa)
    # It learns: from about log(vocab) to clearly below it (character frequencies alone give ~2.9 nats).
    for loss in (sdpa, reference, fa2):
        assert sum(loss[-5:]) / 5 < loss[0] - 0.5


def test_float64_curves_agree_to_rounding():
    result = train.compare(8, text_chars=20_000, dtype=torch.float64, **TINY)
    assert result["within_bound"] and not exceeded(result["runs"]["fa2edu"]["loss"], result, torch.float64)
    assert result["max_abs_diff"] <= 1e-10 and max(result["bound"]) < 1e-13


@pytest.mark.parametrize("fault", ["no causal mask", "1% of dQ from the wrong row"])
def test_the_bound_catches_a_faulty_attention(monkeypatch, honest, fault):
    honest_op = op.flash_attention
    if fault == "no causal mask":
        # The model would see the next character: training diverges from SDPA's at once.
        monkeypatch.setattr(op, "flash_attention",
                            lambda q, k, v, **kw: honest_op(q, k, v, **{**kw, "causal": False}))
    else:
        backward = op.Flash2Attention.backward

        def wrong_backward(ctx, dO, *unused):
            # An off-by-one-row leak of 1% (a tiling bug). A uniform scale of dQ would not do: Adam divides each
            # gradient entry by its own running RMS, so scaling dQ by a constant leaves the updates unchanged.
            dQ, *rest = backward(ctx, dO, *unused)
            return (dQ + 0.01 * dQ.roll(1, dims=-2), *rest)

        monkeypatch.setattr(op.Flash2Attention, "backward", staticmethod(wrong_backward))
    # Only fa2edu is retrained with the fault; SDPA and the noise reference are the honest runs.
    faulty = train.train("fa2edu", CharData(generate_text(20_000)), steps=STEPS, **TINY)
    assert faulty["initial_checksum"] == honest["runs"]["sdpa"]["initial_checksum"]
    assert exceeded(faulty["loss"], honest), f"{fault}: stayed within the bound"


PNG = b"\x89PNG\r\n\x1a\n"


def test_command_line_writes_losses_and_plot_with_progress(tmp_path, capsys):
    argv = ["--steps", "3", "--batch", "4", "--context", "16", "--layers", "1", "--d-model", "16",
            "--block-sizes", "5", "7", "--out", str(tmp_path)]
    assert train.main(argv + ["--progress"]) == 0
    result = json.loads((tmp_path / "losses.json").read_text())
    assert set(result["runs"]) == set(train.RUNS)
    assert all(len(result[key]) == 3 for key in ("abs_diff", "noise", "envelope", "bound"))
    assert result["config"]["block_sizes"] == [5, 7] and "progress" not in result["config"]
    png = tmp_path / "losses.png"                          # the same command draws the plot
    assert png.read_bytes()[:8] == PNG
    shown = capsys.readouterr()
    assert "within the bound" in shown.out and f"wrote {png}" in shown.out
    # One bar per run on stderr, counting steps, with the last loss of each run as tqdm prints it.
    for name in train.RUNS:
        last = result["runs"][name]["loss"][-1]
        assert re.search(rf"{name}: 100%.*3/3.*loss={last:.4f}", shown.err), f"no finished bar for {name}"
    # plot.py redraws from the saved file alone.
    png.unlink()
    assert plot.main([str(tmp_path / "losses.json")]) == 0 and png.read_bytes()[:8] == PNG
    # One run alone: no comparison, no verdict, and the plot still draws it; no bar off a terminal by default.
    capsys.readouterr()
    assert train.main(argv[:-2] + ["--attention", "sdpa", "--out", str(tmp_path / "one")]) == 0
    one = json.loads((tmp_path / "one" / "losses.json").read_text())
    assert set(one["runs"]) == {"sdpa"} and "within_bound" not in one
    assert (tmp_path / "one" / "losses.png").read_bytes()[:8] == PNG
    assert capsys.readouterr().err == ""
