"""Time document-masked attention (forward + backward) on one GPU, kernel by kernel, against
plain causal cuDNN attention, and check each kernel's output and gradients against SDPA with the
boolean mask.

    python benchmarks/benchmark_document_attention.py --out documents.jsonl

Documents: the bundled corpus packed as training packs it (each document's bytes + EOS, windows of
`--seq` tokens of the concatenated stream; `--windows` of them, timed one by one and averaged), or
documents of one fixed length (`--document-length`). Kernels (`--kernels`, default causal, flex
and flash_varlen):
- causal: SDPA's cuDNN kernel without document masking (the reference speed);
- flex: models.attention.masked_attention under the BlockMask of document_mask (what training
  runs, with its Hopper tiles at head dimension 64);
- flex_autotuned: flex attention compiled with max-autotune (inductor's search over its tiles, once
  per shape; the search's results go to stderr);
- flash_varlen: torch.nn.attention.varlen (flash attention over ragged sequences);
- cudnn_ragged_* (`--cudnn-ragged`): cuDNN with the documents as ragged sequences
  (aten._cudnn_attention_forward with cumulative sequence lengths, a path torch has but does not
  select itself; on torch 2.11 its backward is wrong, docs/performance.md): K/V heads as given
  (`gqa`) or repeated to the query heads (`expanded`); the longest document's length given exactly
  (`exact`) or bounded by the window (`bounded`), and the lengths also padded to one per token
  with empty documents (`padded`): the forms whose arguments do not change from batch to batch,
  which torch.compile would need.
A kernel that fails is reported with its error, not timed.
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.benchmark_attention import time_ms
from models.attention import document_ids, document_mask, masked_attention

SHAPES = {"1b": (32, 8, 64), "3b": (24, 8, 128)}  # query heads, KV heads, head dim
EOS = -1


def bundled_windows(seq: int, windows: int) -> list[list[int]]:
    """Document lengths within `windows` packed windows of the bundled corpus, spread evenly over
    one epoch (each document's bytes + EOS, as the byte tokenizer and the packer make them)."""
    path = Path(__file__).resolve().parent.parent / "data" / "sample" / "python_docs.jsonl"
    lengths = [len(json.loads(line)["text"].encode("utf-8")) + 1 for line in path.open()]
    ends = torch.tensor(lengths).cumsum(0).tolist()
    per_epoch = ends[-1] // seq
    result = []
    for w in range(windows):
        lo = (w * per_epoch // windows) * seq
        hi = lo + seq
        result.append([min(e, hi) - max(e - n, lo) for n, e in zip(lengths, ends) if e > lo and e - n < hi])
    return result


def tokens_of(lengths: list[int], device) -> torch.Tensor:
    """A (1, seq) token row whose EOS tokens end the documents (the last one may run on)."""
    tokens = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    ends = torch.tensor(lengths, device=device).cumsum(0) - 1
    tokens[ends[:-1]] = EOS
    return tokens[None]


class CudnnRagged(torch.autograd.Function):
    """Causal attention within each ragged sequence, (T, H, D) tensors, cuDNN forward/backward.
    cu_seq must be int32 (int64 offsets give wrong results on torch 2.11, no error)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seq, max_len):
        result = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seq, cu_seq, max_len, max_len, True, 0.0, True, False
        )
        out, lse, seed, offset = result[0], result[1], result[6], result[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_seq)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seed, offset, cu_seq = ctx.saved_tensors
        # attn_bias None (an undefined tensor): an empty one is taken for a bias and fails.
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, seed, offset, None,
            cu_seq, cu_seq, ctx.max_len, ctx.max_len, 0.0, True,
        )  # fmt: skip
        return dq, dk, dv, None, None


def kernels(lengths: list[int], seq: int, heads: int, kv_heads: int, args):
    """name -> f(q, k, v) for (1, heads, seq, dim) inputs, returning (1, heads, seq, dim)."""
    device = "cuda"
    documents = document_ids(tokens_of(lengths, device), EOS)
    block_mask = document_mask(documents)
    cu_seq = torch.tensor([0] + lengths, device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    padded = torch.cat([cu_seq, cu_seq[-1:].expand(seq + 1 - len(cu_seq))]).contiguous()
    repeat = heads // kv_heads

    def thd(t):  # (1, H, S, D) -> (S, H, D); free where the model's tensors are (1, S, H, D)
        return t[0].transpose(0, 1)

    def bhsd(t):
        return t.transpose(0, 1)[None]

    def ragged(expand: bool, lengths_as: str):
        choices = {"exact": (cu_seq, max(lengths)), "bounded": (cu_seq, seq), "padded": (padded, seq)}
        cu, longest = choices[lengths_as]

        def run(q, k, v):
            q, k, v = thd(q).contiguous(), thd(k), thd(v)
            if expand:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            return bhsd(CudnnRagged.apply(q, k.contiguous(), v.contiguous(), cu, longest))

        return run

    def flash_varlen(q, k, v):
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(
            thd(q).contiguous(),
            thd(k).contiguous(),
            thd(v).contiguous(),
            cu_seq,
            cu_seq,
            max(lengths),
            max(lengths),
            window_size=(-1, 0),
        )
        return bhsd(out)

    def causal(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def flex_autotuned(q, k, v):
        return autotuned_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=True)

    paths = {
        "causal": causal,
        "flex": lambda q, k, v: masked_attention(q, k, v, block_mask),
        "flex_autotuned": flex_autotuned,
        "flash_varlen": flash_varlen,
    }
    if args.cudnn_ragged:
        for heads_as in ("gqa", "expanded"):
            for lengths_as in ("exact", "bounded", "padded"):
                paths[f"cudnn_ragged_{heads_as}_{lengths_as}"] = ragged(heads_as == "expanded", lengths_as)
    chosen = {name: fn for name, fn in paths.items() if name in args.kernels or name.startswith("cudnn")}
    return documents, chosen


@functools.cache
def autotuned_flex_attention():
    return torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")


def reference(q, k, v, documents):
    seq = documents.shape[1]
    positions = torch.arange(seq, device=q.device)
    allowed = (positions[None, :] <= positions[:, None]) & (documents[0, :, None] == documents[0, None, :])
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_window(lengths: list[int], args, shape: str) -> list[dict]:
    heads, kv_heads, dim = SHAPES[shape]
    seq = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    documents, paths = kernels(lengths, seq, heads, kv_heads, args)
    expected_out = reference(q, k, v, documents)
    expected = (expected_out, *torch.autograd.grad(expected_out, (q, k, v), grad))
    rows = []
    for name, fn in paths.items():
        row = {"shape": shape, "seq": seq, "documents": len(lengths), "kernel": name}
        try:
            out = fn(q, k, v)
            got = (out, *torch.autograd.grad(out, (q, k, v), grad))
            if name != "causal":
                row["errors"] = [round(relative_error(a, b), 5) for a, b in zip(got, expected)]

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)

            row["ms"] = time_ms(step, args.repeat)
        except Exception as error:  # report and go on: which kernels this torch runs is the point
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--shape", nargs="+", default=["1b", "3b"], choices=sorted(SHAPES))
    parser.add_argument("--windows", type=int, default=6, help="bundled-corpus windows to average")
    parser.add_argument("--document-length", type=int, help="documents of this many tokens instead")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--kernels", nargs="+", default=["causal", "flex", "flash_varlen"])
    parser.add_argument(
        "--cudnn-ragged", action="store_true", help="also cuDNN's ragged path (torch 2.11: wrong gradients)"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.document_length:
        n = -(-args.seq // args.document_length)
        windows = [[args.document_length] * (n - 1) + [args.seq - args.document_length * (n - 1)]]
    else:
        windows = bundled_windows(args.seq, args.windows)
    results = []
    for shape in args.shape:
        per_window = [run_window(lengths, args, shape) for lengths in windows]
        for rows in zip(*per_window):
            summary = dict(rows[0])
            times = [r["ms"] for r in rows if "ms" in r]
            if len(times) == len(rows):
                summary["ms"] = round(sum(times) / len(times), 3)
            summary["documents"] = [r["documents"] for r in rows]
            if all("errors" in r for r in rows):  # the worst window's
                summary["errors"] = [max(errors) for errors in zip(*(r["errors"] for r in rows))]
            print(json.dumps(summary), flush=True)
            results.append(summary)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
