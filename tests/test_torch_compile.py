"""fa2edu.torch as a registered PyTorch operator: ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)``.

* ``opcheck`` (schema, autograd registration, fake implementation, AOT dispatch with dynamic shapes) passes for
  every forward and backward operator on the CPU in float32 and float64, with causal masks, GQA, N_q ≠ N_k and
  d_v ≠ d.
* A one-layer attention module that calls ``flash_attention`` compiles with ``fullgraph=True`` (no graph break:
  the op is opaque to the tracer, its fake implementation gives the shapes), and the compiled forward, its
  ``return_lse`` output and the backward equal eager mode's. The default backend (Inductor) needs a C++ compiler on
  the CPU; the AOT-autograd backend checks the same tracing without code generation.
"""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from fa2edu import _torch_ops as ops  # noqa: E402
from fa2edu.torch import flash_attention  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tensors(*shapes, dtype, seed=0, requires_grad=True):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=dtype, generator=generator).requires_grad_(requires_grad) for shape in shapes]


# -- opcheck -----------------------------------------------------------------------------------------------------------

# (q, k, v shapes, causal, block sizes): GQA 4:2 with N_q = 5 < N_k = 7 and d_v ≠ d; causal N_q = 6 > N_k = 4
# (fully masked rows, L = +inf) on one head.
CASES = {"gqa": ((1, 4, 5, 3), (1, 2, 7, 3), (1, 2, 7, 4), False, [2, 3]),
         "causal-masked-rows": ((2, 1, 6, 5), (2, 1, 4, 5), (2, 1, 4, 5), True, [4, 2])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_opcheck_flash2(case, dtype):
    *shapes, causal, block_sizes = CASES[case]
    q, k, v = tensors(*shapes, dtype=dtype)
    result = torch.library.opcheck(ops.flash_attention_fwd, (q, k, v, causal, 0.4, "numpy", block_sizes, None))
    assert set(result.values()) == {"SUCCESS"}, result
    O, L = ops.flash_attention_fwd(q.detach(), k.detach(), v.detach(), causal, 0.4, "numpy", block_sizes, None)
    (dO,) = tensors(O.shape, dtype=dtype, seed=1, requires_grad=False)
    args = (dO, q.detach(), k.detach(), v.detach(), O, L, causal, 0.4, "numpy", block_sizes, None)
    result = torch.library.opcheck(ops.flash_attention_bwd, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("op", [ops.flash1_attention_fwd, ops.standard_attention_fwd])
def test_opcheck_flash1_and_standard(op):
    *shapes, causal, block_sizes = CASES["gqa"]
    q, k, v = tensors(*shapes, dtype=torch.float64)
    sizes = None if op is ops.standard_attention_fwd else block_sizes
    result = torch.library.opcheck(op, (q, k, v, True, 0.4, "numpy", sizes, None))
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_through_the_public_function():
    # flash_attention's own arguments (default scale, return_lse) reach the operator the same way
    q, k, v = tensors((1, 4, 5, 6), (1, 2, 7, 6), (1, 2, 7, 6), dtype=torch.float32)
    (O, L) = flash_attention(q, k, v, causal=True, return_lse=True)
    assert O.requires_grad and not L.requires_grad and L.dtype == torch.float32
    result = torch.library.opcheck(ops.flash_attention_fwd, (q, k, v, True, 6 ** -0.5, "numpy", None, None))
    assert set(result.values()) == {"SUCCESS"}, result


# -- torch.compile(fullgraph=True) ----------------------------------------------------------------------------------

class Attention(torch.nn.Module):
    """One attention layer as in a GPT: q, k, v as transposed (non-contiguous) views of one projection, GQA by
    keeping the first ``kv_heads`` heads of k and v, the op, an output projection; returns (y, L)."""

    def __init__(self, d_model=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (t.view(B, N, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        y, L = flash_attention(q, k[:, :self.kv_heads], v[:, :self.kv_heads], causal=True, return_lse=True)
        return self.proj(y.transpose(1, 2).reshape(B, N, C)), L


def eager_and_compiled(backend):
    torch.manual_seed(0)
    model = Attention().double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    runs = []
    for run in (model, torch.compile(model, fullgraph=True, backend=backend)):
        model.zero_grad(set_to_none=True)
        y, L = run(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
        runs.append([y.detach(), L] + [p.grad.clone() for p in model.parameters()])
    return runs


def assert_equal_runs(eager, compiled):
    assert len(eager) == len(compiled) == 2 + 4          # y, L, and the gradients of 2 weights and 2 biases
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_compile_fullgraph_traces_forward_and_backward():
    torch._dynamo.reset()
    assert_equal_runs(*eager_and_compiled("aot_eager"))


def test_compile_traces_the_registered_operators():
    # Under torch.compile flash_attention takes the traced road: the graph Dynamo hands its backend calls the
    # registered forward operator (opaque, with its fake implementation), not the eager road's Function.
    torch._dynamo.reset()
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    model = Attention().double()
    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(2, 9, 16, dtype=torch.float64))
    assert any("flash_attention_fwd" in target for target in targets), targets
    assert not any("Flash2" in target for target in targets), targets


def test_jit_trace_records_the_registered_operator():
    # torch.jit.trace takes the traced road too: its graph calls fa2edu::flash_attention_fwd, which TorchScript
    # can save and load, not the eager road's Python Function (a prim::PythonOp it cannot save).
    q, k, v = tensors((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 4), dtype=torch.float32, requires_grad=False)
    traced = torch.jit.trace(lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v), check_trace=False)
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert "fa2edu::flash_attention_fwd" in kinds and "prim::PythonOp" not in kinds, kinds
    assert torch.equal(traced(q, k, v), flash_attention(q, k, v, causal=True))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="Inductor compiles C++ on the CPU and finds no compiler")
def test_compile_fullgraph_default_backend():
    torch._dynamo.reset()
    assert_equal_runs(*eager_and_compiled("inductor"))
