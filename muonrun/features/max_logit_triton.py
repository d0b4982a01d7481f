"""The largest causal attention logit per head in one Triton kernel (muonrun/features/qkclip.py's GPU path).

Each program takes BLOCK_M query positions of one (sequence, head) and walks the key tiles at or before
them, as a flash-attention forward does, keeping only the running maximum of each row of Q K^T: no
softmax, no values, nothing materialized. Products of bf16 (or fp16) inputs are exact in fp32 and are
summed in fp32; fp32 inputs use IEEE fp32 products (no TF32). Importing this module needs Triton;
`python benchmarks/bench_max_logit.py` times it on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILES = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
"""The launch settings: the fastest at the 0.5B preset's shapes on an H200, among those
`python benchmarks/bench_max_logit.py --sweep` times."""


@triton.jit
def _max_logit_kernel(
    Q,
    K,
    Out,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    seq,
    heads,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM_PAD)
    rows_ok = offs_m < seq
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
        mask=rows_ok[:, None] & (offs_d[None, :] < DIM),
        other=0.0,
    )
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh + offs_d[None, :] * stride_kd
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # Key tiles that end at or before this query block's first position need no causal mask.
    full_end = (block * BLOCK_M) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_kt, mask=offs_d[None, :] < DIM, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        best = tl.maximum(best, tl.max(s, axis=1))
    for start in range(full_end, tl.minimum((block + 1) * BLOCK_M, seq), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(
            k_base + offs_n[:, None] * stride_kt,
            mask=(offs_n[:, None] < seq) & (offs_d[None, :] < DIM),
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        best = tl.maximum(best, tl.max(s, axis=1))
    best = tl.where(rows_ok, best, float("-inf"))  # padding rows hold logits of zero vectors
    tl.store(Out + bh * tl.num_programs(0) + block, tl.max(best, axis=0))


def causal_max_logit(query: torch.Tensor, key: torch.Tensor, **tiles) -> torch.Tensor:
    """max over batch and i >= j of q_i . k_j per query head, fp32 [heads]. query [B, H, T, D] and key
    [B, H_kv, T, D] in any strides. `tiles` override TILES."""
    t = {**TILES, **tiles}
    batch, heads, seq, dim = query.shape
    blocks = triton.cdiv(seq, t["BLOCK_M"])
    out = torch.empty((batch * heads, blocks), device=query.device, dtype=torch.float32)
    _max_logit_kernel[(blocks, batch * heads)](
        query,
        key,
        out,
        *query.stride(),
        *key.stride(),
        seq,
        heads,
        GROUP=heads // key.shape[1],
        DIM=dim,
        DIM_PAD=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # tf32 is ignored by bf16/fp16
        **t,
    )
    return out.view(batch, heads, blocks).amax(dim=(0, 2))
