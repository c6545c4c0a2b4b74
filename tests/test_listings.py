"""fa2edu.listings: the steps a function's comments cite, the NumPy ↔ kernel table of chapter 9, the listings."""

import ast
import inspect
import re
import textwrap

from fa2edu import flash2, listings
from kernels_gpu.flash2 import forward_kernel


def _toy(x, y):
    """A toy with the comment forms the real code uses."""
    z = x + 1                       # set-up: no step
    # Alg. 1 line 8: the first citation
    # Alg. 1 line 9 (first part): a second citation right under it joins the same step
    a = x * y                       # a trailing comment is not code
    if a > 0:
        b = a - 1
    # Alg. 1 lines 12-13, 15: a range and a list
    c = a + b

    d = c + z                       # after a blank line: in no step
    for k in range(3):
        # Alg. 1 line 14: ends with its block
        d += k
    # Alg. 1 line 16: a block whose body cites a line of its own leaves its header to neither step
    e = d * 2
    if e > 0:
        # Alg. 1 line 17: inside the block
        e -= 1
    return e


def test_steps_merge_consecutive_citations_and_end_at_blank_lines_and_dedents():
    steps = listings.algorithm_steps(_toy)
    assert [s.lines for s in steps] == [(8, 9), (12, 13, 15), (14,), (16,), (17,)]
    assert steps[0].code == ["a = x * y", "if a > 0:", "    b = a - 1"]
    assert steps[1].code == ["c = a + b"]
    assert steps[2].code == ["d += k"]
    assert steps[3].code == ["e = d * 2"] and steps[4].code == ["e -= 1"]
    _, first = inspect.getsourcelines(_toy)
    source = inspect.getsource(_toy).splitlines()
    for step in steps:
        assert "Alg. 1 line" in source[step.first - first]
        assert source[step.last - first].strip().endswith(step.code[-1].strip())


def test_chapter_9_table_pairs_every_kernel_step_with_the_same_line_of_the_numpy_code():
    rows = listings.correspondence(flash2.flash2_forward, forward_kernel)
    kernel_lines = {row.line for row in rows if row.right}
    # The kernel cites every step of the loop body; the NumPy code cites every line the kernel cites.
    assert set(range(4, 11)) | set(range(12, 16)) <= kernel_lines
    assert kernel_lines <= {row.line for row in rows if row.left}
    by_line = {row.line: row for row in rows}
    # Line 13 (L = m + log ℓ) is the log-sum-exp on both sides; the kernel factory's `return` is in no step.
    assert any("math.log" in code for step in by_line[13].right for code in step.code)
    assert any("np.log" in code for step in by_line[13].left for code in step.code)
    assert all("return flash2_forward_kernel" not in code
               for row in rows for step in row.right for code in step.code)


def test_markdown_table_has_one_row_per_line_and_three_cells_per_row():
    table = listings.correspondence_markdown(flash2.flash2_forward, forward_kernel,
                                             titles=("NumPy", "kernel"), missing={2: ("-", "the launch")})
    rows = listings.correspondence(flash2.flash2_forward, forward_kernel)
    body = table.splitlines()[2:]
    assert len(body) == len(rows)
    for row, line in zip(rows, body):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 3 and cells[0].strip() == str(row.line)
    assert "*the launch*" in body[[r.line for r in rows].index(2)]
    # The kernel's step for lines 13 and 15 is shown at 13; row 15 points up to it.
    kernel_15 = re.split(r"(?<!\\)\|", body[[r.line for r in rows].index(15)])[3]
    assert "the step of line 13, above" in kernel_15 and "math.log" not in kernel_15


def _without_docstrings(code: str) -> str:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def test_listing_is_the_same_program_with_its_comments_fitted():
    for function in (flash2.flash2_forward, forward_kernel):
        text, first, last = listings.listing(function, width=88)
        original = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        assert _without_docstrings(text) == _without_docstrings(original)
        # Only code lines that were already too long may overflow; no comment or docstring line does.
        long_code = {line.split("  #")[0].strip() for line in original.splitlines()}
        for line in text.splitlines():
            assert len(line) <= 88 or (line.strip() in long_code and not line.lstrip().startswith("#"))
        assert last - first + 1 == len(original.splitlines())
