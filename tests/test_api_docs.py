"""The API reference documents every parameter of every public function.

The reference (docs/api.md) renders docstrings with napoleon, so a parameter is documented only if it has an entry
in the docstring's *Parameters* section (NumPy style, ``name : type`` then an indented description) or *Args*
section (Google style, ``name (type): description``). Prose that happens to mention ``Q`` does not count.

Public means: everything in ``fa2edu.__all__`` and ``kernels_gpu.__all__`` that can be called, and
``fa2edu.torch.flash_attention`` and ``flex_attention``. A class documents its constructor's parameters (the fields
of a NamedTuple or a dataclass) in its own docstring, under *Parameters* or *Attributes*. Each entry needs a
description, and a parameter with a default value says what the default is (the word "default" in its entry).
"""

from __future__ import annotations

import inspect
import re

import pytest

import fa2edu
import kernels_gpu

# Section titles napoleon renders as parameter lists (its own aliases), and the ones a class may use for fields.
PARAMETER_SECTIONS = {"parameters", "params", "args", "arguments", "other parameters", "keyword args",
                      "keyword arguments"}
CLASS_SECTIONS = PARAMETER_SECTIONS | {"attributes"}
GOOGLE_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
GOOGLE_ENTRY = re.compile(r"^\**(\w+)\s*(?:\(([^)]*)\))?\s*:(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _numpy_sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(title, first body line, end) of every NumPy-style section: a title underlined with dashes."""
    starts = [(lines[k].strip().lower(), k) for k in range(len(lines) - 1)
              if lines[k].strip() and re.fullmatch(r"-{3,}", lines[k + 1].strip())
              and _indent(lines[k]) == _indent(lines[k + 1])]
    ends = [k for _, k in starts[1:]] + [len(lines)]
    return [(title, k + 2, end) for (title, k), end in zip(starts, ends)]


def _numpy_entries(body: list[str]) -> dict[str, tuple[str, str]]:
    """``name[, name] : type`` lines at the section's indentation, each with its indented description."""
    entries: dict[str, tuple[str, str]] = {}
    base = min((_indent(line) for line in body if line.strip()), default=0)
    names: list[str] = []
    for line in body:
        if not line.strip():
            continue
        if _indent(line) == base:
            head, _, kind = line.strip().partition(" : ")
            names = [n.strip().lstrip("*").strip("`") for n in head.rstrip(":").split(",")]
            names = [n for n in names if n]
            for n in names:
                entries[n] = (kind.strip(), "")
        else:
            for n in names:
                entries[n] = (entries[n][0], f"{entries[n][1]} {line.strip()}".strip())
    return entries


def _google_entries(lines: list[str], sections: set[str]) -> dict[str, tuple[str, str]]:
    """``name (type): description`` entries of Google-style sections (``Args:`` and its aliases)."""
    entries: dict[str, tuple[str, str]] = {}
    k = 0
    while k < len(lines):
        header = GOOGLE_HEADER.match(lines[k].strip())
        if not header or header.group(1).lower() not in sections:
            k += 1
            continue
        top, k, entry_indent, name = _indent(lines[k]), k + 1, None, None
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > top):
            line = lines[k]
            k += 1
            if not line.strip():
                continue
            entry_indent = _indent(line) if entry_indent is None else entry_indent
            match = GOOGLE_ENTRY.match(line.strip()) if _indent(line) == entry_indent else None
            if match:
                name = match.group(1)
                entries[name] = ((match.group(2) or "").strip(), match.group(3).strip())
            elif name is not None:
                entries[name] = (entries[name][0], f"{entries[name][1]} {line.strip()}".strip())
    return entries


def documented_parameters(doc: str | None,
                          sections: set[str] = PARAMETER_SECTIONS) -> dict[str, tuple[str, str]]:
    """Map each parameter a docstring documents (in the given sections) to its entry: (type, description)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    entries: dict[str, tuple[str, str]] = {}
    for title, start, end in _numpy_sections(lines):
        if title in sections:
            entries.update(_numpy_entries(lines[start:end]))
    entries.update(_google_entries(lines, sections))
    return entries


def signature_parameters(obj) -> list[inspect.Parameter]:
    """The parameters a caller passes: the function's, or the constructor's of a class (without self)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):      # exceptions and other classes with no Python-level constructor
        return []
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls")]


def problems(obj) -> list[str]:
    """What the docstring of ``obj`` leaves undocumented; empty when every parameter has a full entry."""
    sections = CLASS_SECTIONS if inspect.isclass(obj) else PARAMETER_SECTIONS
    entries = documented_parameters(inspect.getdoc(obj) if inspect.isclass(obj) else obj.__doc__, sections)
    found = []
    for p in signature_parameters(obj):
        name = p.name
        if name not in entries:
            found.append(f"parameter {name!r} has no entry in the Parameters section")
        elif not entries[name][1]:
            found.append(f"parameter {name!r} has an entry with no description")
        elif p.default is not inspect.Parameter.empty and "default" not in " ".join(entries[name]).lower():
            found.append(f"parameter {name!r} defaults to {p.default!r} but its entry does not say so")
    return found


def public_objects() -> dict[str, object]:
    """Every public callable of the two packages, by its public name."""
    found = {f"fa2edu.{n}": getattr(fa2edu, n) for n in fa2edu.__all__}
    found.update({f"kernels_gpu.{n}": getattr(kernels_gpu, n) for n in kernels_gpu.__all__})
    return {name: obj for name, obj in found.items() if callable(obj)}


PUBLIC = public_objects()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_function_documents_every_parameter(name):
    found = problems(PUBLIC[name])
    assert not found, f"{name}: " + "; ".join(found)


@pytest.mark.parametrize("name", ["flash_attention", "flex_attention"])
def test_torch_op_documents_every_parameter(name):
    pytest.importorskip("torch")
    import fa2edu.torch
    found = problems(getattr(fa2edu.torch, name))
    assert not found, f"fa2edu.torch.{name}: " + "; ".join(found)


# -- the parser itself: it must see a missing parameter that the prose mentions, in both styles ------------------

def _numpy_style(Q, K, V, causal=False):
    """Attention of Q, K and V (the prose names Q, K, V and causal).

    Parameters
    ----------
    Q, K : ndarray
        Queries (..., N, d) and keys (..., N, d).
    causal : bool, optional
        Mask the future. Default: False.

    Returns
    -------
    V : ndarray
        Not a parameter entry: the Returns section does not count.
    """


def _google_style(Q, K, V, scale=None):
    """Attention of Q, K and V.

    Args:
        Q (ndarray): Queries (..., N, d),
            continued on a second line.
        K (ndarray): Keys.
        scale (float, optional): The softmax scale τ.

    Returns:
        V: not a parameter entry.
    """


def test_parser_reads_numpy_sections_and_flags_the_missing_parameter():
    entries = documented_parameters(_numpy_style.__doc__)
    assert set(entries) == {"Q", "K", "causal"}
    assert entries["K"] == ("ndarray", "Queries (..., N, d) and keys (..., N, d).")
    assert problems(_numpy_style) == ["parameter 'V' has no entry in the Parameters section"]


def test_parser_reads_google_sections_and_asks_for_defaults():
    entries = documented_parameters(_google_style.__doc__)
    assert set(entries) == {"Q", "K", "scale"}
    assert entries["Q"] == ("ndarray", "Queries (..., N, d), continued on a second line.")
    assert problems(_google_style) == ["parameter 'V' has no entry in the Parameters section",
                                       "parameter 'scale' defaults to None but its entry does not say so"]


def test_parser_agrees_with_napoleon():
    """Where Sphinx is installed, napoleon renders exactly the entries this parser finds (no more, no fewer)."""
    napoleon = pytest.importorskip("sphinx.ext.napoleon")
    config = napoleon.Config(napoleon_use_param=True, napoleon_use_keyword=True, napoleon_use_ivar=True)
    for name, obj in list(PUBLIC.items()) + [("_numpy_style", _numpy_style), ("_google_style", _google_style)]:
        doc = inspect.getdoc(obj) or ""
        rest = str(napoleon.GoogleDocstring(str(napoleon.NumpyDocstring(doc, config)), config))
        rendered = set(re.findall(r"^:(?:param|keyword|ivar)\s+(?:[^:]*\s)?\\?\**(\w+):", rest, re.MULTILINE))
        sections = CLASS_SECTIONS if inspect.isclass(obj) else PARAMETER_SECTIONS
        assert set(documented_parameters(doc, sections)) == rendered, name


# -- the built site's internal links (docs/check_links.py, run by scripts/build_docs.sh) ------------------------

def test_link_checker_finds_a_link_to_a_missing_anchor(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "check_links", Path(__file__).resolve().parent.parent / "docs" / "check_links.py")
    check_links = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_links)
    (tmp_path / "_modules").mkdir()
    (tmp_path / "api.html").write_text('<dl><dt id="fa2edu.flash2.flash2_forward">flash2_forward</dt></dl>')
    (tmp_path / "_modules" / "flash2.html").write_text(
        '<a href="../api.html#fa2edu.flash2.flash2_forward">[docs]</a>'
        '<a href="../api.html#kernels_gpu.flash2.Flash2Forward">[docs]</a>'
        '<a href="../gone.html">gone</a><a href="https://example.org/#x">outside</a>')
    broken = check_links.broken_links(tmp_path)
    assert len(broken) == 2
    assert "no anchor #kernels_gpu.flash2.Flash2Forward" in broken[0] and "no such page" in broken[1]
