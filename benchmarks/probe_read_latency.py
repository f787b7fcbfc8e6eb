"""Does reading a step's result wait for a side stream's copies to the host? (CUDA only.)

    python benchmarks/probe_read_latency.py

A ~30 ms matmul "step" runs while a thread copies 10 GB from the GPU into pinned host memory on a
side stream (~195 ms on an H200), issued in 256 MB groups (at most two in flight) or all at once, as
an async checkpoint's staging does; then the step's result is read four ways. Prints, per way, when
the read returned and when the copies ended, in ms from the start. docs/performance.md has the
H200's figures: a read through any device-to-host copy returned only when the copies had ended;
training/host_reads.to_host (a kernel writes into mapped host memory) did not wait.
"""

import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.host_reads import to_host  # noqa: E402

GROUP = 1 << 28  # bytes


def main() -> None:
    sources = [torch.randn(GROUP // 2, device="cuda", dtype=torch.bfloat16) for _ in range(40)]  # 10 GB
    buffers = [torch.empty(GROUP // 2, dtype=torch.bfloat16, pin_memory=True) for _ in sources]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    pinned = torch.zeros((), pin_memory=True)

    def step() -> torch.Tensor:
        for _ in range(20):
            y = (a @ a) * 1e-4
        return y[0, 0].float()

    def copy_to_host(stream: torch.cuda.Stream, grouped: bool, ended: list) -> None:
        with torch.cuda.stream(stream):
            previous = None
            for source, buffer in zip(sources, buffers):
                buffer.copy_(source, non_blocking=True)
                if grouped:
                    done = torch.cuda.Event()
                    done.record(stream)
                    if previous is not None:
                        previous.synchronize()
                    previous = done
        stream.synchronize()
        ended.append(time.perf_counter())

    def read_pinned(x: torch.Tensor) -> float:
        pinned.copy_(x, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return pinned.item()

    reads = {
        ".item()": lambda x: x.item(),
        "copy into pinned memory + sync": read_pinned,
        "event only (no copy)": lambda x: torch.cuda.current_stream().synchronize(),
        "host_reads.to_host": lambda x: to_host(x)[0].item(),
    }

    def trial(read, copies: str | None) -> str:
        torch.cuda.synchronize()
        ended, start = [], time.perf_counter()
        if copies:
            arguments = (torch.cuda.Stream(), copies == "grouped", ended)
            thread = threading.Thread(target=copy_to_host, args=arguments)
            thread.start()
        read(step())
        returned = time.perf_counter()
        if copies:
            thread.join()
        copies_end = f", copies ended {1e3 * (ended[0] - start):.0f} ms" if ended else ""
        return f"read returned {1e3 * (returned - start):.0f} ms{copies_end}"

    for read in reads.values():  # (first uses: cuBLAS, kernels loaded, the mapped buffer)
        trial(read, None)
    for name, read in reads.items():
        for copies in (None, "grouped", "at once"):
            print(f"{name:32s} {copies or 'no copies':10s} {trial(read, copies)}", flush=True)


if __name__ == "__main__":
    main()
