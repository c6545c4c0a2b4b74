"""Which units PyTorch's float32 SDPA (memory-efficient backend) computes on: one forward and one backward, for
Nsight Compute to count the instructions per pipe.

    ncu --kernel-name regex:fmha_cutlass --metrics 'regex:sm__inst_executed_pipe_.*\\.sum$' \\
        python -m benchmarks.profilers.sdpa_fp32_pipes

The module prints what a 3xTF32 kernel (three ``mma.m16n8k8`` tf32 products of 16·8·8·2 = 2048 FLOPs for every
float32 product) must issue at this shape: 3·4·N²·d·B·H / 2048 tensor-core instructions forward and
3·10·N²·d·B·H / 2048 backward (the FA2 model's FLOPs). Counted on an H200 (``benchmarks/results/nvidia-h200/
ncu_sdpa_fp32_pipes.txt``), ``sm__inst_executed_pipe_tensor_op_hmma.sum`` is exactly that for both kernels,
with ``torch.backends.cuda.matmul.allow_tf32`` off: PyTorch's float32 memory-efficient attention is 3xTF32 on
tensor cores (CUTLASS's ``OpMultiplyAddFastF32``), not a CUDA-core kernel.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,16,2048,128", help="B,H,N,d")
    args = parser.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, N, d = (int(x) for x in args.shape.split(","))
    print("torch", torch.__version__, "allow_tf32 (matmul):", torch.backends.cuda.matmul.allow_tf32)
    q, k, v = (torch.randn(B, H, N, d, device="cuda", requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        o.sum().backward()
    torch.cuda.synchronize()
    for name, flops in (("forward", 4 * N * N * d * B * H), ("backward", 10 * N * N * d * B * H)):
        print(f"{name}: {flops / 1e9:.2f} GFLOP; a 3xTF32 kernel issues {3 * flops // 2048:,} m16n8k8 MMAs, "
              f"a TF32 one {flops // 2048:,}")


if __name__ == "__main__":
    main()
