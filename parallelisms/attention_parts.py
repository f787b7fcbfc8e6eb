"""Attention of a block of queries against parts of the keys, merged by log-sum-exp.

Context parallelism needs a query chunk's attention against all keys up to its own end: the keys
before the chunk without a mask, and the chunk's own keys with the ordinary causal mask (a square).
Each part is run by the fastest kernel that returns its log-sum-exp (cuDNN on CUDA for bf16/fp16,
the kernel behind plain causal SDPA on the H200; exact math in PyTorch otherwise: CPU, fp32), and
the parts are merged: out = sum_i exp(lse_i - lse) out_i with lse = log(sum_i exp(lse_i)).

Backward needs no merging: with the merged output and log-sum-exp, each part's kernel backward
gives exactly that part's share of the gradients (FlashAttention's identity dS = P * (dP - rowsum(dO
* O)) holds per part when P is normalized by the whole row), so dQ is the sum over parts and each
part's keys get their own dK, dV.

Shapes: q (batch, heads, queries, dim); k, v (batch, kv_heads, keys, dim) with heads a multiple of
kv_heads (GQA); lse (batch, heads, queries), float32.
"""

import functools

import torch

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _fused(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _FUSED_DTYPES


def part_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """(out, lse) of softmax(q k^T / sqrt(dim)) v; causal: a square part with the usual mask."""
    if _fused(q):
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
        return result[0], result[1].reshape(q.shape[:3])
    scores = _math_scores(q, k, causal)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ _repeat_kv(v.float(), q.shape[1])
    return out.to(q.dtype), lse


def part_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
):
    """(dq, dk, dv) of one part, given the merged out and lse of the whole row."""
    if _fused(q):
        # cuDNN gets dout contiguous, the layout tests/test_gpu.py checked on the H200 (out being a
        # chunk of the whole output, i.e. strided); a chunk of dout as it comes would not be.
        dout = dout.contiguous()
        empty = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: no RNG state
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), empty, empty, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]
    heads, kv_heads = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5
    probabilities = (_math_scores(q, k, causal) - lse.unsqueeze(-1)).exp()
    dout, values = dout.float(), _repeat_kv(v.float(), heads)
    dv = probabilities.transpose(-1, -2) @ dout
    row_dot = (dout * out.float()).sum(dim=-1, keepdim=True)
    dscores = probabilities * (dout @ values.transpose(-1, -2) - row_dot)
    dq = dscores @ _repeat_kv(k.float(), heads) * scale
    dk = dscores.transpose(-1, -2) @ q.float() * scale
    sum_groups = lambda g: g.unflatten(1, (kv_heads, heads // kv_heads)).sum(dim=2)
    return dq.to(q.dtype), sum_groups(dk).to(k.dtype), sum_groups(dv).to(v.dtype)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], into: torch.Tensor | None = None):
    """The (out, lse) of the union of the parts' keys, from each part's (out, lse); into: where to
    write out (e.g. a slice of a larger output), else a new tensor.

    Few passes over the outputs (they are large, the lse small): on CUDA two parts are merged by
    one compiled kernel that reads each output once and writes the merged one in its dtype; else
    the weighted sum accumulates in float32 reading each part's output once, and the final cast
    writes straight into `into`."""
    if len(parts) == 1:
        return parts[0] if into is None else (into.copy_(parts[0][0]), parts[0][1])
    if len(parts) == 2 and _fused(parts[0][0]):
        out, lse = _merge_two_compiled()(*parts[0], *parts[1])
        return (out if into is None else into.copy_(out)), lse
    lse = torch.stack([part_lse for _, part_lse in parts]).logsumexp(dim=0)
    (first, first_lse), *rest = parts
    out = first * (first_lse - lse).exp().unsqueeze(-1)  # float32 (the lse is)
    for part_out, part_lse in rest:
        out.addcmul_(part_out, (part_lse - lse).exp().unsqueeze(-1))
    into = torch.empty_like(first) if into is None else into
    return into.copy_(out), lse


def _merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (lse_a - lse).exp().unsqueeze(-1), (lse_b - lse).exp().unsqueeze(-1)
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype), lse


@functools.cache
def _merge_two_compiled():
    return torch.compile(_merge_two, dynamic=False)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    scores = q.float() @ _repeat_kv(k.float(), q.shape[1]).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        above_diagonal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above_diagonal, float("-inf"))
    return scores
