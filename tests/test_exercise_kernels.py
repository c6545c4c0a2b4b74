"""The kernel exercises (fa2edu.exercise_kernels): the reader's device function runs inside a harness kernel in numba's
CUDA simulator, against the oracle, with its global-memory reads and writes counted beside a budget.

Each checker passes its worked solution (tests/test_exercises.py) and fails the mistakes a reader makes at this
level: a second pass over global memory (right values, over the budget), a forgotten rescale or guard, a tile test
aligned top-left, a register map with two registers swapped, a stride taken for 16, every lane of a group storing
the same L. The report must name a small failing case and, for a budget failure, both numbers. The wrong answers are
module-level kernels, as a reader writes them in a notebook cell.
"""

from __future__ import annotations

import ast
import math
import re
import sys
from pathlib import Path

import pytest
from numba import cuda  # the CUDA simulator in CI: tests/conftest.py sets NUMBA_ENABLE_CUDASIM=1 first

from fa2edu import exercises
from fa2edu.exercises import MASK, PLAIN, SKIP

ROOT = Path(__file__).resolve().parent.parent


def flat(report: str) -> str:
    return " ".join(report.split())


# -- 9.2 row_stats ----------------------------------------------------------------------------------------------------

@cuda.jit
def row_stats_two_passes(S, m, l):              # the maximum first, then the sum: S read twice
    i = cuda.grid(1)
    if i >= S.shape[0]:
        return
    m_i = -math.inf
    for j in range(S.shape[1]):
        m_i = max(m_i, S[i, j])
    l_i = 0.0
    if m_i != -math.inf:
        for j in range(S.shape[1]):
            l_i += math.exp(S[i, j] - m_i)
    m[i] = m_i
    l[i] = l_i


# -- 9.3 online_update ------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def update_rereading_S(S, V, i, j0, j1, s, o, ml):   # right values, but S read again for the exponentials
    m_old = ml[0]
    m_new = m_old
    for j in range(j0, j1):
        m_new = max(m_new, S[i, j])
    if m_new == -math.inf:
        return
    alpha = math.exp(m_old - m_new)
    l_new = alpha * ml[1]
    for c in range(o.shape[0]):
        o[c] *= alpha
    for j in range(j0, j1):
        p = math.exp(S[i, j] - m_new)
        l_new += p
        for c in range(o.shape[0]):
            o[c] += p * V[j, c]
    ml[0] = m_new
    ml[1] = l_new


@cuda.jit(device=True)
def update_not_rescaling_o(S, V, i, j0, j1, s, o, ml):   # ℓ rescaled, Õ not
    m_old = ml[0]
    m_new = m_old
    for j in range(j0, j1):
        s[j - j0] = S[i, j]
        m_new = max(m_new, s[j - j0])
    if m_new == -math.inf:
        return
    l_new = math.exp(m_old - m_new) * ml[1]
    for j in range(j0, j1):
        p = math.exp(s[j - j0] - m_new)
        l_new += p
        for c in range(o.shape[0]):
            o[c] += p * V[j, c]
    ml[0] = m_new
    ml[1] = l_new


@cuda.jit(device=True)
def update_unguarded(S, V, i, j0, j1, s, o, ml):          # −inf − (−inf) on a row with nothing visible yet
    m_old = ml[0]
    m_new = m_old
    for j in range(j0, j1):
        s[j - j0] = S[i, j]
        m_new = max(m_new, s[j - j0])
    alpha = math.exp(m_old - m_new)
    l_new = alpha * ml[1]
    for c in range(o.shape[0]):
        o[c] *= alpha
    for j in range(j0, j1):
        p = math.exp(s[j - j0] - m_new)
        l_new += p
        for c in range(o.shape[0]):
            o[c] += p * V[j, c]
    ml[0] = m_new
    ml[1] = l_new


# -- 9.4 tile_kind ----------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def kind_never_skips(row0, row1, col0, col1, N_q, N_k):   # right values, but fully masked tiles are read
    if col1 - 1 <= row0 + N_k - N_q:
        return PLAIN
    return MASK


@cuda.jit(device=True)
def kind_top_left(row0, row1, col0, col1, N_q, N_k):      # j <= i: right only when N_q = N_k
    if col0 > row1 - 1:
        return SKIP
    if col1 - 1 <= row0:
        return PLAIN
    return MASK


@cuda.jit(device=True)
def kind_never_plain(row0, row1, col0, col1, N_q, N_k):   # right values and traffic, a mask test too many
    if col0 > row1 - 1 + N_k - N_q:
        return SKIP
    return MASK


# -- 13.3 merge_splits -----------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def merge_three_passes(O_part, L_part, r, acc, O, L):    # the maximum, the sum, then O: L_part read three times
    S = L_part.shape[1]
    m = -math.inf
    for s in range(S):
        if L_part[r, s] != math.inf:
            m = max(m, L_part[r, s])
    l = 0.0
    for s in range(S):
        if L_part[r, s] != math.inf:
            l += math.exp(L_part[r, s] - m)
    for c in range(acc.shape[0]):
        acc[c] = 0.0
    for s in range(S):
        if L_part[r, s] != math.inf:
            w = math.exp(L_part[r, s] - m)
            for c in range(acc.shape[0]):
                acc[c] += w * O_part[r, s, c]
    for c in range(acc.shape[0]):
        O[r, c] = acc[c] / l if l > 0 else 0.0
    L[r] = m + math.log(l) if l > 0 else math.inf


@cuda.jit(device=True)
def merge_empty_split_as_heavy(O_part, L_part, r, acc, O, L):   # +inf becomes the maximum: e^(inf − inf)
    m = -math.inf
    l = 0.0
    for c in range(acc.shape[0]):
        acc[c] = 0.0
    for s in range(L_part.shape[1]):
        L_s = L_part[r, s]
        m_new = max(m, L_s)
        alpha = math.exp(m - m_new)
        w = math.exp(L_s - m_new)
        l = l * alpha + w
        for c in range(acc.shape[0]):
            acc[c] = acc[c] * alpha + w * O_part[r, s, c]
        m = m_new
    for c in range(acc.shape[0]):
        O[r, c] = acc[c] / l
    L[r] = m + math.log(l)


@cuda.jit(device=True)
def merge_averaging(O_part, L_part, r, acc, O, L):        # L right, O the plain mean of the partials
    n = 0
    m = -math.inf
    l = 0.0
    for c in range(acc.shape[0]):
        acc[c] = 0.0
    for s in range(L_part.shape[1]):
        L_s = L_part[r, s]
        if L_s == math.inf:
            continue
        n += 1
        m_new = max(m, L_s)
        l = l * math.exp(m - m_new) + math.exp(L_s - m_new)
        m = m_new
        for c in range(acc.shape[0]):
            acc[c] += O_part[r, s, c]
    for c in range(acc.shape[0]):
        O[r, c] = acc[c] / n if n else 0.0
    L[r] = m + math.log(l) if n else math.inf


@cuda.jit(device=True)
def merge_overflowing(O_part, L_part, r, acc, O, L):      # e^(L_s) itself: overflows for logits of 10⁴
    l = 0.0
    for c in range(acc.shape[0]):
        acc[c] = 0.0
    for s in range(L_part.shape[1]):
        L_s = L_part[r, s]
        if L_s == math.inf:
            continue
        w = math.exp(L_s)
        l += w
        for c in range(acc.shape[0]):
            acc[c] += w * O_part[r, s, c]
    for c in range(acc.shape[0]):
        O[r, c] = acc[c] / l if l > 0 else 0.0
    L[r] = math.log(l) if l > 0 else math.inf


# -- 14.1 fragment_coords --------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def coords_a1_a2_swapped(operand, lane, e):               # a1 as the right columns, a2 as the lower rows
    g, t = lane // 4, lane % 4
    if operand == 0:
        reg = e // 2
        return g + 8 * (reg // 2), 2 * t + 8 * (reg % 2) + e % 2
    if operand == 1:
        return 2 * t + 8 * (e // 2) + e % 2, g
    return g + 8 * (e // 2), 2 * t + e % 2


@cuda.jit(device=True)
def coords_b_as_n_k(operand, lane, e):                    # B's (k, n) given as (n, k)
    g, t = lane // 4, lane % 4
    if operand == 0:
        reg = e // 2
        return g + 8 * (reg % 2), 2 * t + 8 * (reg // 2) + e % 2
    if operand == 1:
        return g, 2 * t + 8 * (e // 2) + e % 2
    return g + 8 * (e // 2), 2 * t + e % 2


# -- 14.2 ldmatrix_row -----------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def ld_a_order_for_k(operand, lane, row0, col0, stride):  # A's order for both: K's b0/b1 and key halves mixed
    return (row0 + lane % 16) * stride + col0 + 8 * (lane // 16)


@cuda.jit(device=True)
def ld_stride_16(operand, lane, row0, col0, stride):      # a row of the buffer taken as 16 elements
    i, row = lane // 8, lane % 8
    if operand == 0:
        r, c = row + 8 * (i % 2), 8 * (i // 2)
    else:
        r, c = row + 8 * (i // 2), 8 * (i % 2)
    return (row0 + r) * 16 + col0 + c


# -- 14.3 finish_rows ------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def finish_every_lane_writes_L(o, m, l, lane, O, L):      # right values, each L written by four lanes
    g, t = lane // 4, lane % 4
    for h in range(2):
        row = g + 8 * h
        if row >= O.shape[0]:
            continue
        inv = 0.0 if l[h] == 0.0 else 1.0 / l[h]
        for n in range(O.shape[1] // 8):
            for e in range(2):
                O[row, 8 * n + 2 * t + e] = o[4 * n + 2 * h + e] * inv
        L[row] = math.inf if l[h] == 0.0 else m[h] + math.log(l[h])


@cuda.jit(device=True)
def finish_unguarded(o, m, l, lane, O, L):                # log 0 and 0/0 on a row that saw no key
    g, t = lane // 4, lane % 4
    for h in range(2):
        row = g + 8 * h
        if row >= O.shape[0]:
            continue
        for n in range(O.shape[1] // 8):
            for e in range(2):
                O[row, 8 * n + 2 * t + e] = o[4 * n + 2 * h + e] / l[h]
        if t == 0:
            L[row] = m[h] + math.log(l[h])


@cuda.jit(device=True)
def finish_without_row_guard(o, m, l, lane, O, L):        # the padding rows stored past the end of O
    g, t = lane // 4, lane % 4
    for h in range(2):
        row = g + 8 * h
        inv = 0.0 if l[h] == 0.0 else 1.0 / l[h]
        for n in range(O.shape[1] // 8):
            for e in range(2):
                O[row, 8 * n + 2 * t + e] = o[4 * n + 2 * h + e] * inv
        if t == 0:
            L[row] = math.inf if l[h] == 0.0 else m[h] + math.log(l[h])


@cuda.jit(device=True)
def finish_register_index_as_column(o, m, l, lane, O, L):   # column 4n + 2t + e: right for d_v = 8 only
    g, t = lane // 4, lane % 4
    for h in range(2):
        row = g + 8 * h
        if row >= O.shape[0]:
            continue
        inv = 0.0 if l[h] == 0.0 else 1.0 / l[h]
        for n in range(O.shape[1] // 8):
            for e in range(2):
                O[row, 4 * n + 2 * t + e] = o[4 * n + 2 * h + e] * inv
        if t == 0:
            L[row] = math.inf if l[h] == 0.0 else m[h] + math.log(l[h])


# (exercise, wrong answer, what the smallest failing case must show, a phrase the report must contain)
WRONG_ANSWERS = [
    ("9.2", row_stats_two_passes, lambda c: c["rows"] == c["cols"] == 1,
     "S: your code read 2 elements, the budget is 1 (each S[i, j] once) read: S[0, 0] twice (budget 1)"),
    ("9.3", update_rereading_S, lambda c: c["N_q"] == c["N_k"] == 1,
     "global memory over the budget: your code read 3 elements (budget 2)"),
    ("9.3", update_not_rescaling_o, lambda c: c["N_q"] == 1 and c["N_k"] == 2 and c["B_c"] == 1,
     "after key block 2 of 2 (keys 1:2): O_tilde: max |got − expected|"),
    ("9.3", update_unguarded, lambda c: c["mask"] != "none" and c["N_q"] <= 2 and c["N_k"] == 1,
     "l: NaN in 1 of"),
    ("9.4", kind_never_skips, lambda c: c["N_q"] == 2 and c["N_k"] == 1,
     "the tile of rows 0:1, keys 0:1 is fully masked (SKIP), yet tile_kind said MASK"),
    ("9.4", kind_top_left, lambda c: c["N_q"] < c["N_k"] <= 2,
     "expected PLAIN, got SKIP; query i sees key j iff j ≤ i + N_k − N_q = i + 1"),
    ("9.4", kind_never_plain, lambda c: c["N_q"] == c["N_k"] == c["B_r"] == c["B_c"] == 1,
     "expected PLAIN, got MASK"),
    ("13.3", merge_three_passes, lambda c: c["rows"] == c["n"] == c["splits"] == 1,
     "L_part: your code read 6 elements, the budget is 1 (each partial L once)"),
    ("13.3", merge_empty_split_as_heavy, lambda c: c["rows"] == 1 and c["splits"] == 2 and c["n"] == 1,
     "split 1 saw no key"),
    ("13.3", merge_averaging, lambda c: c["rows"] == 1 and c["n"] == c["splits"] == 2, "O: max |got − expected|"),
    ("13.3", merge_overflowing, lambda c: c["logits"] == "large" and c["n"] == c["splits"] == 1,
     "raised OverflowError"),
    ("14.1", coords_a1_a2_swapped, lambda c: c["values"] == "distinct",
     "register a1, low half (e = 2): expected (row, col) = (8, 0), got (0, 8)"),
    ("14.1", coords_b_as_n_k, lambda c: c["values"] == "distinct",
     "B (16 × 8): lane 0 (g = 0, t = 0), register b0, high half (e = 1): expected (k, n) = (1, 0), got (0, 1)"),
    ("14.2", ld_a_order_for_k, lambda c: c["operand"] == "K" and c["row0"] == 0 and c["stride"] == 16,
     "b1 of keys 0-7, low half: expected K[0, 8], got K[8, 0]"),
    ("14.2", ld_stride_16, lambda c: c["stride"] == 24 and c["row0"] == 0 and c["col0"] == 0,
     "matrix 1, which must be Q's rows 8-15, columns 0-7 (a1)"),
    ("14.3", finish_every_lane_writes_L, lambda c: c["N_q"] == c["N_k"] == c["tiles"] == 1,
     "L: your code wrote 4 elements, the budget is 1"),
    ("14.3", finish_unguarded, lambda c: c["mask"] != "none" and c["N_q"] <= 2 and c["N_k"] == 1,
     "raised ValueError"),
    ("14.3", finish_without_row_guard, lambda c: c["N_q"] == 1, "raised IndexError"),
    ("14.3", finish_register_index_as_column, lambda c: c["tiles"] == 2 and c["N_q"] == 1,
     "O: NaN in 4 of 16 entries"),
]


@pytest.mark.parametrize("exercise_id, wrong, minimal, phrase", WRONG_ANSWERS,
                         ids=[f"{e}-{w.__name__}" for e, w, _, _ in WRONG_ANSWERS])
def test_wrong_kernel_step_fails_on_a_small_case(exercise_id, wrong, minimal, phrase) -> None:
    result = exercises.check(exercise_id, wrong, verbose=False)
    assert not result and result.attempted, f"{wrong.__name__} passed exercise {exercise_id}"
    assert minimal(result.failure.case), f"not the expected small case: {result.failure.case}\n{result.report}"
    assert phrase in flat(result.report), result.report
    assert "Smallest failing case found" in result.report


def test_budget_failures_give_both_numbers() -> None:
    """Right values and too many reads (or writes) fail with the count, the budget, what the budget means and the
    element moved too often; a wrong value reports the case's traffic beside its budget too."""
    reads = exercises.check("9.3", update_rereading_S, verbose=False)
    text = flat(reads.report)
    assert "global memory over the budget: your code read 3 elements (budget 2) and wrote 0 (budget 0)" in text
    assert "S: your code read 2 elements, the budget is 1 (each S[i, j] once: keep the block's scores in s)" in text
    assert "read: S[0, 0] twice (budget 1)" in text and "keep a value you need again in a local variable" in text
    writes = exercises.check("14.3", finish_every_lane_writes_L, verbose=False)
    text = flat(writes.report)
    assert "your code read 0 elements (budget 0) and wrote 12 (budget 9)" in text, writes.report
    assert "wrote: L[0] 4 times (budget 1)" in text
    value = exercises.check("13.3", merge_averaging, verbose=False)
    assert "Global memory on this case: your code read 4 elements (budget 4) and wrote 2 (budget 2)" \
        in flat(value.report), value.report


def test_pass_reports_the_traffic_beside_the_budget() -> None:
    """The pass report sums the launches' traffic; a solution may move less than the budget (9.3's skips V for a
    block it has seen nothing of), never more; 14.3's writes are exactly its budget."""
    def numbers(report: str) -> list[int]:
        text = flat(report).split("launches: your code read ")[1]
        return [int(x.replace(",", "")) for x in re.findall(r"([\d,]+)(?: elements)? \(budget ([\d,]+)\)", text)
                for x in x]

    result = exercises.check("9.3", exercises.solution("9.3"), verbose=False)
    assert f"Global memory, all {result.cases} launches: your code read" in flat(result.report)
    reads, budget_reads, writes, budget_writes = numbers(result.report)
    assert 0 < reads <= budget_reads and writes == budget_writes == 0, result.report
    finish = exercises.check("14.3", exercises.solution("14.3"), verbose=False)
    reads, budget_reads, writes, budget_writes = numbers(finish.report)
    assert reads == budget_reads == 0 and 0 < writes == budget_writes, finish.report


def test_device_function_contract() -> None:
    """A plain Python function is compiled as a device function; a kernel where a device function is asked for
    is refused with a clear message; a stub is 'not attempted'; row views (S[i][j]) are counted as elements."""
    def tile_kind(row0, row1, col0, col1, N_q, N_k):
        if col0 > row1 - 1 + N_k - N_q:
            return SKIP
        return PLAIN if col1 - 1 <= row0 + N_k - N_q else MASK

    assert exercises.check("9.4", tile_kind, verbose=False)
    kernel = exercises.check("9.4", cuda.jit(tile_kind), verbose=False)
    assert "asks for a device function, @cuda.jit(device=True)" in flat(kernel.report), kernel.report

    @cuda.jit(device=True)
    def stub(row0, row1, col0, col1, N_q, N_k):
        raise NotImplementedError("your code here")

    assert not exercises.check("9.4", stub, verbose=False).attempted

    def merge_by_rows(O_part, L_part, r, acc, O, L):         # the solution through row views
        right = exercises.solution("13.3").py_func
        return right(O_part[r:r + 1], L_part[r:r + 1], 0, acc, O[r:r + 1], L[r:r + 1])

    assert exercises.check("13.3", merge_by_rows, verbose=False)


def test_sys_exit_in_a_simulated_thread_is_reported() -> None:
    """sys.exit inside a device function would end its simulated thread silently; it is a failure, with the line."""
    @cuda.jit(device=True)
    def online_update(S, V, i, j0, j1, s, o, ml):
        sys.exit(2)

    result = exercises.check("9.3", online_update, verbose=False)
    text = flat(result.report)
    assert not result and result.attempted
    assert "SystemExit(2)" in text and "sys.exit(2)" in text and "ended its simulated thread silently" in text


def test_the_exercises_never_import_kernels_gpu() -> None:
    """DESIGN.md's one-way rule: the checkers import no kernels_gpu module, not even inside a function (the fragment
    layouts they check against are written out in fa2edu.exercises)."""
    for path in (ROOT / "fa2edu" / "exercises.py", ROOT / "fa2edu" / "exercise_kernels.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "kernels_gpu" or n.startswith("kernels_gpu.") for n in names), path.name
