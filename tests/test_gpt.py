"""The small GPT of examples/gpt trains the same with fa2edu's FlashAttention-2 as with PyTorch's SDPA.

A short run of a tiny model on the CPU: same initial weights, same batches, and the two loss curves stay within
``examples.gpt.train.agreement_bound`` at every step while the loss goes down. The bound is shown to have teeth:
an attention with a fault (no causal mask, or 1% of dQ taken from the wrong row) breaks it. In float64 the
curves agree to 1e-10.
"""

from __future__ import annotations

import json
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


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: extra intra-op threads only spin-wait, badly so on a busy shared CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = dict(batch=8, context=32, n_layer=1, n_head=2, d_model=32, lr=3e-3, block_sizes=(8, 8))


def bound_exceeded(result: dict, dtype=torch.float32) -> list[int]:
    """The steps at which |Δloss| is above the agreement bound."""
    return [step for step, diff in enumerate(result["abs_diff"]) if diff > train.agreement_bound(dtype, step)]


def test_text_is_deterministic_and_small():
    text = generate_text(20_000, seed=3)
    assert text == generate_text(20_000, seed=3) and text != generate_text(20_000, seed=4)
    assert 20_000 <= len(text) < 20_200
    data = CharData(text)
    assert data.vocab_size < 40 and data.decode(data.ids[:50]) == text[:50]
    (x, y), = data.batches(1, 4, 16, seed=0)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_float32_curves_agree_and_loss_decreases():
    result = train.compare(30, text_chars=20_000, **TINY)
    sdpa, fa2 = result["runs"]["sdpa"]["loss"], result["runs"]["fa2edu"]["loss"]
    assert result["same_initial_weights"]
    assert not bound_exceeded(result), f"max |Δloss| {result['max_abs_diff']:.2e}"
    assert result["within_bound"]
    # It learns: from about log(vocab) to clearly below it (character frequencies alone give ~2.9 nats).
    assert sum(fa2[-5:]) / 5 < fa2[0] - 0.5 and sum(sdpa[-5:]) / 5 < sdpa[0] - 0.5


def test_float64_curves_agree_to_rounding():
    result = train.compare(8, text_chars=20_000, dtype=torch.float64, **TINY)
    assert result["max_abs_diff"] <= 1e-10 and not bound_exceeded(result, torch.float64)


@pytest.mark.parametrize("fault", ["no causal mask", "1% of dQ from the wrong row"])
def test_the_bound_catches_a_faulty_attention(monkeypatch, fault):
    honest = op.flash_attention
    if fault == "no causal mask":
        # The model would see the next character: training diverges from SDPA's at once.
        monkeypatch.setattr(op, "flash_attention", lambda q, k, v, **kw: honest(q, k, v, **{**kw, "causal": False}))
    else:
        backward = op.Flash2Attention.backward

        def wrong_backward(ctx, dO):
            # An off-by-one-row leak of 1% (a tiling bug). A uniform scale of dQ would not do: Adam divides each
            # gradient entry by its own running RMS, so scaling dQ by a constant leaves the updates unchanged.
            dQ, *rest = backward(ctx, dO)
            return (dQ + 0.01 * dQ.roll(1, dims=-2), *rest)

        monkeypatch.setattr(op.Flash2Attention, "backward", staticmethod(wrong_backward))
    result = train.compare(30, text_chars=20_000, **TINY)
    assert bound_exceeded(result), f"{fault}: max |Δloss| {result['max_abs_diff']:.2e} stayed within the bound"


def test_command_line_writes_losses_and_plot(tmp_path, capsys):
    argv = ["--steps", "3", "--batch", "4", "--context", "16", "--layers", "1", "--d-model", "16",
            "--block-sizes", "5", "7", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    result = json.loads((tmp_path / "losses.json").read_text())
    assert set(result["runs"]) == {"sdpa", "fa2edu"} and len(result["abs_diff"]) == 3
    assert result["config"]["block_sizes"] == [5, 7]
    assert plot.main([str(tmp_path / "losses.json")]) == 0
    png = tmp_path / "losses.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "within the bound" in capsys.readouterr().out
