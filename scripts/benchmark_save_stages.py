"""Where a blocking checkpoint save's time goes, stage by stage, on one GPU.

    python scripts/benchmark_save_stages.py --folder /fast/disk/tmp [--stages d2h save_gpu ...]

Builds state shaped like Llama 3 1B's checkpoint (untied: weights, AdamW's two moments, all fp32,
18 GB) on the GPU and times, apart: the device-to-host copies DCP makes (pageable, one thread and
four, and into pinned buffers), and dcp.save of host tensors (no copies) through this
repository's writer (checkpoint/data_files.py) with O_DIRECT, without it, and with torch.save's own
zip CRC32 turned off; then the real blocking path, dcp.save of the GPU tensors. One JSON line per
stage: seconds and GB/s. dd on the same folder (benchmark_checkpoint.py's) says what the disk allows.
"""

import argparse
import concurrent.futures
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint.data_files import storage_writer
from scripts.benchmark_checkpoint import dd

DIM, FFN, KV, VOCAB, LAYERS = 2048, 8192, 512, 128256, 16  # Llama 3.2 1B


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    found = {"tok_embeddings": (VOCAB, DIM), "output": (VOCAB, DIM), "norm": (DIM,)}
    for layer in range(layers):
        block = {"wq": (DIM, DIM), "wk": (KV, DIM), "wv": (KV, DIM), "wo": (DIM, DIM), "w1": (FFN, DIM),
                 "w2": (DIM, FFN), "w3": (FFN, DIM), "attention_norm": (DIM,),
                 "ffn_norm": (DIM,)}  # fmt: skip
        found.update({f"layers.{layer}.{name}": shape for name, shape in block.items()})
    return found


def gpu_state(layers: int) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: to try the script)
    return {
        part: {name: torch.rand(shape, device=device) for name, shape in shapes(layers).items()}
        for part in ("model", "exp_avg", "exp_avg_sq")
    }


def tensors(state: dict) -> list[torch.Tensor]:
    return [t for part in state.values() for t in part.values()]


def timed(action) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    action()
    sync()
    return time.perf_counter() - start


def save(state: dict, folder: Path, threads: int, direct: bool) -> float:
    target = folder / "save"
    seconds = timed(lambda: dcp.save(state, storage_writer=storage_writer(target, threads, direct)))
    shutil.rmtree(target)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer: a smaller state")
    parser.add_argument("--out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # DCP without a process group says so at every save
    folder = Path(tempfile.mkdtemp(dir=args.folder))
    state = gpu_state(args.layers)
    size = sum(t.nbytes for t in tensors(state)) / 1e9
    results = []

    def report(stage: str, seconds: float) -> None:
        result = {
            "stage": stage,
            "s": round(seconds, 2),
            "gb_s": round(size / seconds, 2),
            "gb": round(size, 1),
        }
        results.append(result)
        print(json.dumps(result), flush=True)

    report("d2h pageable, 1 thread", timed(lambda: [t.cpu() for t in tensors(state)]))
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        report(
            f"d2h pageable, {args.threads} threads",
            timed(lambda: list(pool.map(torch.Tensor.cpu, tensors(state)))),
        )
    pinned = [torch.empty(t.shape, pin_memory=torch.cuda.is_available()) for t in tensors(state)]
    report(
        "d2h pinned", timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors(state))])
    )
    host = {part: {name: t.cpu() for name, t in tensors_.items()} for part, tensors_ in state.items()}
    pinned.clear()
    report("save host tensors, O_DIRECT", save(host, folder, args.threads, True))
    report("save host tensors, page cache", save(host, folder, args.threads, False))
    torch.serialization.set_crc32_options(False)
    report("save host tensors, O_DIRECT, no torch.save CRC32", save(host, folder, args.threads, True))
    torch.serialization.set_crc32_options(True)
    report(
        f"save host tensors, O_DIRECT, {2 * args.threads} threads", save(host, folder, 2 * args.threads, True)
    )
    del host
    report("save GPU tensors, O_DIRECT (the blocking save)", save(state, folder, args.threads, True))
    report("save GPU tensors, page cache", save(state, folder, args.threads, False))
    results.append({"stage": "dd 8 GiB, direct and buffered + fsync", **dd(folder, 8)})
    print(json.dumps(results[-1]), flush=True)
    shutil.rmtree(folder)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
