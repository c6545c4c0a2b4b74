"""How the tensor-core path lays out what it reads and writes, checked without a GPU.

The tensor-core kernels read strided q, k, v, O, dO where they lie and lay O, dQ, dK, dV out like q, k, v
(``kernels_gpu.tensorcore.launch``: ``zero_copy``, ``layout_order``, ``layout_strides``, ``empty_like_layout``). The
custom operators' fake implementations must promise the same strides the kernels deliver, or a traced graph would
assume another layout: checked here under PyTorch's FakeTensorMode, which runs the fakes only. The kernels' side —
strided inputs giving the same bits as contiguous ones, outputs in these layouts — is in
``tests/gpu/test_torch_gpu.py``; the stride-following copies themselves run in the simulator in
``tests/test_tensorcore.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fa2edu.torch  # noqa: E402,F401  (registers the fa2edu operators)
from kernels_gpu.tensorcore.launch import (  # noqa: E402
    Buffer,
    empty_like_layout,
    layout_order,
    layout_strides,
    zero_copy,
)


def projection_views(B=2, N=5, H=3, d=8, dtype=torch.float16):
    """q, k, v as a GPT makes them: (B, H, N, d) views of one (B, N, 3·H·d) projection."""
    qkv = torch.randn(B, N, 3 * H * d).to(dtype)
    return tuple(t.view(B, N, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=2))


def test_output_of_a_transposed_view_is_bnhd_in_memory():
    q, _, _ = projection_views()
    assert not q.is_contiguous() and layout_order(q) == [0, 2, 1, 3]
    O = empty_like_layout(q)
    assert O.shape == q.shape and O.stride() == layout_strides(q)
    # the caller's transpose(1, 2).reshape(B, N, H·d) is a view: no copy
    flat = O.transpose(1, 2).reshape(O.shape[0], O.shape[2], -1)
    assert flat.data_ptr() == O.data_ptr() and O.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (1, 3, 5, 8), (3, 1, 7, 16), (4, 9, 8)])
def test_a_contiguous_input_gives_a_contiguous_output(shape):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    assert empty_like_layout(x).is_contiguous()
    assert layout_strides(x) == x.stride()
    assert empty_like_layout(x, shape[:-1] + (24,), torch.float32).is_contiguous()


def test_the_last_axis_stays_contiguous_whatever_the_input():
    x = torch.zeros(4, 6, 8).transpose(1, 2)             # last axis of stride 8
    O = empty_like_layout(x)
    assert O.stride(-1) == 1 and layout_order(x)[-1] == 2


def test_zero_copy_needs_a_contiguous_last_axis_and_16_byte_rows():
    q, _, _ = projection_views(d=8)                       # rows 3·3·8·2 = 144 bytes apart: aligned
    assert zero_copy(q)
    assert not zero_copy(torch.zeros(4, 8, dtype=torch.float16).t())       # last axis strided
    assert not zero_copy(torch.zeros(2, 5, 12, dtype=torch.float16)[..., :4])  # rows 24 bytes apart
    assert not zero_copy(torch.zeros(2, 5, 16, dtype=torch.float16)[..., 4:12])  # first element 8 bytes in


def test_buffer_keeps_the_strides_of_a_view_in_words():
    q, _, _ = projection_views(B=2, N=5, H=3, d=8)
    buf = Buffer.of_torch(q, "uint32")
    assert buf.shape == (2, 3, 5, 4)
    assert buf.strides == tuple(2 * n for n in q.stride()[:-1]) + (4,)
    assert not buf.contiguous and buf.numba_type().layout == "A"
    with pytest.raises(ValueError, match="last axis contiguous"):
        Buffer.of_torch(torch.zeros(4, 8, dtype=torch.float16).t(), "uint32")
    with pytest.raises(ValueError, match="whole"):
        Buffer.of_torch(torch.zeros(3, 7, dtype=torch.float16)[:, :4], "uint32")   # rows 14 bytes apart


def test_fakes_promise_the_kernels_layouts():
    """Under FakeTensorMode the operators run their fakes: the tensor-core path promises O, dQ, dK, dV laid out
    like q, k, v (what the kernels deliver), every other backend contiguous results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in projection_views(dtype=torch.bfloat16))
        O, L = torch.ops.fa2edu.flash_attention_fwd(q, k, v, True, 0.35, "tensorcore", None, None)
        assert O.stride() == layout_strides(q) and not O.is_contiguous() and L.is_contiguous()
        dO = torch.empty_like(O)
        grads = torch.ops.fa2edu.flash_attention_bwd(dO, q, k, v, O, L, True, 0.35, "tensorcore", None, None)
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and g.stride() == layout_strides(x)
        O_np, _ = torch.ops.fa2edu.flash_attention_fwd(q.float(), k.float(), v.float(), True, 0.35, "numpy", None,
                                                      None)
        assert O_np.is_contiguous()


def test_fakes_with_symbolic_shapes():
    """torch.compile with dynamic shapes (and opcheck's AOT test) traces with symbolic sizes and strides, which do
    not hash: the layout helpers, memoised for plain integers, still answer, and answer as for real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    real = projection_views(dtype=torch.bfloat16)
    with FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False) as mode:
        q, k, v = (mode.from_tensor(t) for t in real)
        assert any(isinstance(n, torch.SymInt) for n in q.stride())
        assert layout_order(q) == layout_order(real[0])
        O, L = torch.ops.fa2edu.flash_attention_fwd(q, k, v, True, 0.35, "tensorcore", None, None)
        assert tuple(int(n) for n in O.stride()) == layout_strides(real[0])
        grads = torch.ops.fa2edu.flash_attention_bwd(torch.empty_like(O), q, k, v, O, L, True, 0.35, "tensorcore",
                                                     None, None)
        for g, x in zip(grads, real):
            assert tuple(int(n) for n in g.stride()) == layout_strides(x)


@pytest.mark.parametrize("make", ["contiguous", "projection view", "misaligned view", "leading axes"])
def test_a_plans_view_and_layout_repeat_the_first_call(make):
    """A plan (kernels_gpu.tensorcore.launch.ForwardPlan, BackwardPlan) works out once, from its first call's
    tensor, how to reach the kernels' 4-axis view (View: reshape? copy?) and how to allocate a result laid out like
    it (Layout); a later tensor of the same shape, strides, dtype and alignment — what the plan's key fixes — must
    then get what the full road gives it: the same view (in place or a contiguous copy) and the same strides."""
    from kernels_gpu.tensorcore.launch import Layout, View

    def tensor(seed):
        g = torch.Generator().manual_seed(seed)
        if make == "contiguous":
            return torch.randn(2, 3, 5, 8, generator=g).half()
        if make == "projection view":
            return projection_views()[0]
        if make == "misaligned view":                  # rows of 8 halves out of 12: not 16-byte aligned
            return torch.randn(2, 3, 5, 12, generator=g).half()[..., 4:]
        return torch.randn(2, 2, 3, 5, 8, generator=g).half()       # (B, G, H, N, d): folded into Z = 4

    shape4 = (4, 3, 5, 8) if make == "leading axes" else (2, 3, 5, 8)
    first, later = tensor(0), tensor(1)
    view, layout = View(first, shape4), Layout(View(first, shape4)(first))
    full_road = later.reshape(shape4)
    full_road = full_road if zero_copy(full_road) else full_road.contiguous()
    got = view(later)
    assert torch.equal(got, full_road) and got.stride() == full_road.stride()
    assert (got.data_ptr() == later.data_ptr()) == zero_copy(later.reshape(shape4))
    assert view.copy == (make == "misaligned view")
    out = layout.empty()
    assert out.shape == full_road.shape and out.stride() == empty_like_layout(full_road).stride()
