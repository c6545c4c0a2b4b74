"""Exercises that check themselves: a hidden property test behind every coding exercise of the book.

Each chapter ends with exercises: a question, a cell to try it in, a hint, and a worked solution folded away.
Where an exercise asks for code, this module checks the reader's function::

    from fa2edu import exercises
    exercises.list_exercises()                    # the exercises with a checker, one line each
    exercises.hint("6.2")                         # a nudge, not the answer
    result = exercises.check("6.2", fa2_update)   # runs the hidden cases, prints a report; truthy on a pass
    exercises.show_solution("6.2")                # prints the worked solution's code, to read

**How a check works.** Each exercise owns a fixed, deterministic list of cases: hand-picked edge cases first
(sizes of 1, sizes that are not powers of two, a block larger than N, N_q ≠ N_k with the causal mask aligned
bottom-right, fully masked rows, logits of ±10⁴), then cases drawn from a generator with a fixed seed, biased
towards small and ragged sizes. A case is a handful of parameters (sizes, a mask kind, a logit kind, a seed) from
which the inputs are built. The reader's function runs on each case, and what it returns is compared with ground
truth computed by fa2edu itself — the float64 oracle :func:`fa2edu.attention_reference`, the executed HBM ledger,
the element-wise causal mask, the FLOP model — never with the worked solution.

**What a failure report holds.** On the first failing case the checker *shrinks* it: it lowers each size (to its
minimum, to half, by one) and simplifies each kind, keeping every change under which the function still fails *the
same way* (the same exception, NaN, wrong infinity, wrong value, or memory over the budget), so that the case shown
is the reader's mistake and not another one met on the way.
The report then shows the smallest failing case found, the call's arguments (their values when they are small),
what was expected and what came back: the largest error and where, the positions of NaNs, a wrong shape, a wrong
infinity, or the exception raised and the line of the reader's code that raised it. ``result.failure`` keeps the
inputs, the expected values and what came back, to debug with.

Any exception the reader's code raises — in the function, or while its result is read (an ``__array__`` that
divides by zero) — is a failure of that case, named with the line that raised it; so is ``sys.exit``. Only
``KeyboardInterrupt`` stops a check. A stub that raises ``NotImplementedError`` is reported as "not attempted yet" and
nothing is raised, so a chapter with its try cells still empty runs top to bottom.

**Kernel exercises** (9.2-9.4, 13.3, 14.1-14.3) ask for a numba.cuda kernel or device function: the checker runs it
inside a harness kernel in numba's CUDA simulator and also counts the elements it reads and writes in global memory,
against a budget (:mod:`fa2edu.exercise_kernels`). They need numba, imported only when one of them is checked; where
there is no CUDA driver the simulator is chosen by itself (:func:`fa2edu.simulator.choose`). Every other exercise needs
only NumPy and fa2edu.
"""

from __future__ import annotations

import inspect
import math
import re
import sysconfig
import textwrap
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fa2edu import fp8
from fa2edu.blocks import block_sizes_kv_outer, num_blocks, tiles
from fa2edu.context_parallel import chunk_ranges
from fa2edu.flops import model_flops
from fa2edu.io import simulate_io
from fa2edu.masks import BlockKind, causal_mask
from fa2edu.memory import HBM
from fa2edu.reference import attention_reference, attention_reference_backward
from fa2edu.softmax import Stats, block_stats, exp_minus, safe_softmax
from fa2edu.standard import standard_attention

__all__ = ["check", "hint", "list_exercises", "solution", "show_solution", "CheckResult", "Failure", "Exercise",
           "Catalogue", "SKIP", "MASK", "PLAIN"]

#: What exercise 9.4's ``tile_kind`` returns (numba device functions return numbers, not strings).
SKIP, MASK, PLAIN = 0, 1, 2


# -- the parts of an exercise ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Size:
    """An integer parameter in [lo, hi]. Drawn with extra weight on the edges; shrunk towards ``lo``."""

    lo: int
    hi: int

    def draw(self, rng: np.random.Generator) -> int:
        if rng.random() < 0.3:
            return int(rng.choice([self.lo, min(self.lo + 1, self.hi), self.hi]))
        return int(rng.integers(self.lo, self.hi + 1))

    def smaller(self, value: int) -> list[int]:
        """Candidates below ``value``, most aggressive first: the minimum, half, one less."""
        return [v for v in dict.fromkeys((self.lo, value // 2, value - 1)) if self.lo <= v < value]


@dataclass(frozen=True)
class Kind:
    """A categorical parameter; ``values`` run from the simplest to the hardest, and shrinking moves left."""

    values: tuple

    def draw(self, rng: np.random.Generator):
        return self.values[int(rng.integers(len(self.values)))]

    def smaller(self, value) -> list:
        return list(self.values[:self.values.index(value)])


@dataclass(frozen=True)
class Exercise:
    """One checked exercise: what it asks, its hint, its cases and how one case is judged.

    ``run(fn, case)`` builds the inputs of ``case`` (a dict of the ``params`` plus ``seed``), calls ``fn`` through
    :class:`_Calls`, and raises :class:`_Mismatch` on a wrong answer. ``edge_cases`` are partial cases completed by
    ``base``; ``n_random`` more are drawn from ``params`` with a seed fixed by the exercise id.
    """

    id: str
    title: str
    signature: str
    hint: str
    covers: str
    params: dict
    base: dict
    edge_cases: tuple
    n_random: int
    run: Callable
    solution: Callable
    valid: Callable = lambda case: True
    shrink_budget: int = 200
    solution_is_factory: bool = False      # ``solution()`` builds the solution (the kernel ones import numba)
    kernel: bool = False                   # runs the reader's code in a numba.cuda kernel (fa2edu.exercise_kernels)
    budget: str = ""                       # a kernel exercise's global-memory budget, in words


@dataclass
class Failure:
    """The smallest failing case found: its parameters, the call's arguments, what was expected, what came back."""

    exercise: str
    case: dict
    first_case: dict
    case_number: int
    shrink_steps: int
    lines: list
    inputs: dict
    expected: Any = None
    got: Any = None

    def __str__(self) -> str:
        return "\n".join(self.lines)


@dataclass
class CheckResult:
    """What :func:`check` found. True when every case passed; ``failure`` describes the first wrong case, shrunk."""

    exercise: str
    passed: bool
    attempted: bool
    cases: int
    failure: Failure | None
    report: str = field(repr=False)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self.report


class _Mismatch(Exception):
    """A wrong answer: readable lines, plus the values behind them."""

    def __init__(self, lines, expected=None, got=None, kind=None):
        super().__init__("\n".join(lines))
        self.lines = list(lines)
        self.expected, self.got = expected, got
        self.inputs: dict = {}
        self.call = ""           # which call failed: the function's name and where in the case (a tile, a launch)
        self.index: tuple | None = None    # the first wrong entry, where an array was compared
        self.kind = kind         # how it fails (see _failure_kind); shrinking keeps it
        self.traffic: str | None = None    # a kernel exercise: the launch's global-memory traffic beside its budget


class _LearnerExit(Exception):
    """``SystemExit`` (``sys.exit``) or another ``BaseException`` raised by the reader's code where it cannot travel as
    itself: in a simulated CUDA thread, which it would end silently. The kernel harnesses raise this instead."""


class _NotAttempted(Exception):
    """The reader's function raised NotImplementedError: the stub is still a stub."""


class _Calls:
    """Calls the reader's function (``name``: what the exercise calls it) with copies of the inputs; the last call
    made is kept for the report."""

    last: "_Calls | None" = None

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self.inputs: dict = {}
        self.where = ""

    def __call__(self, *named, where: str = ""):
        _Calls.last = self
        self.inputs = dict(named)
        self.where = where
        args = [np.array(v, copy=True) if isinstance(v, np.ndarray) else v for _, v in named]
        try:
            with np.errstate(all="ignore"):
                return self.fn(*args)
        except NotImplementedError:
            raise _NotAttempted from None
        except KeyboardInterrupt:
            raise                            # the reader stopping the check, not a finding
        except BaseException as error:  # noqa: BLE001  (any exception of the reader's code is a finding, sys.exit too)
            raise _Mismatch(_raised(error)) from None


def _raised(error: BaseException, doing: str = "your function raised") -> list[str]:
    """The report's lines for an exception of the reader's code: its type and message, and the line that raised it."""
    if isinstance(error, SystemExit):
        return [f"{doing} SystemExit ({error.code!r}): sys.exit() stops the whole program; a checked function must "
                "return its answer", *_raising_line(error)]
    if isinstance(error, _LearnerExit):
        return [f"{doing} {error}: it would have ended its simulated thread silently"]
    return [f"{doing} {type(error).__name__}: {error}", *_raising_line(error)]


_KERNELS_FILE = str(Path(__file__).with_name("exercise_kernels.py"))


def _raising_line(error: BaseException) -> list[str]:
    """The last line of the reader's own code in the traceback (not NumPy's, not this module's)."""
    library = (__file__, _KERNELS_FILE, sysconfig.get_paths()["stdlib"], "site-packages", "dist-packages")
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(f.filename == part or f.filename.startswith(part) or part in f.filename
                         for part in library)]
    if not frames:
        return []
    frame = frames[-1]
    source = f": {frame.line.strip()}" if frame.line else ""
    return [f"  (raised in {frame.name}, line {frame.lineno}{source})"]


# -- comparing what came back with what was expected -------------------------------------------------------------

def _fmt(x) -> str:
    """A number as a reader wants to see it: ±inf, nan, or 6 significant digits."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _index(idx) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _unpack(got, n: int, names: str):
    """The reader's result as a tuple of ``n`` parts, or a mismatch saying what shape of answer was expected."""
    if not isinstance(got, (tuple, list)) or len(got) != n:
        kind = "None" if got is None else (f"a {type(got).__name__} of length {len(got)}"
                                           if isinstance(got, (tuple, list)) else f"a {type(got).__name__}")
        raise _Mismatch([f"your function returned {kind}; expected a tuple {names}"], got=got, kind="type")
    return tuple(got)


def _expect_close(name: str, got, expected, *, rtol: float, atol: float = 0.0) -> None:
    """Raise a :class:`_Mismatch` unless ``got`` matches ``expected`` (float64) in shape, NaNs, infinities, values.

    The tolerance is ``atol + rtol · scale`` with ``scale`` the largest finite ``|expected|``: one yardstick for a
    whole array, so an entry that is 0 by cancellation is not held to a relative tolerance it cannot meet.
    """
    expected = np.asarray(expected, dtype=np.float64)
    if got is None:
        raise _Mismatch([f"{name}: your function returned None; expected an array of shape {expected.shape}"],
                        expected, got)
    g = _as_numbers(name, got, expected)
    if g.shape != expected.shape:
        raise _Mismatch([f"{name}: wrong shape {g.shape}; expected {expected.shape}"], expected, g)
    bad_nan = np.isnan(g) & ~np.isnan(expected)
    if bad_nan.any():
        where = np.argwhere(bad_nan)
        shown = ", ".join(f"{name}{_index(i)} (expected {_fmt(expected[tuple(i)])})" for i in where[:4])
        more = f" and {len(where) - 4} more" if len(where) > 4 else ""
        raise _at(_Mismatch([f"{name}: NaN in {len(where)} of {g.size} entries: {shown}{more}"], expected, g,
                            kind="nan"), where[0])
    bad_inf = (np.isinf(g) | np.isinf(expected)) & (g != expected)
    if bad_inf.any():
        i = tuple(np.argwhere(bad_inf)[0])
        raise _at(_Mismatch([f"{name}{_index(i)}: expected {_fmt(expected[i])}, got {_fmt(g[i])} "
                             f"({_count(int(bad_inf.sum()), 'entry disagrees', 'entries disagree')} about "
                             "infinity)"], expected, g, kind="infinity"), i)
    finite = np.isfinite(expected)
    if not finite.any():
        return
    tol = atol + rtol * float(np.abs(expected[finite]).max())
    err = np.where(finite, np.abs(g - np.where(finite, expected, 0.0)), 0.0)
    if err.max() > tol:
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise _at(_Mismatch([f"{name}: max |got − expected| = {err.max():.2e} at {name}{_index(i)}: expected "
                             f"{_fmt(expected[i])}, got {_fmt(g[i])} (tolerance {tol:.1e}; "
                             f"{_count(int((err > tol).sum()), 'entry', 'entries')} of {g.size} off)"], expected, g,
                            kind="value"), i)


def _as_float(got, what: str, expected=None) -> float:
    """``float(got)``, or a mismatch naming what was expected and what ``float()`` raised."""
    try:
        return float(got)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001
        raise _Mismatch(_raised(error, f"your function returned {type(got).__name__} {_short_repr(got)}; expected "
                                       f"{what}, and float() of it raised"), expected, got, kind="type") from None


def _short_repr(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001  (a reader's object whose repr fails)
        return f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _at(mismatch: _Mismatch, index) -> _Mismatch:
    mismatch.index = tuple(int(i) for i in index)
    return mismatch


def _as_numbers(name: str, got, expected=None) -> np.ndarray:
    """What came back as a float64 array, or a mismatch saying why it is not one (whatever its ``__array__`` or
    ``__float__`` raised: the reader's object, the reader's exception)."""
    try:
        with np.errstate(all="ignore"):
            return np.asarray(got, dtype=np.float64)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001
        raise _Mismatch(_raised(error, f"{name}: what came back ({type(got).__name__}) is not an array of numbers: "
                                       "converting it raised"), expected, got, kind="type") from None


def _expect_equal_ints(names: tuple, got, expected: tuple, *, explain: str = "") -> None:
    """Exact integer answers (element counts): each part of ``got`` must equal its part of ``expected``."""
    parts = _unpack(got, len(expected), "(" + ", ".join(names) + ")")
    wrong = []
    for name, g, e in zip(names, parts, expected):
        try:
            value = float(g)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001
            raise _Mismatch(_raised(error, f"{name}: expected a number, got {type(g).__name__}; float() of it "
                                           "raised"), expected, got, kind="type") from None
        if value != float(e):
            wrong.append(f"{name}: expected {int(e):,}, got {_exact(value)} (off by {_exact(value - float(e), '+')})")
    if wrong:
        raise _Mismatch(wrong + ([explain] if explain else []), expected, got)


def _exact(x: float, sign: str = "") -> str:
    """A number written exactly, with thousands separators: −4.5 stays −4.5 (never rounded to −4), 1e21 stays
    1e+21, and inf and nan are named."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return _fmt(x) if sign or x < 0 else "inf"
    if x.is_integer() and abs(x) < 1e18:
        return format(int(x), f"{sign},")
    return format(x, f"{sign},")


def _offset(offset: int) -> str:
    return "i" if offset == 0 else (f"i + {offset}" if offset > 0 else f"i − {-offset}")


def _picture(visible: np.ndarray, max_rows: int = 12, max_cols: int = 24) -> list[str]:
    """A boolean tile drawn as text: ■ where the query may attend to the key, · where it is masked."""
    if visible.shape[0] > max_rows or visible.shape[1] > max_cols:
        return []
    return ["  " + " ".join("■" if v else "·" for v in row) for row in visible]


def _show(name: str, value) -> str:
    """One argument of a call: its values when small, else its shape."""
    if isinstance(value, Stats):
        return f"{name} = Stats(m={_show_array(value.m)}, l={_show_array(value.l)})"
    if isinstance(value, np.ndarray):
        return f"{name} = {_show_array(value)}"
    if isinstance(value, slice):
        return f"{name} = slice({value.start}, {value.stop})"
    return f"{name} = {value!r}"


def _show_array(a: np.ndarray) -> str:
    if a.size <= 12:
        text = np.array2string(a, precision=4, separator=", ", max_line_width=10_000)
        return " ".join(text.split())
    return f"<array of shape {a.shape}, {a.dtype}>"


# -- inputs: scores, masks, logits of every size -----------------------------------------------------------------

LOGIT_SCALES = {"normal": 1.0, "spread": 20.0, "large": 1.0e4, "tiny": 1.0e-12}


def _logits(rng: np.random.Generator, shape: tuple, kind: str) -> np.ndarray:
    """Scores of the given kind: N(0, 1); ×20; ×10⁴ (exp overflows without the max trick); ×10⁻¹² (near
    uniform); or "rising", which drifts upwards along each row so that the running maximum keeps moving."""
    x = rng.standard_normal(shape)
    if kind == "rising":
        return x + np.linspace(0.0, 8.0, shape[-1])
    return x * LOGIT_SCALES[kind]


def _visible(rng: np.random.Generator, N_q: int, N_k: int, kind: str, first: int = 1) -> np.ndarray:
    """Which (query, key) pairs are visible: all ("none"), the bottom-right causal mask ("causal"), or a random
    mask ("random") in which row 0 sees no key at all and row 1 sees nothing in its first ``first`` keys."""
    if kind == "none":
        return np.ones((N_q, N_k), dtype=bool)
    if kind == "causal":
        return causal_mask(N_q, N_k)
    visible = rng.random((N_q, N_k)) < 0.6
    visible[0] = False
    if N_q >= 2:
        visible[1, :first] = False
        if N_k > first:
            visible[1, first] = True
    return visible


def _masked(S: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Masked scores are a real −inf (chapter 2), never a finite sentinel."""
    return np.where(visible, S, -np.inf)


def _prefix_state(S: np.ndarray, V: np.ndarray, stop: int):
    """Ground truth after the keys [0, stop) of each row: (m, ℓ, Õ = e^{S − m} V, O = Õ / ℓ), with the guards."""
    S_seen = S[:, :stop]
    m = S_seen.max(axis=1)
    P = exp_minus(S_seen, m)
    l = P.sum(axis=1)
    O_tilde = P @ V[:stop]
    return m, l, O_tilde, O_tilde / np.where(l == 0.0, 1.0, l)[:, None]


def _oracle(S: np.ndarray, V: np.ndarray):
    """The float64 oracle on given scores: attention_reference with Q = S (masked entries zeroed), K = I and τ = 1,
    so that τ·QKᵀ is S exactly and the mask is passed as a mask. Returns (O, L), L = +inf on fully masked rows."""
    visible = np.isfinite(S)
    return attention_reference(np.where(visible, S, 0.0), np.eye(S.shape[1]), V, scale=1.0, mask=visible)


def _row_note(S_seen: np.ndarray, tile: np.ndarray | None = None) -> list[str]:
    """Context for a failure on scores: which rows have seen no key yet, which see none in this tile."""
    notes = []
    empty = np.flatnonzero(~np.isfinite(S_seen).any(axis=1))
    if empty.size:
        notes.append(f"rows that have seen no visible key so far: {empty.tolist()} (m = −inf, ℓ = 0 there)")
    if tile is not None:
        masked_tile = np.flatnonzero(~np.isfinite(tile).any(axis=1))
        if masked_tile.size:
            notes.append(f"rows whose scores in this tile are all −inf: {masked_tile.tolist()}")
    return notes


# -- 1.3 standard attention's HBM traffic -------------------------------------------------------------------------

def _run_standard_io(fn, case):
    N_q, N_k, d = case["N_q"], case["N_k"], case["d"]
    rng = np.random.default_rng(case["seed"])
    hbm = HBM()
    standard_attention(rng.standard_normal((N_q, d)), rng.standard_normal((N_k, d)),
                       rng.standard_normal((N_k, d)), hbm=hbm)
    calls = _Calls(fn, "standard_io")
    got = calls(("N_q", N_q), ("N_k", N_k), ("d", d))
    lines = [f"  {line}: reads {c['read']:,}, writes {c['write']:,}" for line, c in hbm.by_line().items()]
    _expect_equal_ints(("reads", "writes"), got, (hbm.reads, hbm.writes),
                       explain="the executed ledger, line by line:\n" + "\n".join(lines))


def _solution_standard_io(N_q, N_k, d):
    # Alg. 0 line 1: read Q, K; write S = QKᵀ (N_q × N_k).
    reads, writes = N_q * d + N_k * d, N_q * N_k
    # Alg. 0 line 2: read S; write P = softmax(S).
    reads, writes = reads + N_q * N_k, writes + N_q * N_k
    # Alg. 0 line 3: read P and V; write O = PV (N_q × d).
    reads, writes = reads + N_q * N_k + N_k * d, writes + N_q * d
    return reads, writes


# -- 2.2 the (m, ℓ) merge -----------------------------------------------------------------------------------------

def _run_merge(fn, case):
    rng = np.random.default_rng(case["seed"])
    rows = case["rows"]
    x_a = _logits(rng, (rows, case["n_a"]), case["logits"])
    x_b = _logits(rng, (rows, case["n_b"]), case["logits"])
    empty = case["empty"]
    if empty in ("a", "both"):
        x_a[:] = -np.inf
    if empty in ("b", "both"):
        x_b[:] = -np.inf
    if empty == "rows":
        x_a[0] = -np.inf                       # row 0 saw nothing in block a ...
        if rows >= 2:
            x_b[0] = -np.inf                   # ... nor in block b: a fully masked row
            x_b[1] = -np.inf                   # row 1 saw nothing in block b only
    expected = block_stats(np.concatenate([x_a, x_b], axis=1))   # ground truth: the statistics of the whole row
    calls = _Calls(fn, "merge")
    got = calls(("a", block_stats(x_a)), ("b", block_stats(x_b)))
    m, l = _unpack(got, 2, "(m, l)")
    _expect_close("m", m, expected.m, rtol=1e-13)
    _expect_close("l", l, expected.l, rtol=1e-10)


def _solution_merge(a, b):
    m = np.maximum(a.m, b.m)
    # Guard m = −inf (both sides empty): e^{−inf − 0} = 0 instead of e^{−inf − (−inf)} = NaN.
    m_safe = np.where(np.isneginf(m), 0.0, m)
    return Stats(m, np.exp(a.m - m_safe) * a.l + np.exp(b.m - m_safe) * b.l)


# -- 2.3 online softmax -------------------------------------------------------------------------------------------

def _run_online_softmax(fn, case):
    rng = np.random.default_rng(case["seed"])
    rows, n, block = case["rows"], case["n"], case["block"]
    x = _logits(rng, (rows, n), case["logits"])
    masked = case["masked"]
    if masked == "entries":
        hide = rng.random((rows, n)) < 0.3
        hide[np.arange(rows), rng.integers(n, size=rows)] = False       # every row keeps a visible entry
        x[hide] = -np.inf
    elif masked == "rows":
        x[0] = -np.inf
    elif masked == "first block":
        x[:, :block] = -np.inf
    calls = _Calls(fn, "online_softmax")
    got = calls(("x", x), ("block", block))
    try:
        _expect_close("p", got, safe_softmax(x), rtol=1e-10, atol=1e-300)
    except _Mismatch as mismatch:
        mismatch.lines += _row_note(x)
        raise


def _solution_online_softmax(x, block):
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for start in range(0, x.shape[-1], block):
        x_b = x[..., start:start + block]
        m_new = np.maximum(m, x_b.max(axis=-1))
        # Rescale the old sum to the new maximum (exp_minus guards m_new = −inf: nothing seen).
        l = exp_minus(m[..., None], m_new)[..., 0] * l + exp_minus(x_b, m_new).sum(axis=-1)
        m = m_new
    # The second pass: normalise (guard ℓ = 0 on a fully masked row).
    return exp_minus(x, m) / np.where(l == 0.0, 1.0, l)[..., None]


# -- 3.3 and 6.2: one tile's update of a row block ----------------------------------------------------------------

def _tile_problem(case):
    rng = np.random.default_rng(case["seed"])
    N_q, N_k = case["N_q"], case["N_k"]
    S = _masked(_logits(rng, (N_q, N_k), case["logits"]), _visible(rng, N_q, N_k, case["mask"], case["B_c"]))
    V = rng.standard_normal((N_k, case["d_v"]))
    return S, V


def _run_tile_updates(fn, case, *, unscaled: bool):
    """Stream the tiles of S through the reader's update; check (m, ℓ, O or Õ) after every tile, then O and L."""
    S, V = _tile_problem(case)
    N_q, N_k = S.shape
    name = "O_tilde" if unscaled else "O"
    calls = _Calls(fn, "fa2_update" if unscaled else "fa1_update")
    # FA1 Alg. 1 line 2 / FA2 Alg. 1 line 5: O = 0, ℓ = 0, m = −inf.
    O, l, m = np.zeros((N_q, V.shape[1])), np.zeros(N_q), np.full(N_q, -np.inf)
    col_tiles = tiles(N_k, case["B_c"])
    for j, cols in enumerate(col_tiles):
        where = f"tile {j + 1} of {len(col_tiles)}: columns {cols.start}:{cols.stop}"
        got = calls((name, O), ("l", l), ("m", m), ("S_ij", S[:, cols]), ("V_j", V[cols]), where=where)
        try:
            O, l, m = _unpack(got, 3, f"({name}, l, m)")
            m_exp, l_exp, O_tilde_exp, O_exp = _prefix_state(S, V, cols.stop)
            _expect_close("m", m, m_exp, rtol=1e-13)
            _expect_close("l", l, l_exp, rtol=1e-10)
            _expect_close(name, O, O_tilde_exp if unscaled else O_exp, rtol=1e-10)
        except _Mismatch as mismatch:
            mismatch.lines += _row_note(S[:, :cols.stop], S[:, cols])
            raise
        O, l, m = (np.asarray(v, dtype=np.float64) for v in (O, l, m))
    if unscaled:
        # FA2 Alg. 1 lines 12-13, done here: O = Õ / ℓ and L = m + log ℓ (0 and +inf on fully masked rows).
        l_safe = np.where(l == 0.0, 1.0, l)
        O_final = O / l_safe[:, None]
        with np.errstate(divide="ignore"):
            L_final = np.where(l == 0.0, np.inf, m + np.log(l_safe))
        O_ref, L_ref = _oracle(S, V)
        _expect_close("O = Õ / ℓ after the last tile", O_final, O_ref, rtol=1e-10)
        _expect_close("L = m + log ℓ after the last tile", L_final, L_ref, rtol=1e-10)


def _solution_fa1_update(O_i, l_i, m_i, S_ij, V_j):
    # Alg. 1 line 10: this tile alone: m̃ = rowmax(S_ij), P̃ = exp(S_ij − m̃), ℓ̃ = rowsum(P̃)
    # (guarded where m̃ = −inf).
    m_tilde = S_ij.max(axis=1)
    P_tilde = exp_minus(S_ij, m_tilde)
    l_tilde = P_tilde.sum(axis=1)
    # Alg. 1 line 11: m_new = max(m_i, m̃), ℓ_new = e^{m_i − m_new} ℓ_i + e^{m̃ − m_new} ℓ̃.
    m_new = np.maximum(m_i, m_tilde)
    alpha = exp_minus(m_i[:, None], m_new)[:, 0]
    beta = exp_minus(m_tilde[:, None], m_new)[:, 0]
    l_new = alpha * l_i + beta * l_tilde
    # Alg. 1 line 12: O ← diag(ℓ_new)⁻¹ (diag(ℓ_i) e^{m_i − m_new} O_i + e^{m̃ − m_new} P̃ V_j),
    # guarded where ℓ_new = 0.
    O_new = (l_i * alpha)[:, None] * O_i + beta[:, None] * (P_tilde @ V_j)
    return O_new / np.where(l_new == 0, 1, l_new)[:, None], l_new, m_new


def _solution_fa2_update(O_tilde, l, m, S_ij, V_j):
    # Alg. 1 line 9: m_new = max(m, rowmax(S_ij)); P̃ = exp(S_ij − m_new)
    # (guarded where m_new = −inf).
    m_new = np.maximum(m, S_ij.max(axis=1))
    P_tilde = exp_minus(S_ij, m_new)
    alpha = exp_minus(m[:, None], m_new)[:, 0]          # e^{m − m_new}: 0 while m = −inf
    # Alg. 1 line 9: ℓ_new = e^{m − m_new} ℓ + rowsum(P̃).
    l_new = alpha * l + P_tilde.sum(axis=1)
    # Alg. 1 line 10: Õ_new = diag(e^{m − m_new}) Õ + P̃ V_j (no inverse: erratum 4).
    return alpha[:, None] * O_tilde + P_tilde @ V_j, l_new, m_new


# -- 4.3 FA1 forward's HBM traffic --------------------------------------------------------------------------------

def _valid_flash1_io(case) -> bool:
    N, d, M = case["N"], case["d"], case["M"]
    if M < 4 * d:
        return False
    B_r, B_c = block_sizes_kv_outer(M, d)
    return num_blocks(N, B_r) * num_blocks(N, B_c) <= 600       # keeps the executed ledger quick


def _run_flash1_io(fn, case):
    N, d, M = case["N"], case["d"], case["M"]
    row = simulate_io(N, d, M, method="execute", algorithms=("flash1",), passes=("forward",),
                      seed=case["seed"]).row("flash1", "forward")
    calls = _Calls(fn, "flash1_forward_io")
    got = calls(("N", N), ("d", d), ("M", M))
    B_r, B_c = row.block_sizes
    T_c = num_blocks(N, B_c)
    _expect_equal_ints(("reads", "writes"), got, (row.reads, row.writes),
                       explain=f"(the executed run used B_r = {B_r}, B_c = {B_c}, so T_c = {T_c}; its last column "
                               f"block has {N - (T_c - 1) * B_c} of {B_c} rows)")


def _solution_flash1_io(N, d, M):
    # Alg. 1 line 1: B_c = ceil(M / 4d); T_c = ceil(N / B_c), the last block ragged.
    B_c = math.ceil(M / (4 * d))
    T_c = math.ceil(N / B_c)
    # Line 6 reads K_j, V_j once (2Nd in all); each outer step reads Q, O, ℓ, m (lines 8)
    # and writes O, ℓ, m (lines 12-13) for every row.
    return 2 * N * d + T_c * (2 * N * d + 2 * N), T_c * (N * d + 2 * N)


# -- 5.1 the softmax backward -------------------------------------------------------------------------------------

def _run_softmax_backward(fn, case):
    rng = np.random.default_rng(case["seed"])
    N_q, N_k = case["N_q"], case["N_k"]
    S = _masked(_logits(rng, (N_q, N_k), case["logits"]), _visible(rng, N_q, N_k, case["mask"]))
    P = safe_softmax(S)
    dP = rng.standard_normal((N_q, N_k))
    # Ground truth, by definition: the Jacobian of each row's softmax, diag(p) − ppᵀ, applied to its dp.
    jacobians = np.einsum("ij,jk->ijk", P, np.eye(N_k)) - np.einsum("ij,ik->ijk", P, P)
    expected = np.einsum("ijk,ik->ij", jacobians, dP)
    calls = _Calls(fn, "softmax_backward")
    got = calls(("P", P), ("dP", dP))
    try:
        _expect_close("dS", got, expected, rtol=1e-10, atol=1e-12)
    except _Mismatch as mismatch:
        mismatch.lines += _row_note(S)
        raise


def _solution_softmax_backward(P, dP):
    # FA1 Alg. 4 lines 19-20: D_i = rowsum(P ∘ dP) (= rowsum(dO ∘ O)), dS = P ∘ (dP − D).
    D = (P * dP).sum(axis=-1, keepdims=True)
    return P * (dP - D)


# -- 7.4 split-K: merging the warps' partials ---------------------------------------------------------------------

def _run_merge_warps(fn, case):
    rng = np.random.default_rng(case["seed"])
    r, c, W = case["r"], case["c"], case["W"]
    S = _masked(_logits(rng, (r, c), case["logits"]), _visible(rng, r, c, case["mask"]))
    V = rng.standard_normal((c, case["d_v"]))
    # Split-K: warp w owns a contiguous slice of the tile's columns (none at all when W > c).
    m_w, l_w, O_w = [], [], []
    for cols in np.array_split(np.arange(c), W):
        S_w = S[:, cols] if cols.size else np.full((r, 1), -np.inf)
        m = S_w.max(axis=1)
        P = exp_minus(S_w, m)
        m_w.append(m)
        l_w.append(P.sum(axis=1))
        O_w.append(P @ V[cols] if cols.size else np.zeros((r, V.shape[1])))
    m_exp, l_exp, O_tilde_exp, _ = _prefix_state(S, V, c)
    calls = _Calls(fn, "merge_partials")
    got = calls(("m", np.stack(m_w)), ("l", np.stack(l_w)), ("O_tilde", np.stack(O_w)))
    try:
        m, l, O_tilde = _unpack(got, 3, "(m, l, O_tilde)")
        _expect_close("m", m, m_exp, rtol=1e-13)
        _expect_close("l", l, l_exp, rtol=1e-10)
        _expect_close("O_tilde", O_tilde, O_tilde_exp, rtol=1e-10)
    except _Mismatch as mismatch:
        mismatch.lines += _row_note(S)
        empty = [w for w, cols in enumerate(np.array_split(np.arange(c), W)) if cols.size == 0]
        if empty:
            mismatch.lines.append(f"warps with no column of this tile: {empty} (m = −inf, ℓ = 0, Õ = 0)")
        raise


def _solution_merge_warps(m, l, O_tilde):
    # The merged maximum; a row that every warp saw as empty keeps m = −inf.
    m_all = m.max(axis=0)
    # Rescale each warp's partial from its own maximum to the merged one
    # (exp_minus guards m_all = −inf).
    scale = exp_minus(m.T, m_all).T                                   # (W, r): e^{m_w − m}
    return m_all, (scale * l).sum(axis=0), (scale[..., None] * O_tilde).sum(axis=0)


# -- 8.1 causal block classification ------------------------------------------------------------------------------

def _as_kind(value) -> str | None:
    if isinstance(value, BlockKind):
        return value.value
    if isinstance(value, str) and value.strip().lower() in ("skip", "mask", "plain"):
        return value.strip().lower()
    return None


def _run_block_kind(fn, case):
    N_q, N_k, B_r, B_c = case["N_q"], case["N_k"], case["B_r"], case["B_c"]
    calls = _Calls(fn, "block_kind")
    for rows in tiles(N_q, B_r):
        for cols in tiles(N_k, B_c):
            visible = causal_mask(N_q, N_k, rows, cols)      # ground truth: the element mask of the tile
            expected = "skip" if not visible.any() else ("plain" if visible.all() else "mask")
            got = calls(("N_q", N_q), ("N_k", N_k), ("rows", rows), ("cols", cols),
                        where=f"rows {rows.start}:{rows.stop}, columns {cols.start}:{cols.stop}")
            kind = _as_kind(got)
            if kind is None:
                raise _Mismatch([f"your function returned {got!r}; expected 'skip', 'mask' or 'plain' "
                                 "(or a fa2edu.masks.BlockKind)"], expected, got)
            if kind != expected:
                raise _Mismatch([f"tile rows {rows.start}:{rows.stop}, columns {cols.start}:{cols.stop}: expected "
                                 f"{expected!r}, got {kind!r}",
                                 f"query i sees key j iff j ≤ i + N_k − N_q = {_offset(N_k - N_q)}; the tile "
                                 "(■ visible, · masked):", *_picture(visible)], expected, got)


def _solution_block_kind(N_q, N_k, rows, cols):
    offset = N_k - N_q                   # bottom-right: query i sees key j iff j <= i + offset
    if cols.start > rows.stop - 1 + offset:    # even the tile's bottom-left entry is masked
        return "skip"
    if cols.stop - 1 <= rows.start + offset:   # even the tile's top-right entry is visible
        return "plain"
    return "mask"


# -- 9.2-9.4, 13.3, 14.1-14.3: kernel steps run in numba's CUDA simulator (fa2edu.exercise_kernels) ---------

def _kernel_run(name: str) -> Callable:
    """The runner of a kernel exercise, imported on first use: numba is needed only when one is checked."""
    def run(fn, case):
        from fa2edu import exercise_kernels
        return getattr(exercise_kernels, f"run_{name}")(fn, case)
    run.__name__ = f"run_{name}"
    return run


def _kernel_solution(name: str) -> Callable:
    """The worked kernel or device function of a kernel exercise (compiled, or wrapped by the simulator)."""
    def solution():
        from fa2edu import exercise_kernels
        return getattr(exercise_kernels, name)
    solution.__name__ = name
    return solution


# -- 10.1 TFLOP/s from a results record ---------------------------------------------------------------------------

def _run_tflops(fn, case):
    record = {"impl": "kg_flash2", "pass": case["pass"], "dtype": "float32", "batch": case["batch"],
              "heads": case["heads"], "N": case["N"], "d": case["d"], "causal": case["causal"], "ms": case["ms"],
              "status": "ok"}
    flops = model_flops(case["batch"], case["heads"], case["N"], case["d"], case["causal"], case["pass"])
    expected = flops / (case["ms"] * 1e-3) / 1e12
    calls = _Calls(fn, "tflops")
    got = calls(("record", record))
    value = _as_float(got, "a number (TFLOP/s)", expected)
    if not math.isclose(value, expected, rel_tol=1e-9):
        raise _Mismatch([f"expected {_fmt(expected)} TFLOP/s ({flops:.6g} model FLOPs in {record['ms']} ms), "
                         f"got {_fmt(value)} (ratio got / expected = {value / expected:.4g})"], expected, got)


def _solution_tflops(record):
    # FA2 §4.1: forward 4·N²·d FLOPs per (batch, head); halved with a causal mask;
    # backward 2.5×, both 3.5×.
    flops = 4 * record["N"] ** 2 * record["d"] * record["heads"] * record["batch"]
    if record["causal"]:
        flops /= 2
    flops *= {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}[record["pass"]]
    return flops / (record["ms"] * 1e-3) / 1e12


# -- 11.4 standard attention backward -----------------------------------------------------------------------------

def _run_attention_backward(fn, case):
    rng = np.random.default_rng(case["seed"])
    N_q, N_k, d, d_v = case["N_q"], case["N_k"], case["d"], case["d_v"]
    Q = rng.standard_normal((N_q, d)) * (300.0 if case["logits"] == "large" else 1.0)
    K, V, dO = rng.standard_normal((N_k, d)), rng.standard_normal((N_k, d_v)), rng.standard_normal((N_q, d_v))
    expected = attention_reference_backward(Q, K, V, dO, causal=case["causal"])
    calls = _Calls(fn, "attention_backward")
    got = calls(("Q", Q), ("K", K), ("V", V), ("dO", dO), ("causal", case["causal"]))
    dQ, dK, dV = _unpack(got, 3, "(dQ, dK, dV)")
    try:
        for name, g, e in (("dV", dV, expected.dV), ("dK", dK, expected.dK), ("dQ", dQ, expected.dQ)):
            _expect_close(name, g, e, rtol=1e-9, atol=1e-10)
    except _Mismatch as mismatch:
        if case["causal"] and N_q > N_k:
            mismatch.lines.append(f"rows 0 to {N_q - N_k - 1} see no key (causal, N_q > N_k, bottom-right): "
                                  "their O and gradients are 0")
        raise


def _solution_attention_backward(Q, K, V, dO, causal=False):
    N_q, N_k, d = Q.shape[0], K.shape[0], Q.shape[1]
    tau = 1.0 / np.sqrt(d)
    S = tau * Q @ K.T
    if causal:                                   # bottom-right aligned: j <= i + N_k − N_q
        S = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + N_k - N_q, S, -np.inf)
    m = S.max(axis=1)
    P = exp_minus(S, m)                          # guarded: 0 on a fully masked row, not NaN
    l = P.sum(axis=1)
    P = P / np.where(l == 0.0, 1.0, l)[:, None]
    O = P @ V
    dV = P.T @ dO                                # FA1 Alg. 3 line 2
    dP = dO @ V.T                                # line 2
    dS = P * (dP - (dO * O).sum(axis=1, keepdims=True))   # line 4
    dQ = tau * dS @ K                            # line 5
    dK = tau * dS.T @ Q                          # line 5: dSᵀ Q (§2.2 prints Q dSᵀ, erratum 1)
    return dQ, dK, dV


# -- 12.4 the causal mask for SDPA --------------------------------------------------------------------------------

def _run_sdpa_mask(fn, case):
    N_q, N_k = case["N_q"], case["N_k"]
    expected = causal_mask(N_q, N_k)
    calls = _Calls(fn, "sdpa_causal_mask")
    got = calls(("N_q", N_q), ("N_k", N_k))
    try:
        mask = np.asarray(got)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001
        raise _Mismatch(_raised(error, f"what came back ({type(got).__name__}) is not an array: converting it "
                                       "raised"), expected, got, kind="type") from None
    if mask.dtype != np.bool_:
        raise _Mismatch([f"expected a boolean mask (True where query i may attend to key j); got dtype "
                         f"{mask.dtype}"], expected, got)
    if mask.shape != expected.shape:
        raise _Mismatch([f"wrong shape {mask.shape}; expected (N_q, N_k) = {expected.shape}"], expected, got)
    wrong = mask != expected
    if wrong.any():
        i, j = (int(v) for v in np.argwhere(wrong)[0])
        lines = [f"entry [{i}, {j}]: expected {'visible' if expected[i, j] else 'masked'} (True = attend), got "
                 f"{'visible' if mask[i, j] else 'masked'}; {int(wrong.sum())} of {wrong.size} entries differ"]
        if _picture(expected):
            lines += ["expected (■ visible, · masked):", *_picture(expected), "got:", *_picture(mask)]
        raise _Mismatch(lines, expected, mask)


def _solution_sdpa_mask(N_q, N_k):
    i = np.arange(N_q)[:, None]
    j = np.arange(N_k)[None, :]
    return j <= i + (N_k - N_q)                  # bottom-right: the last query sees every key


# -- 13.2 merging two partial attentions (O, L) ------------------------------------------------------------------

def _partial(S: np.ndarray, V: np.ndarray, cols: slice):
    """The oracle's (O, L) over the keys ``cols`` alone; O = 0, L = +inf where no key is visible (or none at all)."""
    N_q = S.shape[0]
    if cols.stop <= cols.start:
        return np.zeros((N_q, V.shape[1])), np.full(N_q, np.inf)
    return _oracle(S[:, cols], V[cols])


def _run_merge_states(fn, case):
    rng = np.random.default_rng(case["seed"])
    N_q, N_k, split = case["N_q"], case["N_k"], case["split"]
    S = _masked(_logits(rng, (N_q, N_k), case["logits"]), _visible(rng, N_q, N_k, case["mask"], max(split, 1)))
    V = rng.standard_normal((N_k, case["d_v"]))
    (O_a, L_a), (O_b, L_b) = _partial(S, V, slice(0, split)), _partial(S, V, slice(split, N_k))
    O_ref, L_ref = _oracle(S, V)                       # ground truth: the attention over all the keys
    calls = _Calls(fn, "merge_states")
    got = calls(("O_a", O_a), ("L_a", L_a), ("O_b", O_b), ("L_b", L_b))
    try:
        O, L = _unpack(got, 2, "(O, L)")
        _expect_close("L", L, L_ref, rtol=1e-12)
        _expect_close("O", O, O_ref, rtol=1e-10)
    except _Mismatch as mismatch:
        # The sides of the first wrong row: whether each saw a key is part of how the merge fails, so shrinking
        # keeps it (an overflow on two full sides is not shrunk into a case with an empty side), and the note says it.
        row = mismatch.index[0] if mismatch.index else None
        if row is not None and row < N_q:
            seen = tuple(not np.isposinf(L_side[row]) for L_side in (L_a, L_b))
            mismatch.kind = (_failure_kind(mismatch), seen)
            sides = [f"side {side} " + (f"saw keys (L_{side} = {_fmt(L_side[row])})" if saw else
                                         f"saw no key (O_{side} = 0, L_{side} = +inf)")
                     for side, L_side, saw in (("a", L_a, seen[0]), ("b", L_b, seen[1]))]
            mismatch.lines.append(f"row {row}, the first wrong one: {sides[0]}; {sides[1]}")
        for side, L_side in (("a", L_a), ("b", L_b)):
            empty = np.flatnonzero(np.isposinf(L_side))
            if empty.size and (row is None or empty.tolist() != [row]):
                mismatch.lines.append(f"rows where side {side} saw no key: {empty.tolist()}")
        raise


def _solution_merge_states(O_a, L_a, O_b, L_b):
    # An empty side (L = +inf) has softmax statistics (m, ℓ) = (−inf, 0); another one (L, 1).
    m_a = np.where(np.isposinf(L_a), -np.inf, L_a)
    m_b = np.where(np.isposinf(L_b), -np.inf, L_b)
    m = np.maximum(m_a, m_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)           # both sides empty: every weight is 0
    w_a, w_b = np.exp(m_a - m_safe), np.exp(m_b - m_safe)   # arguments <= 0: no overflow
    l = w_a + w_b
    l_safe = np.where(l == 0.0, 1.0, l)
    O = (w_a[:, None] * O_a + w_b[:, None] * O_b) / l_safe[:, None]
    with np.errstate(divide="ignore"):
        return O, np.where(l == 0.0, np.inf, m + np.log(l_safe))


# -- 14.1-14.3: the fragment layouts of mma.sync.m16n8k16, which the kernel exercises check against ------------
# The mma.sync.m16n8k16 layouts of the PTX ISA, written out here on their own (kernels_gpu.fragments has
# them too; tests check the two agree): lane l has g = l // 4, t = l % 4.

def _a_fragments(A: np.ndarray) -> np.ndarray:
    """A (16, 16) → (32, 8): a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, …]."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    parts = [A[g + row, 2 * t + col + half] for row, col in ((0, 0), (8, 0), (0, 8), (8, 8)) for half in (0, 1)]
    return np.stack(parts, axis=1)


def _c_fragments(C: np.ndarray) -> np.ndarray:
    """C (16, 8) → (32, 4): c0 = C[g, 2t], c1 = C[g, 2t+1], c2 = C[g+8, 2t], c3 = C[g+8, 2t+1]."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    return np.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]], axis=1)


def _b_fragments(B: np.ndarray) -> np.ndarray:
    """B (16, 8) → (32, 4): b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g] (element (k, n), consecutive k packed)."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    return np.stack([B[2 * t, g], B[2 * t + 1, g], B[2 * t + 8, g], B[2 * t + 9, g]], axis=1)


def _fragment_layout(operand: str) -> np.ndarray:
    """(32, n, 2): [lane, e] = (row, col) of element e of the lane's ``operand`` fragment ("A", "B" or "C")."""
    shape = (16, 16) if operand == "A" else (16, 8)
    where = np.arange(shape[0] * shape[1]).reshape(shape)
    flat = {"A": _a_fragments, "B": _b_fragments, "C": _c_fragments}[operand](where)
    return np.stack(np.divmod(flat, shape[1]), axis=-1)


# -- 15.1 the work of one ring step ----------------------------------------------------------------------------------

def _positions(N: int, rank: int, W: int, layout: str) -> np.ndarray:
    """The global positions a rank holds, in the order it stores them."""
    return np.concatenate([np.arange(a, b) for a, b in chunk_ranges(N, rank, W, layout)])


def _run_step_pairs(fn, case):
    W, c, layout = case["W"], case["c"], case["layout"]
    N = 2 * W * c                                   # both layouts can split it: 2W chunks of c tokens
    calls = _Calls(fn, "step_pairs")
    for rank in range(W):
        queries = _positions(N, rank, W, layout)
        for source in range(W):
            keys = _positions(N, source, W, layout)
            visible = keys[None, :] <= queries[:, None]      # ground truth: the causal mask on global positions
            expected = int(visible.sum())
            got = calls(("N", N), ("W", W), ("layout", layout), ("rank", rank), ("source", source),
                        where=f"rank {rank}, holding the K/V block of rank {source}")
            if _as_float(got, "a number of pairs", expected) != expected:
                raise _Mismatch([f"rank {rank} with the block of rank {source}: expected {expected} visible "
                                 f"pairs, got {_fmt(got)}",
                                 f"the rank's queries sit at positions {queries.tolist()}, the block's keys at "
                                 f"{keys.tolist()}; query i sees key j iff j ≤ i (■ visible, · masked):",
                                 *_picture(visible)], expected, got)


def _solution_step_pairs(N, W, layout, rank, source):
    def chunks(r):                     # the global token ranges rank r holds
        if layout == "contiguous":
            n = N // W
            return [(r * n, (r + 1) * n)]
        c = N // (2 * W)
        return [(r * c, (r + 1) * c), ((2 * W - 1 - r) * c, (2 * W - r) * c)]

    pairs = 0
    for q_a, q_b in chunks(rank):
        for k_a, k_b in chunks(source):
            for i in range(q_a, q_b):  # query i sees the keys of [k_a, k_b) at positions ≤ i
                pairs += min(max(i + 1 - k_a, 0), k_b - k_a)
    return pairs


# -- 16.1 the 128-byte swizzle -------------------------------------------------------------------------------------

def _swizzle_truth(row: int, col: int) -> int:
    """Byte offset of 16-bit element (row, col) of a panel of 64 columns stored with the 128-byte swizzle: the
    row's 16-byte chunk c lands at chunk c XOR (row mod 8) (PTX ISA, the shared-memory matrix layouts)."""
    return 128 * row + 16 * ((col // 8) ^ (row % 8)) + 2 * (col % 8)


def _run_swizzle(fn, case):
    rows = case["rows"]
    calls = _Calls(fn, "swizzled_offset")
    seen: dict[int, tuple] = {}
    for row in range(rows):
        for col in range(64):
            expected = _swizzle_truth(row, col)
            got = calls(("row", row), ("col", col), where=f"element ({row}, {col})")
            value = _as_float(got, "a byte offset", expected)
            if value != expected:
                raise _Mismatch([f"element ({row}, {col}): expected byte {expected} (row {row} starts at byte "
                                 f"{128 * row}; its chunk {col // 8} lands at chunk {(col // 8) ^ (row % 8)}), got "
                                 f"{_fmt(got)}"], expected, got)
            seen[int(value)] = (row, col)
    if len(seen) != 64 * rows:              # unreachable when every value matched; kept as the property itself
        raise _Mismatch([f"{64 * rows - len(seen)} elements share a byte offset with another"])


def _solution_swizzle(row, col):
    chunk = (col // 8) ^ (row % 8)      # the 16-byte chunk, moved by the row's rank
    return 128 * row + 16 * chunk + 2 * (col % 8)


# -- 16.2 a wgmma matrix descriptor ----------------------------------------------------------------------------------

_SWIZZLE_MODE = {"none": 0, "128B": 1, "64B": 2, "32B": 3}


def _descriptor_truth(start: int, lbo: int, sbo: int, swizzle: str) -> int:
    """The 64-bit shared-memory matrix descriptor of wgmma (PTX ISA 9.7.15.5.1.2.2): bits 0-13 the start address
    >> 4, 16-29 the leading-dimension byte offset >> 4, 32-45 the stride-dimension byte offset >> 4, 49-51 the
    base offset (0 for tiles aligned to the swizzle's pattern), 62-63 the swizzle mode."""
    return ((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32) \
        | (_SWIZZLE_MODE[swizzle] << 62)


def _run_descriptor(fn, case):
    rng = np.random.default_rng(case["seed"])
    calls = _Calls(fn, "wgmma_descriptor")
    for k in range(6):
        start = 16 * int(rng.integers(0, 1 << 14)) if k else 16 * ((1 << 14) - 1)
        lbo, sbo = 16 * int(rng.integers(0, 1 << 14)), 16 * int(rng.integers(0, 1 << 14))
        swizzle = case["swizzle"]
        expected = _descriptor_truth(start, lbo, sbo, swizzle)
        got = calls(("start", start), ("lbo", lbo), ("sbo", sbo), ("swizzle", swizzle))
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
            raise _Mismatch([f"expected an integer (the 64 bits of the descriptor), got {type(got).__name__} "
                             f"{got!r}" + (": a float holds only 53 bits exactly" if isinstance(got, float) else "")],
                            expected, got)
        value = int(got)
        if value != expected:
            diff = expected ^ value
            fields = [name for name, lo, hi in (("start", 0, 14), ("LBO", 16, 30), ("SBO", 32, 46),
                                                ("base offset", 49, 52), ("swizzle", 62, 64))
                      if diff & (((1 << (hi - lo)) - 1) << lo)]
            raise _Mismatch([f"expected {expected:#018x}, got {value:#018x}",
                             f"the fields that differ: {', '.join(fields) or 'bits outside every field'}"],
                            expected, got)


def _solution_descriptor(start, lbo, sbo, swizzle):
    mode = {"none": 0, "128B": 1, "64B": 2, "32B": 3}[swizzle]
    return (start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (mode << 62)


# -- 16.3 the ring of stages: which stage and which parity ------------------------------------------------------------

def _run_ring(fn, case):
    stages, tiles = case["stages"], case["tiles"]
    calls = _Calls(fn, "ring_step")
    # ground truth by running the protocol: each stage's mbarriers flip their phase every time they complete
    full_phase = [0] * stages
    empty_phase = [0] * stages
    for j in range(tiles):
        s = j % stages
        producer_waits = None if j < stages else empty_phase[s]     # the release of tile j - stages
        if j >= stages:
            empty_phase[s] ^= 1
        expected = (s, full_phase[s], producer_waits)
        full_phase[s] ^= 1
        got = calls(("j", j), ("stages", stages), where=f"tile {j}")
        if not isinstance(got, tuple) or len(got) != 3 or tuple(got) != expected:
            raise _Mismatch([f"tile {j} of a ring of {stages} stages: expected (stage, consumer's parity, "
                             f"producer's parity) = {expected}, got {got!r}",
                             "a barrier's phase flips each time it completes: stage s has completed its full "
                             "phase once for each earlier tile it held"], expected, got)


def _solution_ring(j, stages):
    stage, uses = j % stages, j // stages    # tile j is the stage's (uses + 1)-th tile
    producer = None if j < stages else (uses - 1) % 2
    return stage, uses % 2, producer


# -- 17.1-17.3 mods: a sliding window, packed causal documents, the soft cap's derivative ----------------------

def _as_keep(got, where: str) -> bool:
    """A mask_mod's answer for one element: a bool (Python's or NumPy's), as fa2edu.flex and PyTorch require."""
    if isinstance(got, (bool, np.bool_)) or (isinstance(got, np.ndarray) and got.shape == ()
                                                and got.dtype == np.bool_):
        return bool(got)
    raise _Mismatch([f"{where}: your mask_mod returned {type(got).__name__} {_short_repr(got)}; a mask_mod must "
                     "return a bool (True = keep the score), as fa2edu.flex.create_block_mask requires"],
                    got=got, kind="type")


def _mod_of(factory_calls: _Calls, named: tuple, role: str, signature: str) -> _Calls:
    """The mod the reader's factory returns (a ``role``: mask_mod, score_mod_grad), to be called element by
    element."""
    mod = factory_calls(*named)
    if not callable(mod):
        raise _Mismatch([f"your function returned {type(mod).__name__} {_short_repr(mod)}; expected a function, "
                         f"{role}{signature}"], got=mod, kind="type")
    return _Calls(mod, f"the {role} it returned")


def _keep_grid(mod_calls: _Calls, N_q: int, N_k: int, b_h: tuple, extra: tuple = ()) -> np.ndarray:
    """The reader's mask_mod at every (q_idx, kv_idx), with Python ints; b and h are drawn per case (the masks of
    17.1 and 17.2 ignore them)."""
    got = np.zeros((N_q, N_k), dtype=bool)
    b, h = b_h
    for i in range(N_q):
        for j in range(N_k):
            where = f"q_idx = {i}, kv_idx = {j}"
            value = mod_calls(("b", b), ("h", h), ("q_idx", i), ("kv_idx", j), *extra, where=where)
            got[i, j] = _as_keep(value, where)
    return got


def _compare_keep(mod_calls: _Calls, got: np.ndarray, expected: np.ndarray, describe: Callable, b_h: tuple,
                  extra: tuple = ()) -> None:
    """A mismatch at the first wrong (query, key), with both masks drawn; the failing call is that element's."""
    wrong = got != expected
    if not wrong.any():
        return
    i, j = (int(v) for v in np.argwhere(wrong)[0])
    mod_calls(("b", b_h[0]), ("h", b_h[1]), ("q_idx", i), ("kv_idx", j), *extra,
              where=f"q_idx = {i}, kv_idx = {j}")               # the call the report shows
    lines = [f"query {i}, key {j}: expected {'kept' if expected[i, j] else 'masked'}, got "
             f"{'kept' if got[i, j] else 'masked'} (entries wrong: {int(wrong.sum())} of {wrong.size})",
             *describe(i, j)]
    if _picture(expected):
        lines += ["expected (■ kept, · masked):", *_picture(expected), "got:", *_picture(got)]
    raise _Mismatch(lines, expected, got)


def _window_truth(N_q: int, N_k: int, w: int) -> np.ndarray:
    """Ground truth of 17.1, row by row: query i sits at key position p = i + N_k − N_q and keeps the keys
    p − w + 1 … p that exist (fa2edu.flex.sliding_window's definition, bottom-right aligned)."""
    keep = np.zeros((N_q, N_k), dtype=bool)
    for i in range(N_q):
        p = i + N_k - N_q
        keep[i, max(p - w + 1, 0):max(p + 1, 0)] = True
    return keep


def _run_sliding_window(fn, case):
    N_q, N_k, w = case["N_q"], case["N_k"], case["w"]
    offset = N_k - N_q
    rng = np.random.default_rng(case["seed"])
    mod = _mod_of(_Calls(fn, "sliding_window_mask"), (("w", w), ("offset", offset)), "mask_mod",
                  "(b, h, q_idx, kv_idx) -> bool")
    b_h = (int(rng.integers(0, 3)), int(rng.integers(0, 4)))
    got = _keep_grid(mod, N_q, N_k, b_h)

    def describe(i, j):
        p = i + offset
        window = (f"its window is the w = {w} keys p − w + 1 … p = {p - w + 1} … {p}, those that exist" if p >= 0
                  else "no key sits at or before it: the row is fully masked")
        return [f"query {i} sits at key position p = i + N_k − N_q = {p}; {window}"]
    _compare_keep(mod, got, _window_truth(N_q, N_k, w), describe, b_h)


def _solution_sliding_window(w, offset):
    def mask_mod(b, h, q_idx, kv_idx):
        p = q_idx + offset                  # the query's key position (bottom-right aligned)
        return (kv_idx <= p) & (kv_idx > p - w)   # the w keys p - w + 1 ... p
    return mask_mod


def _packed_ids(rng: np.random.Generator, N: int, docs: str) -> np.ndarray:
    """Document ids of N packed positions: one document, single-token documents, random lengths, or random lengths
    with a padded tail (id −1)."""
    if docs == "one":
        return np.zeros(N, dtype=np.int64)
    if docs == "singles":
        return np.arange(N, dtype=np.int64)
    ids = np.concatenate([[0], np.cumsum(rng.random(N - 1) < 0.35)]).astype(np.int64)
    if docs == "padded":
        pad = max(1, int(rng.integers(1, N // 3 + 2)))
        ids[N - min(pad, N):] = -1
    return ids


def _documents_truth(q_ids: np.ndarray, kv_ids: np.ndarray) -> np.ndarray:
    """Ground truth of 17.2, document by document: the queries and keys of each real document (id ≠ −1) see each
    other, then the causal mask (fa2edu.masks.causal_mask, bottom-right) removes the future."""
    keep = np.zeros((len(q_ids), len(kv_ids)), dtype=bool)
    for doc in set(kv_ids.tolist()) - {-1}:
        keep[np.ix_(q_ids == doc, kv_ids == doc)] = True
    return keep & causal_mask(len(q_ids), len(kv_ids))


def _run_documents(fn, case):
    N_q, N_k = case["N_q"], case["N_k"]
    rng = np.random.default_rng(case["seed"])
    kv_ids = _packed_ids(rng, N_k, case["docs"])
    q_ids = kv_ids[N_k - N_q:].copy()                  # the queries are the last N_q positions
    extra = (("q_ids", q_ids), ("kv_ids", kv_ids))
    mod = _Calls(fn, "document_causal")
    b_h = (int(rng.integers(0, 3)), int(rng.integers(0, 4)))
    got = _keep_grid(mod, N_q, N_k, b_h, extra)

    def describe(i, j):
        def doc(x):
            return "padding (id −1, in no document)" if x == -1 else f"document {x}"
        return [f"query {i} is in {doc(q_ids[i])} and sits at key position p = i + N_k − N_q = "
                f"{i + N_k - N_q}; key {j} is in {doc(kv_ids[j])}"]
    _compare_keep(mod, got, _documents_truth(q_ids, kv_ids), describe, b_h, extra)


def _solution_documents(b, h, q_idx, kv_idx, q_ids, kv_ids):
    p = q_idx + len(kv_ids) - len(q_ids)    # the query's key position, bottom-right aligned
    same = q_ids[q_idx] == kv_ids[kv_idx]
    return (kv_idx <= p) & same & (q_ids[q_idx] != -1)


def _softcap_derivative_truth(score: np.ndarray, c: float) -> np.ndarray:
    """d/dscore of c·tanh(score/c) = sech²(score/c), written with cosh (1/inf = 0 where cosh overflows)."""
    with np.errstate(over="ignore"):
        return 1.0 / np.cosh(score / c) ** 2


def _run_softcap_grad(fn, case):
    rng = np.random.default_rng(case["seed"])
    c = case["c"]
    scores = _logits(rng, (case["n"],), case["scores"])
    expected = _softcap_derivative_truth(scores, c)
    grad = _mod_of(_Calls(fn, "softcap_grad"), (("c", c),), "score_mod_grad", "(score, b, h, q_idx, kv_idx)")
    got = np.empty_like(scores)
    for k, s in enumerate(scores):
        b, h, i, j = (int(v) for v in rng.integers(0, 8, size=4))
        value = grad(("score", float(s)), ("b", b), ("h", h), ("q_idx", i), ("kv_idx", j), where=f"score {s:.6g}")
        got[k] = _as_float(value, "a number (the derivative at score)", expected[k])
    err = np.abs(got - expected)
    bad = np.isnan(got) | (err > 1e-9 + 1e-9 * np.abs(expected))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        s, step = float(scores[k]), 1e-5 * max(1.0, abs(float(scores[k])))
        central = (c * np.tanh((s + step) / c) - c * np.tanh((s - step) / c)) / (2 * step)
        kind = "nan" if np.isnan(got[k]) else "value"
        raise _Mismatch([f"score = {s:.6g}, c = {c:g}: expected d/dscore c·tanh(score/c) = {_fmt(expected[k])}, "
                         f"got {_fmt(got[k])} (scores off: {int(bad.sum())} of {len(scores)}"
                         + (", NaN" if kind == "nan" else "") + ")",
                         f"a central difference of c·tanh(score/c) at that score gives {_fmt(central)}"],
                        expected, got, kind=kind)


def _solution_softcap_grad(c):
    def score_mod_grad(score, b, h, q_idx, kv_idx):
        t = np.tanh(score / c)        # d/ds c·tanh(s/c) = c · (1/c) · (1 − tanh²(s/c))
        return 1.0 - t * t            # tanh saturates at ±1: 0 far out, never NaN
    return score_mod_grad


# -- 18.1 a tile to e4m3 with one scale per block of rows; 18.2 the random Hadamard rotation ------------------------

def _fp8_tile(rng: np.random.Generator, N: int, d: int, values: str, block: int) -> np.ndarray:
    """A float32 tile (N, d) of the given kind: N(0, 1); channel outliers (a quarter of the channels ×100); all
    negative (the largest magnitude is a negative number); a block of zero rows (the second, or the only one);
    a spread of magnitudes over twenty binades (e4m3's subnormals, and zeros, inside each block)."""
    x = rng.standard_normal((N, d))
    if values == "outliers":
        x[:, rng.choice(d, size=max(1, d // 4), replace=False)] *= 100.0
    elif values == "negative":
        x = -np.abs(x)
    elif values == "zeros":
        first = block if N > block else 0
        x[first:first + block] = 0.0
    elif values == "spread":
        x = x * np.exp2(rng.uniform(-20.0, 0.0, size=(N, d)))
    return x.astype(np.float32)


def _run_quantize_tile(fn, case):
    N, d, block = case["N"], case["d"], case["block"]
    x = _fp8_tile(np.random.default_rng(case["seed"]), N, d, case["values"], block)
    truth = fp8.quantize_fp8(x, block=block)                  # fa2edu.fp8's emulation: the codes bit for bit
    codes, descale = _unpack(_Calls(fn, "quantize_tile")(("x", x), ("block", block)), 2, "(codes, descale)")
    n_blocks = truth.descale.shape[0]
    got_d = _as_numbers("descale", descale, truth.descale).reshape(-1)
    if got_d.shape != (n_blocks,):
        raise _Mismatch([f"descale: {_count(got_d.size, 'value', 'values')}; expected {n_blocks}, one per block "
                         f"of {block} rows (N = {N}: ceil(N / block) = {n_blocks}, the last block "
                         + ("ragged)" if N % block else "whole)")], truth.descale, got_d, kind="descale shape")
    wrong = np.flatnonzero(got_d.astype(np.float32) != truth.descale)
    if wrong.size:
        b = int(wrong[0])
        rows = slice(b * block, min(N, (b + 1) * block))
        amax = float(np.abs(x[rows]).max())
        lines = [f"descale[{b}] (rows {rows.start}…{rows.stop - 1}): expected {_fmt(truth.descale[b])}, got "
                 f"{_fmt(got_d[b])} ({_count(wrong.size, 'block', 'blocks')} of {n_blocks} off)"]
        if amax == 0.0:
            lines.append("that block is all zeros: its descale must be 1 (amax / 448 = 0, and 0 / 0 is NaN)")
        elif got_d[b] < 0:
            lines.append(f"a descale is amax(|x|) / 448 over the block: of |x|, not of x (amax(|x|) = {amax:.6g})")
        else:
            lines.append(f"amax(|x|) of the block is {amax:.6g}; the descale maps it to e4m3's largest value, 448")
        raise _Mismatch(lines, truth.descale, got_d, kind="descale")
    got_c = np.asarray(codes)
    if got_c.dtype.kind not in "iu":
        raise _Mismatch([f"codes: dtype {got_c.dtype}; expected uint8, the e4m3 bit patterns "
                         "(fa2edu.fp8.to_bits gives them; fa2edu.fp8.round_to_fp8 gives their values)"],
                        truth.codes, got_c, kind="codes dtype")
    if got_c.shape != truth.codes.shape:
        raise _Mismatch([f"codes: wrong shape {got_c.shape}; expected {truth.codes.shape}"], truth.codes, got_c,
                        kind="codes shape")
    bad = got_c != truth.codes
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        e, g = int(truth.codes[i, j]), int(got_c[i, j])
        value = float(fp8.from_bits(np.uint8(e)))
        raise _at(_Mismatch([f"codes[{i}, {j}]: expected {e:#04x} (e4m3 {value:.6g}, from x / descale = "
                             f"{float(x[i, j]) / float(truth.descale[i // block]):.6g}), got {g:#04x} (e4m3 "
                             f"{float(fp8.from_bits(np.uint8(g))):.6g}); {int(bad.sum())} of {bad.size} codes "
                             "differ"], truth.codes, got_c, kind="codes"), (i, j))


def _solution_quantize_tile(x, block):
    N = x.shape[0]
    starts = np.arange(0, N, block)                  # the first row of each block
    amax = np.maximum.reduceat(np.abs(x).max(axis=1), starts)
    descale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)   # a zero block: 1
    rows = np.repeat(descale, block)[:N].astype(np.float64)   # each row's δ
    codes = fp8.to_bits(x / rows[:, None], "e4m3")  # nearest even, saturating
    return codes, descale


def _run_rotation(fn, case):
    d = case["d"]
    signs = np.random.default_rng(case["seed"]).choice([-1.0, 1.0], size=d)
    signs[0] = -1.0                                      # both signs occur whenever d ≥ 2
    signs[-1] = 1.0 if d > 1 else -1.0
    H = fp8.hadamard_matrix(d)
    expected = signs[:, None] * H / math.sqrt(d)         # fa2edu.fp8.rotation_matrix's D·H/√d, these signs
    M = _as_numbers("M", _Calls(fn, "rotation_matrix")(("signs", signs)), expected)
    if M.shape != (d, d):
        raise _Mismatch([f"M: wrong shape {M.shape}; expected ({d}, {d})"], expected, M, kind="shape")
    if np.isnan(M).any():
        raise _Mismatch([f"M: NaN in {int(np.isnan(M).sum())} of {M.size} entries"], expected, M, kind="nan")
    gram = M @ M.T
    if not np.allclose(gram, np.eye(d), rtol=0, atol=1e-12):
        c = float(np.trace(gram)) / d
        lines = [f"M is not orthogonal: max |M·Mᵀ − I| = {np.abs(gram - np.eye(d)).max():.3g}"]
        if np.allclose(gram, c * np.eye(d), rtol=1e-9, atol=1e-12):
            lines.append(f"M·Mᵀ = {c:.6g}·I, not I: each row of H_d has length √d = {math.sqrt(d):.6g}, so "
                         "divide H by √d")
        lines.append("only an orthogonal M keeps (QM)(KM)ᵀ = QMMᵀKᵀ equal to QKᵀ")
        raise _Mismatch(lines, expected, M, kind="orthogonal")
    if np.allclose(M, expected, rtol=0, atol=1e-12):
        return
    if np.allclose(M, H * signs[None, :] / math.sqrt(d), rtol=0, atol=1e-12):
        lines = ["your M is H·diag(signs)/√d: the signs act after H, on the output, so they flip signs without "
                 "changing any magnitude — |x·M| would be the same for every seed, and an outlier pattern that H "
                 "maps badly stays bad. Put them first: M = diag(signs)·H/√d (row i of H times signs[i])"]
    elif np.allclose(M, H / math.sqrt(d), rtol=0, atol=1e-12):
        lines = ["your M is H/√d: orthogonal, but the random signs are missing (M = diag(signs)·H/√d)"]
    else:
        i, j = np.unravel_index(int(np.argmax(np.abs(M - expected))), M.shape)
        lines = [f"M[{i}, {j}]: expected {_fmt(expected[i, j])} = signs[{i}]·H[{i}, {j}]/√d, got {_fmt(M[i, j])}",
                 "H is Sylvester's: H_1 = [1], H_2d = [[H_d, H_d], [H_d, −H_d]] (the matrix fa2edu.fp8.fwht "
                 "applies)"]
    raise _Mismatch(lines, expected, M, kind="value")


def _solution_rotation(signs):
    d = len(signs)
    H = np.ones((1, 1))
    while H.shape[0] < d:                    # Sylvester: H_2d = [[H, H], [H, −H]]
        H = np.block([[H, H], [H, -H]])
    return signs[:, None] * H / np.sqrt(d)   # diag(signs)·H/√d: orthogonal, signs first


# -- the catalogue -------------------------------------------------------------------------------------------------

_ALL_LOGITS = Kind(("normal", "rising", "large"))
_MASKS = Kind(("none", "causal", "random"))

_EXERCISES = [
    Exercise(
        id="1.3",
        title="standard attention's HBM reads and writes (FA1 Algorithm 0) for N_q queries, N_k keys",
        signature="standard_io(N_q, N_k, d) -> (reads, writes), in elements",
        hint="Go through Algorithm 0 line by line and write down, for each line, which matrices it reads from HBM "
             "and which it writes, with their shapes: Q is N_q × d, K and V are N_k × d, S and P are N_q × N_k. "
             "A matrix that one line writes and the next line reads is counted twice.",
        covers="N_q ≠ N_k both ways, sizes of 1, against the executed ledger of fa2edu.standard_attention",
        params={"N_q": Size(1, 40), "N_k": Size(1, 40), "d": Size(1, 16)},
        base={"N_q": 1, "N_k": 1, "d": 1},
        edge_cases=({}, {"N_q": 5, "N_k": 5, "d": 3}, {"N_q": 3, "N_k": 8, "d": 2}, {"N_q": 8, "N_k": 3, "d": 4},
                    {"N_q": 17, "N_k": 10, "d": 7}),
        n_random=15, run=_run_standard_io, solution=_solution_standard_io),
    Exercise(
        id="2.2",
        title="the (m, ℓ) merge of two blocks' softmax statistics (FA1 §3.1)",
        signature="merge(a, b) -> (m, l); a, b are Stats(m, l) with m, l of shape (rows,)",
        hint="The merged maximum is the larger of the two. Each side's ℓ was summed against its own maximum: "
             "multiply it by e^(its max − the merged max) before adding. Then think about a row where a side saw "
             "no key at all: its (m, ℓ) is (−inf, 0). What is −inf − (−inf)?",
        covers="blocks of different widths, one side or both sides empty (m = −inf, ℓ = 0) for some rows or all, "
               "logits ×20 and ×10⁴, against the statistics of the concatenated row",
        params={"rows": Size(1, 6), "n_a": Size(1, 9), "n_b": Size(1, 9),
                "empty": Kind(("none", "rows", "a", "b", "both")), "logits": Kind(("normal", "spread", "large"))},
        base={"rows": 1, "n_a": 1, "n_b": 1, "empty": "none", "logits": "normal"},
        edge_cases=({}, {"rows": 3, "n_a": 4, "n_b": 7}, {"rows": 1, "empty": "both"},
                    {"rows": 2, "n_a": 3, "n_b": 2, "empty": "a"}, {"rows": 2, "n_a": 2, "n_b": 3, "empty": "b"},
                    {"rows": 3, "n_a": 3, "n_b": 3, "empty": "rows"}, {"rows": 2, "n_a": 5, "n_b": 4,
                                                                      "logits": "large"}),
        n_random=25, run=_run_merge, solution=_solution_merge),
    Exercise(
        id="2.3",
        title="online softmax: one streaming pass for (m, ℓ), then a normalising pass",
        signature="online_softmax(x, block) -> p, the softmax of each row of x (rows, n), reading blocks of columns",
        hint="Keep a running maximum m and a running sum ℓ per row, starting from (−inf, 0). For each block, the "
             "new maximum is max(m, rowmax(block)); the old ℓ must be multiplied by e^(m_old − m_new) before the "
             "block's terms are added. A row whose entries are all −inf needs a guard, twice: in the exponent and "
             "in the final division.",
        covers="blocks of 1, blocks that do not divide n, a block wider than the row, rows whose maximum keeps "
               "rising, −inf entries, fully masked rows (p = 0), rows whose first block is all −inf, logits ×10⁴ "
               "and ×10⁻¹², against fa2edu.softmax.safe_softmax",
        params={"rows": Size(1, 5), "n": Size(1, 40), "block": Size(1, 48),
                "masked": Kind(("none", "entries", "rows", "first block")),
                "logits": Kind(("normal", "rising", "large", "tiny"))},
        base={"rows": 1, "n": 1, "block": 1, "masked": "none", "logits": "normal"},
        edge_cases=({}, {"rows": 2, "n": 5, "block": 2, "logits": "rising"}, {"rows": 3, "n": 7, "block": 10},
                    {"rows": 2, "n": 9, "block": 4, "masked": "rows"},
                    {"rows": 3, "n": 12, "block": 5, "masked": "first block"},
                    {"rows": 2, "n": 6, "block": 3, "logits": "large"},
                    {"rows": 2, "n": 6, "block": 3, "logits": "tiny"}),
        n_random=30, run=_run_online_softmax, solution=_solution_online_softmax),
    Exercise(
        id="3.3",
        title="FA1 Algorithm 1 lines 10-12: one tile's update of a row block's normalised (O, ℓ, m)",
        signature="fa1_update(O, l, m, S_ij, V_j) -> (O, l, m); shapes (B_r, d_v), (B_r,), (B_r,), (B_r, B_c), "
                  "(B_c, d_v)",
        hint="Compute the tile's own statistics first (line 10: m̃, P̃ = e^(S_ij − m̃), ℓ̃), merge them with (m, ℓ) "
             "(line 11), then line 12: O is normalised, so undo its old normaliser (multiply by ℓ), move it to the "
             "new maximum, add e^(m̃ − m_new) P̃ V_j and divide by the new ℓ. Rows that have seen no key yet have "
             "m = −inf and ℓ = 0: guard the exponent and the division.",
        covers="tiles that do not divide N_k, a tile wider than N_k, rows whose maximum keeps rising, causal "
               "masks with N_q > N_k and N_q < N_k (bottom-right), fully masked rows and fully masked tiles, a row "
               "whose first tile is all −inf, logits ×10⁴; (m, ℓ, O) checked after every tile",
        params={"N_q": Size(1, 10), "N_k": Size(1, 24), "d_v": Size(1, 5), "B_c": Size(1, 30), "mask": _MASKS,
                "logits": _ALL_LOGITS},
        base={"N_q": 1, "N_k": 1, "d_v": 1, "B_c": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_q": 3, "N_k": 7, "d_v": 2, "B_c": 3, "logits": "rising"}, {"N_q": 2, "N_k": 5, "B_c": 8},
                    {"N_q": 6, "N_k": 4, "d_v": 3, "B_c": 3, "mask": "causal"},
                    {"N_q": 4, "N_k": 9, "d_v": 2, "B_c": 4, "mask": "causal"},
                    {"N_q": 5, "N_k": 10, "d_v": 2, "B_c": 3, "mask": "random"},
                    {"N_q": 3, "N_k": 8, "d_v": 2, "B_c": 3, "logits": "large"}),
        n_random=30, run=lambda fn, case: _run_tile_updates(fn, case, unscaled=False), solution=_solution_fa1_update),
    Exercise(
        id="4.3",
        title="FA1 forward's HBM reads and writes from N, d and M (FA1's block rule, ragged N)",
        signature="flash1_forward_io(N, d, M) -> (reads, writes), in elements per (batch, head)",
        hint="FA1's rule (Algorithm 1 line 1) gives B_c = ceil(M / 4d), and there are T_c = ceil(N / B_c) column "
             "blocks (the last one may be short). K and V are read once in all; every outer step reads and writes "
             "O, ℓ and m for all N rows, and reads Q.",
        covers="N smaller than one block, blocks of 1, ragged last blocks, M = 4d, against the executed ledger "
               "(fa2edu.simulate_io(..., method='execute'))",
        params={"N": Size(1, 200), "d": Size(1, 24), "M": Size(4, 3000)},
        base={"N": 1, "d": 1, "M": 4},
        edge_cases=({}, {"N": 10, "d": 2, "M": 8}, {"N": 7, "d": 3, "M": 200}, {"N": 100, "d": 8, "M": 1000},
                    {"N": 150, "d": 16, "M": 700}, {"N": 64, "d": 4, "M": 64}),
        n_random=15, run=_run_flash1_io, solution=_solution_flash1_io, valid=_valid_flash1_io, shrink_budget=120),
    Exercise(
        id="5.1",
        title="the softmax backward: dS = P ∘ (dP − D) from P and dP, one row at a time",
        signature="softmax_backward(P, dP) -> dS; all of shape (N_q, N_k), P's rows softmax probabilities",
        hint="Write the Jacobian of one row's softmax, diag(p) − p pᵀ, and multiply it by dp. Expand the product: "
             "one term is p ∘ dp, the other is p times a scalar per row. Which scalar?",
        covers="N_q ≠ N_k, single rows and columns, causal and random masks with fully masked rows (P = 0, "
               "dS = 0), near one-hot rows (logits ×10⁴), against the explicit Jacobian",
        params={"N_q": Size(1, 8), "N_k": Size(1, 12), "mask": _MASKS, "logits": Kind(("normal", "large"))},
        base={"N_q": 1, "N_k": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_k": 2}, {"N_q": 3, "N_k": 5, "mask": "causal"}, {"N_q": 5, "N_k": 3, "mask": "causal"},
                    {"N_q": 4, "N_k": 6, "mask": "random"}, {"N_q": 3, "N_k": 4, "logits": "large"}),
        n_random=25, run=_run_softmax_backward, solution=_solution_softmax_backward),
    Exercise(
        id="6.2",
        title="FA2 Algorithm 1 lines 9-10: one tile's update of a row block's un-scaled (Õ, ℓ, m)",
        signature="fa2_update(O_tilde, l, m, S_ij, V_j) -> (O_tilde, l, m); shapes (B_r, d_v), (B_r,), (B_r,), "
                  "(B_r, B_c), (B_c, d_v)",
        hint="Line 9: the new maximum is max(m, rowmax(S_ij)); P̃ = e^(S_ij − m_new); ℓ_new = e^(m − m_new) ℓ + "
             "rowsum(P̃). Line 10: the old accumulator is scaled *down* by the same factor e^(m − m_new) (the "
             "paper prints an inverse: erratum 4) before P̃ V_j is added. Õ is never divided by ℓ here. Rows with "
             "m = −inf (no key seen yet) need a guard.",
        covers="tiles that do not divide N_k, a tile wider than N_k, rows whose maximum keeps rising, causal "
               "masks with N_q > N_k and N_q < N_k (bottom-right), fully masked rows (O = 0, L = +inf) and fully "
               "masked tiles, a row whose first tile is all −inf, logits ×10⁴; (m, ℓ, Õ) checked after every tile, "
               "then O = Õ/ℓ and L = m + log ℓ against the float64 oracle",
        params={"N_q": Size(1, 10), "N_k": Size(1, 24), "d_v": Size(1, 5), "B_c": Size(1, 30), "mask": _MASKS,
                "logits": _ALL_LOGITS},
        base={"N_q": 1, "N_k": 1, "d_v": 1, "B_c": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_q": 3, "N_k": 7, "d_v": 2, "B_c": 3, "logits": "rising"}, {"N_q": 2, "N_k": 5, "B_c": 8},
                    {"N_q": 6, "N_k": 4, "d_v": 3, "B_c": 3, "mask": "causal"},
                    {"N_q": 4, "N_k": 9, "d_v": 2, "B_c": 4, "mask": "causal"},
                    {"N_q": 5, "N_k": 10, "d_v": 2, "B_c": 3, "mask": "random"},
                    {"N_q": 3, "N_k": 8, "d_v": 2, "B_c": 3, "logits": "large"}),
        n_random=30, run=lambda fn, case: _run_tile_updates(fn, case, unscaled=True), solution=_solution_fa2_update),
    Exercise(
        id="7.4",
        title="split-K: merge W warps' partial (m, ℓ, Õ) of one tile into the block's",
        signature="merge_partials(m, l, O_tilde) -> (m, l, O_tilde); in: (W, r), (W, r), (W, r, d_v), each "
                  "warp's partial against its own maximum; out: (r,), (r,), (r, d_v)",
        hint="This is chapter 2's (m, ℓ) merge, W-way, with Õ along for the ride: take the maximum over the warps, "
             "then rescale every warp's ℓ and Õ by e^(its m − the merged m) and sum. A warp with no column of the "
             "tile, or whose columns are all masked for a row, has m = −inf, ℓ = 0, Õ = 0; a row can be empty "
             "for every warp.",
        covers="1 to 8 warps, more warps than columns (empty warps), causal tiles with fully masked rows, random "
               "masks, logits ×20 and ×10⁴, against the statistics and Õ of the whole tile",
        params={"r": Size(1, 8), "c": Size(1, 20), "W": Size(1, 8), "d_v": Size(1, 4), "mask": _MASKS,
                "logits": Kind(("normal", "spread", "large"))},
        base={"r": 1, "c": 1, "W": 1, "d_v": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"r": 3, "c": 7, "W": 4, "d_v": 2, "logits": "spread"}, {"r": 2, "c": 3, "W": 5},
                    {"r": 5, "c": 3, "W": 2, "d_v": 2, "mask": "causal"},
                    {"r": 4, "c": 9, "W": 3, "d_v": 2, "mask": "random"},
                    {"r": 3, "c": 8, "W": 4, "d_v": 2, "logits": "large"}),
        n_random=30, run=_run_merge_warps, solution=_solution_merge_warps),
    Exercise(
        id="8.1",
        title="causal block classification, bottom-right aligned: skip, mask or plain",
        signature="block_kind(N_q, N_k, rows, cols) -> 'skip' | 'mask' | 'plain'; rows, cols are slices of S",
        hint="Query i sees key j iff j ≤ i + N_k − N_q. A tile is skipped when even its most visible entry (its "
             "largest row, smallest column) is masked, and plain when even its least visible entry (smallest row, "
             "largest column) is visible. The last row of a tile is rows.stop − 1.",
        covers="every tile of each grid: N_q = N_k, N_q < N_k, N_q > N_k (rows that see nothing), tiles that do "
               "not divide N, tiles larger than N, B_r ≠ B_c, against the element-wise causal mask",
        params={"N_q": Size(1, 40), "N_k": Size(1, 40), "B_r": Size(1, 48), "B_c": Size(1, 48)},
        base={"N_q": 1, "N_k": 1, "B_r": 1, "B_c": 1},
        edge_cases=({}, {"N_q": 8, "N_k": 8, "B_r": 4, "B_c": 4}, {"N_q": 10, "N_k": 10, "B_r": 4, "B_c": 3},
                    {"N_q": 6, "N_k": 10, "B_r": 4, "B_c": 4}, {"N_q": 10, "N_k": 6, "B_r": 4, "B_c": 4},
                    {"N_q": 5, "N_k": 7, "B_r": 8, "B_c": 8}, {"N_q": 9, "N_k": 13, "B_r": 2, "B_c": 5}),
        n_random=40, run=_run_block_kind, solution=_solution_block_kind),
    Exercise(
        id="9.2",
        title="a numba.cuda kernel: one thread per row computes the row's (m, ℓ) in one pass",
        signature="@cuda.jit row_stats(S, m, l); S (rows, cols) float32, m and l (rows,); launched as "
                  "row_stats[ceil(rows / threads), threads](S, m, l)",
        hint="Thread i = cuda.grid(1) owns row i; the grid has more threads than rows, so the extra ones must "
             "return before touching S. Keep m_i and l_i in local variables (registers), update them entry by "
             "entry as online softmax does (chapter 2), and write them once. A −inf entry contributes nothing; "
             "a row of −inf ends with m = −inf, ℓ = 0. Read each S[i, j] once: that is the budget.",
        covers="grids with idle threads (rows not a multiple of the block), one-thread blocks, masked entries, "
               "fully masked rows, rising maxima, logits ×10⁴, in float32 in numba's CUDA simulator, with the "
               "kernel's global-memory reads and writes counted",
        params={"rows": Size(1, 9), "cols": Size(1, 10), "threads": Size(1, 4),
                "masked": Kind(("none", "entries", "rows")), "logits": _ALL_LOGITS},
        base={"rows": 1, "cols": 1, "threads": 1, "masked": "none", "logits": "normal"},
        edge_cases=({}, {"rows": 5, "cols": 6, "threads": 4, "logits": "rising"},
                    {"rows": 3, "cols": 4, "threads": 2, "masked": "rows"},
                    {"rows": 4, "cols": 5, "threads": 3, "masked": "entries"},
                    {"rows": 3, "cols": 4, "threads": 4, "logits": "large"}),
        n_random=7, run=_kernel_run("row_stats"), solution=_kernel_solution("row_stats"), shrink_budget=40,
        solution_is_factory=True, kernel=True,
        budget="the budget reads each S[i, j] once and writes each m[i] and l[i] once"),
    Exercise(
        id="9.3",
        title="a device function: one row's online-softmax update over one block of keys (FA2 Alg. 1 lines 8-10)",
        signature="@cuda.jit(device=True) online_update(S, V, i, j0, j1, s, o, ml); updates row i's registers o "
                  "(Õ, d_v entries) and ml = (m, ℓ) with the keys j0 … j1 − 1; S (N_q, N_k), V (N_k, d_v) in "
                  "global memory; s: registers for at least j1 − j0 scores",
        hint="Read S[i, j0:j1] once into s, and find the block's maximum as you go: m_new = max(m, that). Then "
             "α = e^(m − m_new) rescales both ℓ and every o[c] (FA2's Õ, never divided here), and each key adds "
             "p = e^(s − m_new) to ℓ and p · V[j, c] to o[c]. A row whose keys so far are all −inf keeps "
             "m = −inf: return before computing −inf − (−inf).",
        covers="key blocks that do not divide N_k, a block wider than N_k, rows whose maximum keeps rising, causal "
               "masks with N_q > N_k and N_q < N_k (bottom-right), fully masked rows and blocks, logits ×10⁴; "
               "(m, ℓ, Õ) checked after every block, the reads of S and V counted",
        params={"N_q": Size(1, 6), "N_k": Size(1, 10), "d_v": Size(1, 3), "B_c": Size(1, 6), "mask": _MASKS,
                "logits": _ALL_LOGITS},
        base={"N_q": 1, "N_k": 1, "d_v": 1, "B_c": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_q": 3, "N_k": 7, "d_v": 2, "B_c": 3, "logits": "rising"}, {"N_q": 2, "N_k": 4, "B_c": 6},
                    {"N_q": 6, "N_k": 4, "d_v": 2, "B_c": 3, "mask": "causal"},
                    {"N_q": 3, "N_k": 8, "d_v": 2, "B_c": 3, "mask": "causal"},
                    {"N_q": 5, "N_k": 9, "d_v": 2, "B_c": 4, "mask": "random"},
                    {"N_q": 3, "N_k": 7, "d_v": 2, "B_c": 3, "logits": "large"}),
        n_random=8, run=_kernel_run("online_update"), solution=_kernel_solution("online_update"), shrink_budget=60,
        solution_is_factory=True, kernel=True,
        budget="the budget reads each S[i, j] once and each V[j, c] once per row, and writes nothing (o and ml "
               "are registers)"),
    Exercise(
        id="9.4",
        title="a device function: the causal tile test, skip / mask / plain from a tile's corners",
        signature="@cuda.jit(device=True) tile_kind(row0, row1, col0, col1, N_q, N_k) -> SKIP, MASK or PLAIN "
                  "(exercises.SKIP, MASK, PLAIN = 0, 1, 2) for query rows row0 … row1 − 1 and keys col0 … "
                  "col1 − 1, bottom-right causal",
        hint="Query i sees key j iff j ≤ i + N_k − N_q. The tile's most visible entry is its bottom-left corner "
             "(row row1 − 1, key col0): if even that one is masked, SKIP. Its least visible entry is the top-right "
             "corner (row row0, key col1 − 1): if even that one is visible, PLAIN. Otherwise MASK.",
        covers="every tile of each grid: N_q = N_k, N_q < N_k, N_q > N_k (rows that see nothing), tiles that do "
               "not divide N, B_r ≠ B_c, against the float64 oracle with the causal mask; the reads counted, "
               "so a tile that should be skipped and is not costs its S and V",
        params={"N_q": Size(1, 9), "N_k": Size(1, 9), "B_r": Size(1, 4), "B_c": Size(1, 4)},
        base={"N_q": 1, "N_k": 1, "B_r": 1, "B_c": 1},
        edge_cases=({}, {"N_q": 4, "N_k": 4, "B_r": 2, "B_c": 2}, {"N_q": 6, "N_k": 6, "B_r": 3, "B_c": 2},
                    {"N_q": 4, "N_k": 7, "B_r": 2, "B_c": 3}, {"N_q": 7, "N_k": 4, "B_r": 3, "B_c": 2},
                    {"N_q": 3, "N_k": 5, "B_r": 4, "B_c": 4}),
        n_random=6, run=_kernel_run("tile_kind"), solution=_kernel_solution("tile_kind"), shrink_budget=60,
        solution_is_factory=True, kernel=True,
        budget="the budget reads S and V of the tiles that are not skipped, each S[i, j] once and each V[j, c] "
               "once per row of its tile"),
    Exercise(
        id="10.1",
        title="TFLOP/s from a results-file record, by FA2 §4.1's FLOP model",
        signature="tflops(record) -> float; record has 'batch', 'heads', 'N', 'd', 'causal', 'pass' ('forward', "
                  "'backward' or 'forward+backward') and 'ms'",
        hint="The forward pass of one (batch, head) does two N × N × d matrix products, 2 FLOPs per multiply-add. "
             "The causal mask halves it; the backward pass counts 2.5 times the forward. Mind the units: 'ms' is "
             "in milliseconds, the answer in 10¹² FLOP/s.",
        covers="forward, backward and both, causal or not, batch, heads, N and d from 1 up, against "
               "fa2edu.flops.model_flops",
        params={"batch": Size(1, 16), "heads": Size(1, 32), "N": Size(1, 16384), "d": Size(1, 256),
                "ms": Kind((1.0, 0.25, 37.5)), "causal": Kind((False, True)),
                "pass": Kind(("forward", "backward", "forward+backward"))},
        base={"batch": 1, "heads": 1, "N": 1, "d": 1, "ms": 1.0, "causal": False, "pass": "forward"},
        edge_cases=({}, {"batch": 4, "heads": 16, "N": 4096, "d": 64}, {"N": 1024, "d": 128, "causal": True},
                    {"batch": 2, "heads": 8, "N": 2048, "d": 64, "pass": "backward", "ms": 37.5},
                    {"N": 512, "d": 64, "causal": True, "pass": "forward+backward", "ms": 0.25}),
        n_random=20, run=_run_tflops, solution=_solution_tflops),
    Exercise(
        id="11.4",
        title="standard attention's backward pass from scratch (dK = dSᵀ Q: erratum 1)",
        signature="attention_backward(Q, K, V, dO, causal) -> (dQ, dK, dV); Q (N_q, d), K (N_k, d), V (N_k, d_v), "
                  "dO (N_q, d_v); scale τ = 1/√d; causal is bottom-right aligned",
        hint="Recompute S = τ Q Kᵀ (masked with −inf), P = softmax(S) with the guards, O = P V. Then FA1 Algorithm "
             "3: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = τ dS K, dK = τ dSᵀ Q. Check every "
             "shape: dK must be N_k × d.",
        covers="N_q ≠ N_k both ways, d ≠ d_v, causal with N_q > N_k (rows that see no key: gradients 0), scores "
               "in the hundreds, against fa2edu.attention_reference_backward",
        params={"N_q": Size(1, 9), "N_k": Size(1, 9), "d": Size(1, 5), "d_v": Size(1, 4),
                "causal": Kind((False, True)), "logits": Kind(("normal", "large"))},
        base={"N_q": 1, "N_k": 1, "d": 1, "d_v": 1, "causal": False, "logits": "normal"},
        edge_cases=({}, {"N_q": 3, "N_k": 5, "d": 2, "d_v": 3}, {"N_q": 5, "N_k": 3, "d": 3, "d_v": 2},
                    {"N_q": 6, "N_k": 4, "d": 3, "d_v": 2, "causal": True},
                    {"N_q": 3, "N_k": 7, "d": 2, "d_v": 2, "causal": True},
                    {"N_q": 4, "N_k": 4, "d": 2, "d_v": 2, "logits": "large"}),
        n_random=20, run=_run_attention_backward, solution=_solution_attention_backward),
    Exercise(
        id="12.4",
        title="the bottom-right causal mask as a boolean attn_mask for SDPA",
        signature="sdpa_causal_mask(N_q, N_k) -> bool array or tensor (N_q, N_k), True where query i may attend "
                  "to key j",
        hint="Row i of the queries is the token at position i + N_k − N_q of the whole sequence: it sees every key "
             "up to that position. Build the index grids i (a column) and j (a row) and compare them.",
        covers="N_q = N_k, N_q < N_k (decoding with a cache), N_q > N_k (rows with no visible key), sizes of 1, "
               "against fa2edu.masks.causal_mask",
        params={"N_q": Size(1, 40), "N_k": Size(1, 40)},
        base={"N_q": 1, "N_k": 1},
        edge_cases=({}, {"N_q": 3, "N_k": 3}, {"N_q": 2, "N_k": 5}, {"N_q": 5, "N_k": 2}, {"N_q": 1, "N_k": 9}),
        n_random=20, run=_run_sdpa_mask, solution=_solution_sdpa_mask),
    Exercise(
        id="13.2",
        title="merge two partial attentions (O, L) over disjoint keys, with empty sides",
        signature="merge_states(O_a, L_a, O_b, L_b) -> (O, L); O (N, d_v) normalised, L (N,) log-sum-exp, "
                  "O = 0 and L = +inf on a row where a side saw no key",
        hint="A side with log-sum-exp L is a row whose statistics are (m, ℓ) = (L, 1): merge them as in chapter 2, "
             "so the weights are e^(L_a − L) and e^(L_b − L) with L the merged log-sum-exp, and every exponent is "
             "≤ 0. An empty side has L = +inf, not −inf: its statistics are (−inf, 0), weight 0. A row can be "
             "empty on both sides.",
        covers="a side with no key at all, rows empty on one side or both (L = +inf), causal and random masks, "
               "logits ×20 and ×10⁴, against the float64 oracle over all the keys",
        params={"N_q": Size(1, 8), "N_k": Size(1, 16), "split": Size(0, 16), "d_v": Size(1, 4), "mask": _MASKS,
                "logits": Kind(("normal", "spread", "large"))},
        base={"N_q": 1, "N_k": 1, "split": 1, "d_v": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_q": 3, "N_k": 7, "split": 3, "d_v": 2}, {"N_q": 2, "N_k": 4, "split": 0},
                    {"N_q": 2, "N_k": 4, "split": 4}, {"N_q": 5, "N_k": 6, "split": 2, "mask": "causal"},
                    {"N_q": 4, "N_k": 9, "split": 4, "d_v": 2, "mask": "random"},
                    {"N_q": 3, "N_k": 8, "split": 5, "d_v": 2, "logits": "large"}),
        n_random=25, run=_run_merge_states, solution=_solution_merge_states,
        valid=lambda case: case["split"] <= case["N_k"]),
    Exercise(
        id="13.3",
        title="a device function: the split-KV merge of a decode kernel's partials (O, L), in one pass",
        signature="@cuda.jit(device=True) merge_splits(O_part, L_part, r, acc, O, L); O_part (rows, S, d_v) and "
                  "L_part (rows, S) in global memory, L = +inf for a split that saw no key; writes O[r] (d_v) "
                  "and L[r]; acc: d_v registers",
        hint="Chapter 2's merge, split by split: a split with log-sum-exp L_s is a row whose statistics are "
             "(m, ℓ) = (L_s, 1). Keep a running maximum m and sum ℓ = Σ e^(L_s − m); when m grows, rescale ℓ and "
             "acc. An empty split (L_s = +inf) adds nothing: skip it. Every split empty: O = 0, L = +inf. Read "
             "each partial once, write O and L once.",
        covers="one to five splits, splits that saw no key (a decode kernel's trailing splits, random masks), rows "
               "with no key at all, logits ×20 and ×10⁴, against the float64 oracle over all the keys; the reads "
               "and writes counted",
        params={"rows": Size(1, 4), "n": Size(1, 10), "splits": Size(1, 5), "d_v": Size(1, 3),
                "mask": Kind(("none", "random")), "logits": Kind(("normal", "spread", "large"))},
        base={"rows": 1, "n": 1, "splits": 1, "d_v": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"rows": 2, "n": 7, "splits": 3, "d_v": 2}, {"rows": 2, "n": 3, "splits": 5},
                    {"rows": 4, "n": 9, "splits": 4, "d_v": 2, "mask": "random"},
                    {"rows": 3, "n": 8, "splits": 3, "d_v": 2, "logits": "large"},
                    {"rows": 2, "n": 6, "splits": 2, "logits": "spread", "mask": "random"}),
        n_random=8, run=_kernel_run("merge_splits"), solution=_kernel_solution("merge_splits"), shrink_budget=60,
        solution_is_factory=True, kernel=True,
        budget="the budget reads each partial O and L once and writes each O[r, c] and L[r] once"),
    Exercise(
        id="14.1",
        title="a device function: which (row, col) each lane's registers hold in mma.sync.m16n8k16",
        signature="@cuda.jit(device=True) fragment_coords(operand, lane, e) -> (row, col): operand 0 = A (16 × 16, "
                  "e = 0 … 7: register a_(e // 2), half e % 2), 1 = B (16 × 8, (k, n), e = 0 … 3), 2 = C and D "
                  "(16 × 8, e = 0 … 3)",
        hint="Lane l has g = l // 4 and t = l % 4. In A and C a lane holds rows g and g + 8, columns 2t and "
             "2t + 1 (A: and the same 8 columns on); in B it holds column n = g and rows k = 2t, 2t + 1 (and 8 "
             "on). The order of the registers is in kernels_gpu/fragments.py's tables: a1 is the "
             "lower rows, a2 the right columns.",
        covers="every register of every lane of A, B and C, loaded by your map, multiplied by the tensor core's "
               "own layout and stored back by your map, against A·B + C; each element read and written once",
        params={"values": Kind(("distinct", "normal"))},
        base={"values": "distinct"},
        edge_cases=({}, {"values": "normal"}),
        n_random=8, run=_kernel_run("fragment_coords"), solution=_kernel_solution("fragment_coords"),
        shrink_budget=4, solution_is_factory=True, kernel=True,
        budget="the budget reads each element of A, B and C once and writes each element of D once"),
    Exercise(
        id="14.2",
        title="a device function: the row address each lane gives ldmatrix.x4",
        signature="@cuda.jit(device=True) ldmatrix_row(operand, lane, row0, col0, stride) -> the element index of "
                  "the 8 elements (16 bytes) lane gives ldmatrix.x4 for the 16 × 16 tile at (row0, col0) of a "
                  "row-major buffer of stride elements per row; operand 0: A from Q, 1: B from K",
        hint="Lanes 8i … 8i + 7 give the eight rows of 8 × 8 matrix i, in order, and register r_i of every lane "
             "is filled from matrix i. So list which quarter of the tile each r_i must be: for A, a0 … a3 are "
             "rows 0-7 / 8-15 (a1, a3 lower) × columns 0-7 / 8-15 (a2, a3 right). For K, B = K_jᵀ: b0, b1 of "
             "two n-tiles are keys 0-7 with d 0-7, then d 8-15, then keys 8-15. A row of the buffer is stride "
             "elements long, not 16.",
        covers="A and K tiles, tiles at an offset in the buffer, padded rows (stride ≠ 16), each lane's 8 "
               "elements checked against the fragment layouts of mma.sync.m16n8k16 (PTX ISA)",
        params={"operand": Kind(("A", "K")), "row0": Size(0, 5), "col0": Kind((0, 8, 16)),
                "stride": Kind((16, 24, 40, 72))},
        base={"operand": "A", "row0": 0, "col0": 0, "stride": 16},
        edge_cases=({}, {"operand": "K"}, {"row0": 3, "stride": 24}, {"operand": "K", "row0": 2, "stride": 40},
                    {"row0": 1, "col0": 8, "stride": 40}, {"operand": "K", "col0": 16, "stride": 72}),
        n_random=6, run=_kernel_run("ldmatrix_row"), solution=_kernel_solution("ldmatrix_row"), shrink_budget=40,
        solution_is_factory=True, kernel=True, valid=lambda case: case["col0"] + 16 <= case["stride"],
        budget="ldmatrix reads each element of the tile once (shared memory on a GPU), 256 per launch"),
    Exercise(
        id="14.3",
        title="a device function: the final rescale of O from a lane's fragments (FA2 Alg. 1 lines 12-15)",
        signature="@cuda.jit(device=True) finish_rows(o, m, l, lane, O, L); lane's registers: o[4n + 2h + e] = "
                  "Õ[g + 8h, 8n + 2t + e], m[h], l[h] of rows g + 8h (h = 0, 1); writes O (N_q, d_v) and L (N_q,)",
        hint="For each of the lane's two rows g and g + 8 (g = lane // 4): skip a row ≥ N_q (the warp's last "
             "rows can be padding), divide the lane's entries of Õ by ℓ and store them at columns 8n + 2t + e, "
             "and let one lane of the four that share the row (t = 0) write L = m + log ℓ. A row that saw no key "
             "has ℓ = 0: O = 0, L = +inf.",
        covers="N_q from 1 to 16 (padding rows that must not be stored), d_v = 8 and 16, causal and random masks "
               "with rows that saw no key, logits ×10⁴; every element of O and L written once",
        params={"N_q": Size(1, 16), "N_k": Size(1, 8), "tiles": Size(1, 2), "mask": _MASKS,
                "logits": Kind(("normal", "large"))},
        base={"N_q": 1, "N_k": 1, "tiles": 1, "mask": "none", "logits": "normal"},
        edge_cases=({}, {"N_q": 16, "N_k": 5, "tiles": 2}, {"N_q": 11, "N_k": 4, "mask": "causal"},
                    {"N_q": 6, "N_k": 8, "tiles": 2, "mask": "random"}, {"N_q": 9, "N_k": 3, "logits": "large"}),
        n_random=5, run=_kernel_run("finish_rows"), solution=_kernel_solution("finish_rows"), shrink_budget=40,
        solution_is_factory=True, kernel=True,
        budget="the budget writes each O[row, col] and L[row] once and reads neither"),
    Exercise(
        id="15.1",
        title="the causal work of one ring step: visible (query, key) pairs, contiguous or zigzag",
        signature="step_pairs(N, W, layout, rank, source) -> int, the pairs with key position ≤ query position "
                  "between rank's tokens and source's tokens, per (batch, head)",
        hint="Write down which global positions a rank holds: one range of N/W tokens (contiguous), or chunks r "
             "and 2W − 1 − r of N/(2W) tokens (zigzag). Then, chunk against chunk, query i sees the keys of a "
             "chunk [a, b) at positions ≤ i: how many is that, for each i? A chunk pair can be fully visible, "
             "invisible, or a triangle with its diagonal.",
        covers="W = 1 (the whole sequence), chunks of one token, skipped steps, diagonal steps, zigzag steps "
               "where one query chunk sees the block and the other does not, every (rank, source) of each ring, "
               "against the causal mask on global positions",
        params={"W": Size(1, 6), "c": Size(1, 5), "layout": Kind(("contiguous", "zigzag"))},
        base={"W": 1, "c": 1, "layout": "contiguous"},
        edge_cases=({}, {"layout": "zigzag"}, {"W": 2, "c": 2}, {"W": 2, "c": 2, "layout": "zigzag"},
                    {"W": 4, "c": 3}, {"W": 4, "c": 3, "layout": "zigzag"}, {"W": 3, "c": 1, "layout": "zigzag"}),
        n_random=13, run=_run_step_pairs, solution=_solution_step_pairs),
    Exercise(
        id="16.1",
        title="the 128-byte swizzle: where element (row, col) of a TMA box lands in shared memory",
        signature="swizzled_offset(row, col) -> the byte offset of 16-bit element (row, col), col = 0 … 63, of "
                  "a panel stored with the 128-byte swizzle (128 bytes a row)",
        hint="A row is 128 bytes: eight 16-byte chunks of eight elements. Unswizzled, element (row, col) is at "
             "128·row + 2·col. The swizzle keeps each chunk's eight elements together and moves the chunk: chunk "
             "c of a row goes to chunk c XOR (row mod 8).",
        covers="every element of panels of 1 to 24 rows (the 8-row pattern repeated, and cut short), against the "
               "PTX ISA's 128-byte swizzle",
        params={"rows": Size(1, 24)},
        base={"rows": 1},
        edge_cases=({}, {"rows": 8}, {"rows": 9}, {"rows": 24}),
        n_random=6, run=_run_swizzle, solution=_solution_swizzle),
    Exercise(
        id="16.2",
        title="a wgmma shared-memory matrix descriptor, bit by bit",
        signature="wgmma_descriptor(start, lbo, sbo, swizzle) -> int: the 64-bit descriptor of a matrix at byte "
                  "address start, leading and stride byte offsets lbo, sbo, swizzle 'none', '128B', '64B' or '32B'",
        hint="Three 14-bit fields hold addresses in units of 16 bytes (shift each right by 4): the start at bit 0, "
             "LBO at bit 16, SBO at bit 32. The swizzle mode goes in the top two bits: none 0, 128B 1, 64B 2, "
             "32B 3. The base offset (bits 49-51) is 0 for tiles aligned to 1024 bytes.",
        covers="start addresses up to the top of shared memory's 256 KiB window, every swizzle mode, random LBO "
               "and SBO; a wrong answer names the fields that differ",
        params={"swizzle": Kind(("128B", "none", "64B", "32B"))},
        base={"swizzle": "128B"},
        edge_cases=({}, {"swizzle": "none"}, {"swizzle": "64B"}, {"swizzle": "32B"}),
        n_random=6, run=_run_descriptor, solution=_solution_descriptor),
    Exercise(
        id="16.3",
        title="the ring of stages: which stage holds tile j, and which phase each side waits for",
        signature="ring_step(j, stages) -> (stage, consumer_parity, producer_parity): the stage of tile j, the "
                  "parity of the full barrier's phase the consumers wait for, and the parity of the empty "
                  "barrier's phase the producer waits for before refilling it (None when the stage is fresh)",
        hint="Tile j goes to stage j mod stages, and it is that stage's (j // stages + 1)-th tile. A barrier's "
             "phase flips each time it completes, so the consumers of the stage's k-th tile (k from 0) wait for "
             "parity k mod 2. The producer refills a stage once its previous tile was released: that release "
             "was the empty barrier's (k − 1)-th completion.",
        covers="rings of 1 to 4 stages over 1 to 13 tiles, against the protocol itself run step by step",
        params={"stages": Size(1, 4), "tiles": Size(1, 13)},
        base={"stages": 1, "tiles": 1},
        edge_cases=({}, {"stages": 2, "tiles": 5}, {"stages": 3, "tiles": 7}, {"stages": 1, "tiles": 4},
                    {"stages": 4, "tiles": 13}),
        n_random=5, run=_run_ring, solution=_solution_ring),
    Exercise(
        id="17.1",
        title="a sliding-window mask_mod: the w most recent keys, bottom-right aligned",
        signature="sliding_window_mask(w, offset) -> mask_mod(b, h, q_idx, kv_idx) -> bool: query q_idx, at key "
                  "position p = q_idx + offset, keeps the keys p − w + 1 … p (offset = N_k − N_q)",
        hint="Name the query's key position first, p = q_idx + offset. Then two comparisons: a key in the future "
             "(kv_idx > p) is masked, and so is one w or more positions back (kv_idx ≤ p − w). Count the keys "
             "your window keeps for w = 1: it must be the query's own position alone.",
        covers="w = 1 (the diagonal), w ≥ N_k (the causal mask), N_q < N_k, N_q > N_k (queries before the first "
               "key: fully masked rows), every (q_idx, kv_idx) of each case, against a window laid out row by row",
        params={"N_q": Size(1, 12), "N_k": Size(1, 12), "w": Size(1, 14)},
        base={"N_q": 1, "N_k": 1, "w": 1},
        edge_cases=({}, {"N_q": 6, "N_k": 6}, {"N_q": 6, "N_k": 6, "w": 3}, {"N_q": 5, "N_k": 5, "w": 14},
                    {"N_q": 4, "N_k": 9, "w": 3}, {"N_q": 9, "N_k": 4, "w": 2}, {"N_q": 12, "N_k": 12, "w": 5}),
        n_random=5, run=_run_sliding_window, solution=_solution_sliding_window),
    Exercise(
        id="17.2",
        title="packed documents: a causal mask inside each document, padding seeing nothing",
        signature="document_causal(b, h, q_idx, kv_idx, q_ids, kv_ids) -> bool: keep key kv_idx for query q_idx "
                  "iff both are in the same document (q_ids[q_idx] == kv_ids[kv_idx], id −1 = padding) and "
                  "kv_idx ≤ q_idx + len(kv_ids) − len(q_ids)",
        hint="Three conditions, all needed: the same document id, an id that is not −1 (padding is in no "
             "document), and the causal test at the query's key position p = q_idx + len(kv_ids) − len(q_ids), "
             "since the queries are the last len(q_ids) positions. Index q_ids with q_idx and kv_ids with kv_idx.",
        covers="one document, single-token documents, random lengths, a padded tail (fully masked rows), "
               "N_q < N_k (the queries are the last positions), against the documents' blocks laid out one by one "
               "and fa2edu.masks.causal_mask",
        params={"N_q": Size(1, 10), "N_k": Size(1, 12), "docs": Kind(("one", "singles", "random", "padded"))},
        base={"N_q": 1, "N_k": 1, "docs": "one"},
        edge_cases=({}, {"N_q": 5, "N_k": 5}, {"N_q": 6, "N_k": 6, "docs": "singles"},
                    {"N_q": 8, "N_k": 8, "docs": "random"}, {"N_q": 3, "N_k": 10, "docs": "random"},
                    {"N_q": 7, "N_k": 9, "docs": "padded"}, {"N_q": 10, "N_k": 12, "docs": "padded"},
                    {"N_q": 1, "N_k": 1, "docs": "padded"}),
        n_random=5, run=_run_documents, solution=_solution_documents,
        valid=lambda case: case["N_q"] <= case["N_k"]),
    Exercise(
        id="17.3",
        title="the derivative of the soft cap, d/dscore of c·tanh(score/c), for the backward pass",
        signature="softcap_grad(c) -> score_mod_grad(score, b, h, q_idx, kv_idx): the derivative with respect to "
                  "score of c·tanh(score/c)",
        hint="The chain rule: the outer function is c·tanh(u), the inner u = score/c. tanh′(u) = 1 − tanh²(u). "
             "Then think about scores of ±10⁴: which way of writing it never divides inf by inf?",
        covers="caps c = 1, 0.5, 5 and 30; scores N(0, 1), ×20 and ×10⁴ (where tanh saturates and the "
               "derivative is 0), against sech²(score/c) (and a central difference in the report)",
        params={"n": Size(1, 16), "c": Kind((1.0, 0.5, 5.0, 30.0)), "scores": Kind(("normal", "spread", "large"))},
        base={"n": 1, "c": 1.0, "scores": "normal"},
        edge_cases=({}, {"n": 16}, {"n": 8, "c": 0.5}, {"n": 8, "c": 5.0}, {"n": 8, "c": 30.0, "scores": "spread"},
                    {"n": 8, "c": 5.0, "scores": "large"}, {"n": 16, "c": 0.5, "scores": "large"}),
        n_random=5, run=_run_softcap_grad, solution=_solution_softcap_grad),
    Exercise(
        id="18.1",
        title="a tile to float8 e4m3 with one scale per block of rows, bit for bit",
        signature="quantize_tile(x, block) -> (codes, descale): x (N, d) float32; codes (N, d) uint8 e4m3 bit "
                  "patterns of x / δ, δ = amax(|x|) / 448 over each block of block rows (float32, one per block, "
                  "the last one ragged; 1 for an all-zero block)",
        hint="Three steps per block of rows: its amax(|x|), then δ = amax / 448 stored as float32 (1 where amax is "
             "0), then the codes of x / δ. fa2edu.fp8.to_bits(y, 'e4m3') does the rounding (nearest, ties to "
             "even, saturating at ±448); divide by the float32 δ, as the descale that travels with the codes is.",
        covers="N not a multiple of block, block ≥ N (one scale), block = 1 (a scale per row), all-negative tiles, "
               "an all-zero block, outlier channels ×100 and magnitudes spread over twenty binades (subnormal "
               "codes), every code and every descale compared with fa2edu.fp8.quantize_fp8 exactly",
        params={"N": Size(1, 20), "d": Size(1, 16), "block": Size(1, 24),
                "values": Kind(("normal", "negative", "zeros", "outliers", "spread"))},
        base={"N": 1, "d": 1, "block": 1, "values": "normal"},
        edge_cases=({}, {"N": 8, "d": 4, "block": 3}, {"N": 5, "d": 3, "block": 8}, {"N": 7, "d": 2, "block": 1},
                    {"N": 6, "d": 4, "block": 2, "values": "negative"}, {"N": 9, "d": 5, "block": 3,
                                                                           "values": "zeros"},
                    {"N": 16, "d": 16, "block": 4, "values": "outliers"}, {"N": 20, "d": 8, "block": 6,
                                                                             "values": "spread"}),
        n_random=6, run=_run_quantize_tile, solution=_solution_quantize_tile),
    Exercise(
        id="18.2",
        title="the random Hadamard rotation of incoherent processing, M = diag(signs)·H/√d",
        signature="rotation_matrix(signs) -> M: signs (d,) of ±1, d a power of two; M (d, d) = diag(signs)·H_d/√d "
                  "with H_d Sylvester's Hadamard matrix, so that x ↦ x·M is orthogonal",
        hint="Build H_d by Sylvester's doubling, H_1 = [1], H_2d = [[H_d, H_d], [H_d, −H_d]] (np.block). Each row "
             "of H_d has length √d. The signs multiply the rows of H (they act on x before H does).",
        covers="d = 1 … 128, signs with both values, against fa2edu.fp8's Sylvester matrix: orthogonality first "
               "(M·Mᵀ = I), then every entry; a wrong answer says whether the scale or the signs are off",
        params={"d": Kind((1, 2, 4, 8, 16, 32, 64, 128))},
        base={"d": 1},
        edge_cases=({}, {"d": 2}, {"d": 4}, {"d": 8}, {"d": 16}, {"d": 64}, {"d": 128}),
        n_random=5, run=_run_rotation, solution=_solution_rotation),
]

EXERCISES: dict[str, Exercise] = {exercise.id: exercise for exercise in _EXERCISES}


# -- the public functions ------------------------------------------------------------------------------------------

class _Text(str):
    """A string that a notebook displays as text (no quotes, real line breaks)."""

    def __repr__(self) -> str:
        return str(self)


class Catalogue(tuple):
    """The checked exercises; displays as a table of ids, titles and the function each one asks for."""

    def __repr__(self) -> str:
        width = max(len(e.id) for e in self) if self else 0
        pad = " " * (width + 4)
        return "\n".join(f"{e.id:>{width}}  {e.title}\n" + "\n".join(textwrap.wrap(
            e.signature, 88, initial_indent=pad, subsequent_indent=pad + "  ")) for e in self)

    __str__ = __repr__


def _exercise(exercise_id) -> Exercise:
    key = str(exercise_id).strip()
    if key not in EXERCISES:
        raise ValueError(f"exercise must be one of {', '.join(EXERCISES)} (the exercises with a checker); "
                         f"got {exercise_id!r}")
    return EXERCISES[key]


def list_exercises(chapter: int | None = None) -> Catalogue:
    """The exercises that have a checker (of one chapter, if given), with what each one asks for."""
    if chapter is not None and not isinstance(chapter, int):
        raise TypeError(f"chapter must be an int, got {type(chapter).__name__}")
    return Catalogue(e for e in _EXERCISES if chapter is None or e.id.split(".")[0] == str(chapter))


def hint(exercise_id) -> str:
    """The hint of an exercise: a nudge towards the answer, not the answer."""
    exercise = _exercise(exercise_id)
    return _Text("\n".join([*_wrap(f"Exercise {exercise.id}: {exercise.signature}"),
                             *_wrap(f"Hint: {exercise.hint}")]))


def solution(exercise_id) -> Callable:
    """The worked solution of an exercise as a function (for instructors and tests; the chapters show it too)."""
    exercise = _exercise(exercise_id)
    return exercise.solution() if exercise.solution_is_factory else exercise.solution


def show_solution(exercise_id) -> None:
    """Print the worked solution's code, to read: the function (or numba.cuda kernel, or device function) that
    passes the checker, under the name the exercise asks for. The chapters fold the same solution away."""
    exercise = _exercise(exercise_id)
    print(_solution_source(exercise))


def _solution_source(exercise: Exercise) -> str:
    function = solution(exercise.id)
    function = getattr(function, "py_func", function)          # a numba.cuda kernel or device function
    source = textwrap.dedent(inspect.getsource(function)).rstrip()
    # The name the exercise asks for: "@cuda.jit(device=True) tile_kind(row0, …) -> …" gives tile_kind.
    name = re.search(r"(?:^|\s)([A-Za-z_]\w*)\(", exercise.signature).group(1)
    source = re.sub(rf"^def {re.escape(function.__name__)}\(", f"def {name}(", source, count=1, flags=re.M)
    title = textwrap.wrap(f"Exercise {exercise.id}: {exercise.title}", 94, initial_indent="# ",
                          subsequent_indent="#   ")
    return "\n".join([*title, source])


def _cases(exercise: Exercise) -> list[dict]:
    """The exercise's cases: its edge cases, then ``n_random`` drawn with a seed fixed by its id."""
    cases = []
    for partial in exercise.edge_cases:
        case = {**exercise.base, "seed": 0, **partial}
        if not exercise.valid(case):
            raise AssertionError(f"exercise {exercise.id}: edge case {case} is not valid")
        cases.append(case)
    rng = np.random.default_rng(zlib.crc32(exercise.id.encode()))
    while len(cases) < len(exercise.edge_cases) + exercise.n_random:
        case = {name: spec.draw(rng) for name, spec in exercise.params.items()}
        case["seed"] = int(rng.integers(2**31))
        if exercise.valid(case):
            cases.append(case)
    return cases


def _attempt(exercise: Exercise, fn, case: dict, traffic: list | None = None) -> _Mismatch | None:
    """None if ``fn`` is right on ``case``; else the mismatch, with the arguments of the failing call attached.

    A kernel exercise's ``run`` returns the global-memory traffic of its launch (:class:`Traffic`): it is appended to
    ``traffic`` when given. Whatever else goes wrong while judging what came back (an exception from the reader's
    object, ``sys.exit`` in its ``__array__``) is a failure of this case too; only ``KeyboardInterrupt`` stops."""
    _Calls.last = None
    try:
        io = exercise.run(fn, case)
    except _NotAttempted:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001  (_Mismatch, or anything the reader's objects raised)
        mismatch = error if isinstance(error, _Mismatch) else _Mismatch(
            _raised(error, "checking what your function returned raised"), kind=("raised", type(error).__name__))
        if _Calls.last is not None:
            last = _Calls.last
            mismatch.inputs = dict(last.inputs)
            mismatch.call = last.name + (f" ({last.where})" if last.where else "")
        return mismatch
    if traffic is not None and io is not None:
        traffic.append(io)
    return None


def _failure_kind(mismatch: _Mismatch):
    """How a case fails, for shrinking: a smaller case is kept only if it fails the same way (the same exception,
    NaN, a wrong infinity, a wrong value, over the memory budget …), so that the case reported still shows the
    reader's mistake and not another one the shrinking stumbled on. A runner may set a finer kind itself (13.2 adds
    which sides of the wrong row saw keys)."""
    if mismatch.kind is not None:
        return mismatch.kind
    first = mismatch.lines[0] if mismatch.lines else ""
    raised = re.search(r"raised (\w+)", first)
    return ("raised", raised.group(1)) if raised else "value"


def _smaller_cases(exercise: Exercise, case: dict):
    for name, spec in exercise.params.items():
        for value in spec.smaller(case[name]):
            candidate = {**case, name: value}
            if exercise.valid(candidate):
                yield candidate


def _shrink(exercise: Exercise, fn, case: dict, mismatch: _Mismatch):
    """Greedy shrinking: take any smaller case that still fails the same way (:func:`_failure_kind`), until none does
    (or the budget is spent)."""
    steps = tried = 0
    improved = True
    kind = _failure_kind(mismatch)
    while improved and tried < exercise.shrink_budget:
        improved = False
        for candidate in _smaller_cases(exercise, case):
            tried += 1
            try:
                found = _attempt(exercise, fn, candidate)
            except _NotAttempted:
                found = None
            if found is not None and _failure_kind(found) == kind:
                case, mismatch, improved = candidate, found, True
                steps += 1
                break
            if tried >= exercise.shrink_budget:
                break
    return case, mismatch, steps


def _describe_case(exercise: Exercise, case: dict) -> str:
    parts = []
    for name, spec in exercise.params.items():
        parts.append(f"{name} = {case[name]}" if isinstance(spec, Size) else f"{name}: {case[name]}")
    return ", ".join(parts) + f" (seed {case['seed']})"


def _coverage(exercise: Exercise, cases: list[dict]) -> str:
    parts = []
    for name, spec in exercise.params.items():
        values = [c[name] for c in cases]
        if isinstance(spec, Size):
            parts.append(f"{name} {min(values)}–{max(values)}")
        else:
            parts.append(f"{name}: " + ", ".join(str(v) for v in spec.values if v in values))
    return "; ".join(parts)


def check(exercise_id, fn, *, verbose: bool = True) -> CheckResult:
    """Run exercise ``exercise_id``'s hidden cases on ``fn`` and report; returns a :class:`CheckResult`.

    The report (printed unless ``verbose=False``) says what was checked on a pass; on a failure it shows the
    smallest failing case found by shrinking, the arguments of the failing call, and what was expected against what
    came back. A function that raises ``NotImplementedError`` is "not attempted yet": no exception, a falsy result.
    """
    exercise = _exercise(exercise_id)
    if not (callable(fn) or hasattr(fn, "__getitem__")):
        raise TypeError(f"fn must be your function for exercise {exercise.id} ({exercise.signature}); "
                        f"got {type(fn).__name__}")
    if exercise.kernel:
        from fa2edu import exercise_kernels
        exercise_kernels.require_cuda(exercise.id)
    cases = _cases(exercise)
    header = "\n".join(_wrap(f"Exercise {exercise.id}: {exercise.title}"))
    failure = None
    traffic: list = []
    try:
        for number, case in enumerate(cases, start=1):
            mismatch = _attempt(exercise, fn, case, traffic)
            if mismatch is None:
                continue
            small, mismatch, steps = _shrink(exercise, fn, case, mismatch)
            failure = Failure(exercise.id, small, case, number, steps, [], mismatch.inputs, mismatch.expected,
                              mismatch.got)
            failure.lines = _failure_lines(exercise, failure, mismatch, len(cases))
            break
    except _NotAttempted:
        report = "\n".join([header, *_wrap(f"… Not attempted yet: your function raises NotImplementedError. Write "
                                            f"it and run the cell again (exercises.hint({exercise.id!r}) gives a "
                                            "hint).")])
        return _finish(CheckResult(exercise.id, False, False, 0, None, report), verbose)
    if failure is None:
        report = "\n".join([header, *_wrap(f"✓ Passed all {len(cases)} cases: {_coverage(exercise, cases)}."),
                            *_wrap(f"They include {exercise.covers}.", indent="  ", hang=""),
                            *_traffic_lines(exercise, traffic, len(cases))])
        return _finish(CheckResult(exercise.id, True, True, len(cases), None, report), verbose)
    report = header + "\n" + "\n".join(failure.lines)
    return _finish(CheckResult(exercise.id, False, True, failure.case_number, failure, report), verbose)


def _traffic_lines(exercise: Exercise, traffic: list, cases: int) -> list[str]:
    """A kernel exercise's pass report ends with the global memory its launches moved, beside the budget."""
    if not exercise.kernel:
        return []
    if len(traffic) < cases:
        return _wrap("Global memory is counted in numba's CUDA simulator only; these launches ran on a GPU.",
                     indent="  ", hang="")
    reads, writes = sum(t.reads for t in traffic), sum(t.writes for t in traffic)
    budget_reads, budget_writes = sum(t.budget_reads for t in traffic), sum(t.budget_writes for t in traffic)
    return _wrap(f"Global memory, all {cases} launches: your code read {reads:,} elements (budget {budget_reads:,}) "
                 f"and wrote {writes:,} (budget {budget_writes:,}); {exercise.budget}.", indent="  ", hang="")


def _failure_lines(exercise: Exercise, failure: Failure, mismatch: _Mismatch, total: int) -> list[str]:
    shrunk = (f", shrunk in {_count(failure.shrink_steps, 'step', 'steps')} from "
              f"{_describe_case(exercise, failure.first_case)}" if failure.shrink_steps else "")
    lines = [f"✗ Wrong answer on case {failure.case_number} of {total}{shrunk}.",
             f"  Smallest failing case found: {_describe_case(exercise, failure.case)}"]
    if mismatch.inputs:
        lines.append(f"  The failing call, of {mismatch.call}, had")
        lines += [f"    {_show(name, value)}" for name, value in mismatch.inputs.items()]
    lines.append("  What came back:")
    lines += ["    " + part for line in mismatch.lines for part in line.split("\n")]
    if getattr(mismatch, "traffic", None) is not None:
        lines.append(f"  Global memory on this case: {mismatch.traffic}")
    lines.append("  (result.failure holds the inputs, the expected values and what came back.)")
    # Long lines wrap, keeping their indentation; the drawn masks are short and stay as they are.
    return [part for line in lines
            for part in _wrap(line.lstrip(), indent=" " * (len(line) - len(line.lstrip())))]


def _wrap(text: str, indent: str = "", width: int = 88, hang: str = "  ") -> list[str]:
    """``text`` wrapped at ``width`` (the book's page), continuation lines indented by ``hang`` more."""
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + hang,
                         break_on_hyphens=False, break_long_words=False) or [indent]


def _finish(result: CheckResult, verbose: bool) -> CheckResult:
    if verbose:
        print(result.report)
    return result
