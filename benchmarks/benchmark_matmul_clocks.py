"""Time a model's matrix products alone, in a short burst and sustained, with the card's SM clock
and power read beside them: is a training step's matmul rate below the isolated one because the
card slows down under sustained load (its power limit), or because of the products themselves?

Every product of a decoder layer's linear layers and of the output projection, forward (x @ W^T),
input gradient (dY @ W) and weight gradient (dY^T @ x), bf16 on random data. "burst" is the mean
of --repeat products after a pause (the card cool and idle); "sustained" is the rate over the last
half of --seconds of back-to-back products. With --watch, only the clock and power are read while
a command runs (e.g. a training benchmark), and summarized over the samples where the card draws
more than --busy-watts.

    python3 benchmarks/benchmark_matmul_clocks.py --dim 3072 --kv 1024 --ffn 8192 --vocab 128256
    python3 benchmarks/benchmark_matmul_clocks.py --watch -- \
        python3 benchmarks/benchmark.py --config configs/llama3_3b.toml --steps 14 --warmup 7
"""

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

FIELDS = "clocks.sm,power.draw,temperature.gpu"


class ClockSampler:
    """nvidia-smi read every `interval_ms` in a background thread: (seconds, SM MHz, watts, degrees C)."""

    def __init__(self, interval_ms: int = 100):
        self.samples: list[tuple[float, float, float, float]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"]
            + [f"--loop-ms={interval_ms}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                mhz, watts, degrees = (float(part) for part in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), mhz, watts, degrees))

    def between(self, start: float, end: float) -> dict:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {}
        return {
            "sm_mhz": round(statistics.median(s[1] for s in inside)),
            "sm_mhz_min": round(min(s[1] for s in inside)),
            "watts": round(statistics.median(s[2] for s in inside)),
            "celsius": round(max(s[3] for s in inside)),
        }

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait()


def products(dim: int, kv: int, ffn: int, vocab: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of every product of one decoder layer and of the output projection."""
    linears = {"wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, dim)}
    linears |= {"w1": (ffn, dim), "w3": (ffn, dim), "w2": (dim, ffn), "output": (vocab, dim)}
    shapes = []
    for name, (out, inp) in linears.items():
        shapes.append((f"{name}.forward", tokens, out, inp))  # x (T x in) @ W^T
        shapes.append((f"{name}.grad_input", tokens, inp, out))  # dY (T x out) @ W
        shapes.append((f"{name}.grad_weight", out, inp, tokens))  # dY^T @ x
    return shapes


def operands(name: str, m: int, n: int, k: int):
    """The operands in the layouts the step uses (transposed views where autograd passes them)."""
    kind = name.split(".")[1]
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    if kind == "forward":  # x (m x k), W (n x k) used transposed
        return make(m, k), make(n, k).t()
    if kind == "grad_input":  # dY (m x k), W (k x n)
        return make(m, k), make(k, n)
    return make(k, m).t(), make(k, n)  # dY (k x m) used transposed, x (k x n)


def time_products(a, b, repeat: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def measure(args: argparse.Namespace, sampler: ClockSampler) -> list[dict]:
    rows = []
    for name, m, n, k in products(args.dim, args.kv, args.ffn, args.vocab, args.tokens):
        a, b = operands(name, m, n, k)
        flop = 2 * m * n * k
        time_products(a, b, 3)
        time.sleep(args.pause)  # let the card idle and cool before the burst
        burst_ms = time_products(a, b, args.repeat)
        per_call = max(burst_ms, 0.01)
        calls = max(1, int(args.seconds / 2 / (per_call / 1e3)))
        time_products(a, b, calls)  # the first half: reach the sustained state
        t0 = time.monotonic()
        sustained_ms = time_products(a, b, calls)
        t1 = time.monotonic()
        rows.append(
            {
                "product": name,
                "mnk": [m, n, k],
                "burst_tflops": round(flop / burst_ms / 1e9, 1),
                "sustained_tflops": round(flop / sustained_ms / 1e9, 1),
                "sustained_ms": round(sustained_ms, 4),
                **sampler.between(t0, t1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del a, b
        torch.cuda.empty_cache()
    return rows


def watch(args: argparse.Namespace, sampler: ClockSampler) -> list[dict]:
    t0 = time.monotonic()
    rc = subprocess.call(args.command)
    busy = [s for s in sampler.samples if s[0] >= t0 and s[2] > args.busy_watts]
    row = {"command": " ".join(args.command), "rc": rc, "busy_samples": len(busy)}
    if busy:
        mhz = sorted(s[1] for s in busy)
        row |= {
            "sm_mhz_median": round(statistics.median(mhz)),
            "sm_mhz_p10": round(mhz[len(mhz) // 10]),
            "sm_mhz_max": round(mhz[-1]),
            "watts_median": round(statistics.median(s[2] for s in busy)),
            "watts_max": round(max(s[2] for s in busy)),
            "celsius_max": round(max(s[3] for s in busy)),
        }
    print(json.dumps(row), flush=True)
    return [row]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dim", type=int, default=3072)
    parser.add_argument("--kv", type=int, default=1024, help="key (= value) projection width")
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=10, help="products in a burst")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of a sustained run")
    parser.add_argument("--pause", type=float, default=1.0, help="idle seconds before a burst")
    parser.add_argument("--watch", action="store_true", help="only read the clocks while COMMAND runs")
    parser.add_argument("--busy-watts", type=float, default=300.0)
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("command", nargs="*", help="with --watch: the command (after --)")
    args = parser.parse_args()
    if args.watch and not args.command:
        print("error: --watch needs a command after --", file=sys.stderr)
        return 2
    sampler = ClockSampler()
    try:
        rows = watch(args, sampler) if args.watch else measure(args, sampler)
    finally:
        sampler.stop()
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
