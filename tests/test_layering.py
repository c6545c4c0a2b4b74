"""Imports go one way (DESIGN.md): fa2edu ← kernels_gpu ← benchmarks, and inside each package bottom to top.

The graph is read from the import statements of every module's source (top-level and inside functions alike: a
lazy import is still an arrow), so an arrow that runs back up fails here before it confuses a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(package: str) -> dict[str, set[str]]:
    """{module: the modules it imports}, dotted names, for every module of ``package`` (its own and others')."""
    graph = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` names a module when pkg.mod exists; else it names an attribute of pkg
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    module_path = ROOT / Path(*candidate.split("."))
                    found.add(candidate if module_path.with_suffix(".py").exists() or module_path.is_dir()
                              else node.module)
        graph[name] = {m for m in found if m.split(".")[0] in ("fa2edu", "kernels_gpu", "benchmarks")} - {name}
    return graph


def within(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def cycles(graph: dict[str, set[str]], group) -> list[str]:
    """Groups (``group(module)``) that reach themselves through the import graph."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = group(module), group(target)
            if a != b:
                edges.setdefault(a, set()).add(b)

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, seen + (m,))) for m in edges.get(start, ()))
    return sorted(g for g in edges if reaches(g, g))


#: The PyTorch integration (DESIGN.md's op and context parallelism) sends CUDA tensors to the GPU kernels: these
#: modules, and only these, import kernels_gpu, inside the functions that launch them (``import fa2edu`` never does).
TORCH_INTEGRATION = {"fa2edu._torch_ops", "fa2edu.distributed"}


def test_fa2edu_imports_neither_kernels_gpu_nor_benchmarks() -> None:
    graph = imports("fa2edu")
    wrong = {m: sorted(t for t in ts if within(t, "kernels_gpu", "benchmarks")) for m, ts in graph.items()}
    wrong = {m: ts for m, ts in wrong.items()
             if ts and not (m in TORCH_INTEGRATION and not any(within(x, "benchmarks") for x in ts))}
    assert not wrong, "fa2edu must work without kernels_gpu (DESIGN.md)"
    # and the integration imports it lazily: not at the top of the module
    for module in TORCH_INTEGRATION:
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        top = ast.parse(path.read_text(encoding="utf-8")).body
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if within(n, "kernels_gpu")], f"{module} imports kernels_gpu at import time"


#: fa2edu's tiers that FlexAttention sits between: it builds on these (masks, the FA2 loops, the memory model, the
#: checks) and nothing it builds on may import it back; above it, only the package, fa2edu.io and the PyTorch
#: integration may.
FLEX_BUILDS_ON = {"fa2edu.blocks", "fa2edu.flash2", "fa2edu.masks", "fa2edu.memory", "fa2edu.softmax",
                  "fa2edu.validation"}
FLEX_USERS = {"fa2edu", "fa2edu.io", "fa2edu.torch", "fa2edu._torch_ops", "fa2edu.exercises", "fa2edu.cli"}


def test_flex_builds_on_the_fa2_algorithm_and_nothing_below_imports_it() -> None:
    graph = imports("fa2edu")
    assert "fa2edu.flex" in graph and graph["fa2edu.flex"] <= FLEX_BUILDS_ON, sorted(graph["fa2edu.flex"])
    below, frontier = set(), set(graph["fa2edu.flex"])
    while frontier:                                     # everything flex reaches, directly or not
        module = frontier.pop()
        below.add(module)
        frontier |= graph.get(module, set()) - below
    assert "fa2edu.flex" not in below, "an import cycle through fa2edu.flex"
    users = {m for m, targets in graph.items() if "fa2edu.flex" in targets}
    assert users <= FLEX_USERS, sorted(users - FLEX_USERS)


#: FP8 attention (fa2edu.fp8) builds on FA2's Algorithm 1, the oracle (its error study), the memory model and the
#: checks; nothing it builds on imports it back, and above it only the package and the PyTorch integration may
#: (DESIGN.md's ``fa2edu.torch.quantize_fp8`` and the Hopper FP8 kernel's inputs).
FP8_BUILDS_ON = {"fa2edu.blocks", "fa2edu.flash2", "fa2edu.masks", "fa2edu.memory", "fa2edu.reference",
                 "fa2edu.softmax", "fa2edu.validation"}
FP8_USERS = {"fa2edu", "fa2edu.torch", "fa2edu._torch_ops", "fa2edu.exercises", "fa2edu.cli"}


def test_fp8_builds_on_the_fa2_algorithm_and_nothing_below_imports_it() -> None:
    graph = imports("fa2edu")
    assert "fa2edu.fp8" in graph and graph["fa2edu.fp8"] <= FP8_BUILDS_ON, sorted(graph["fa2edu.fp8"])
    below, frontier = set(), set(graph["fa2edu.fp8"])
    while frontier:                                     # everything fp8 reaches, directly or not
        module = frontier.pop()
        below.add(module)
        frontier |= graph.get(module, set()) - below
    assert "fa2edu.fp8" not in below, "an import cycle through fa2edu.fp8"
    users = {m for m, targets in graph.items() if "fa2edu.fp8" in targets}
    assert users <= FP8_USERS, sorted(users - FP8_USERS)


def test_kernels_gpu_never_imports_benchmarks() -> None:
    graph = imports("kernels_gpu")
    wrong = {m: sorted(t for t in ts if within(t, "benchmarks")) for m, ts in graph.items()}
    assert not {m: ts for m, ts in wrong.items() if ts}


def test_the_benchmarks_are_layered_harness_drivers_profilers() -> None:
    graph = imports("benchmarks")
    harness = {m for m in graph if within(m, "benchmarks.harness")}
    profilers = {m for m in graph if within(m, "benchmarks.profilers")}
    drivers = set(graph) - harness - profilers - {"benchmarks"}
    assert {"benchmarks.harness.timing", "benchmarks.harness.impls", "benchmarks.decode",
            "benchmarks.profilers.decode_host"} <= set(graph)
    # the harness imports only the harness; what is timed (impls) is its bottom
    for module in harness:
        assert {t for t in graph[module] if within(t, "benchmarks")} <= harness, module
    assert not {t for t in graph["benchmarks.harness.impls"] if within(t, "benchmarks")}
    assert {t for t in graph["benchmarks.harness.timing"] if within(t, "benchmarks")} <= {
        "benchmarks.harness.impls", "benchmarks.harness.flop_model", "benchmarks.harness.results_io",
        "benchmarks.harness.torch_allocator"}
    # the drivers build on the harness, never on a profiler
    for module in drivers:
        assert not graph[module] & profilers, f"{module} imports a profiler"
    assert "benchmarks.harness.timing" in graph["benchmarks.bench_attention"]
    # nothing imports a profiler but another profiler
    for module in harness | drivers:
        assert not graph[module] & profilers, module
    assert not cycles(graph, lambda m: m), "import cycles between benchmark modules"


#: kernels_gpu, bottom first: what every kernel family shares (devices and layouts, the PTX instructions and their
#: simulator twins, the fragment layouts, launches through the driver, tensor maps, traffic counting), then the
#: families, each of which may build on the ones before it: the teaching kernels, the fast CUDA-core kernels, the
#: tensor-core ladder, the inference kernels and FlexAttention (built on the ladder's steps). Tools
#: (``kernels_gpu.sanitize``) and the package itself sit on top.
KERNEL_TIERS = [
    {"runtime", "counting", "driver_launch", "tensor_map", "ptx", "fragments", "wgmma_layout"},
    {"standard", "flash1", "flash2"},
    {"fast"},
    {"tensorcore"},
    {"inference", "hopper", "flex"},
]


def _kernel_tier(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None                       # the package itself: the public façade (and numba's shim), on top
    for tier, names in enumerate(KERNEL_TIERS):
        if parts[1] in names:
            return tier
    return None                           # tools on top (sanitize)


def test_kernels_gpu_is_layered_bottom_to_families() -> None:
    graph = imports("kernels_gpu")
    assert {"kernels_gpu.ptx", "kernels_gpu.fragments", "kernels_gpu.inference.decode",
            "kernels_gpu.inference.varlen"} <= set(graph)
    upward = []
    for module, targets in graph.items():
        tier = _kernel_tier(module)
        if tier is None:
            continue
        for target in targets:
            if not within(target, "kernels_gpu"):
                continue
            if target == "kernels_gpu" and tier > 0:
                continue                  # `import kernels_gpu` for the package's import-time set-up
            other = _kernel_tier(target)
            if other is None or other > tier or (tier == 0 and other != 0):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run back up kernels_gpu's layers:\n" + "\n".join(sorted(upward))
    # the shared PTX module lives at the bottom, not inside a family
    assert not (ROOT / "kernels_gpu" / "tensorcore" / "ptx.py").exists()
