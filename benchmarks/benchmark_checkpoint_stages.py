"""Where a checkpoint save's and load's time goes, stage by stage, on one GPU.

    python benchmarks/benchmark_checkpoint_stages.py --folder /fast/disk/tmp [--parts save load]

Builds state shaped like Llama 3 1B's checkpoint (untied: weights, AdamW's two moments, all fp32,
18 GB) on the GPU and times, apart:
  save: the device-to-host copies DCP makes (pageable, one thread and several, and into pinned
        buffers), and dcp.save of host tensors (no copies) through this repository's writer
        (checkpoint/fast_io/data_files.py) with O_DIRECT, without it, and with torch.save's own zip CRC32
        turned off; then dcp.save of the GPU tensors; and dd on the same folder
        (benchmark_checkpoint.py's): what the disk allows.
  load: a checkpoint saved as training saves it, read back into GPU tensors: the checksum check
        (checkpoint/integrity.py) from the disk, dcp.load with DCP's FileSystemReader and with
        ParallelReader (checkpoint/fast_io/data_files.py), each from the disk ("cold": the files' pages
        dropped from the page cache first, posix_fadvise) and from the page cache ("warm"), and
        ParallelReader into host tensors (no host-to-device copies).
One JSON line per stage: seconds and GB/s.
"""

import argparse
import concurrent.futures
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.benchmark_checkpoint import dd
from checkpoint import integrity
from checkpoint.fast_io.data_files import ParallelReader, storage_writer

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


def save_stages(state: dict, folder: Path, threads: int, report) -> None:
    report("d2h pageable, 1 thread", timed(lambda: [t.cpu() for t in tensors(state)]))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        report(
            f"d2h pageable, {threads} threads",
            timed(lambda: list(pool.map(torch.Tensor.cpu, tensors(state)))),
        )
    pinned = [torch.empty(t.shape, pin_memory=torch.cuda.is_available()) for t in tensors(state)]
    report(
        "d2h pinned", timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors(state))])
    )
    host = {part: {name: t.cpu() for name, t in tensors_.items()} for part, tensors_ in state.items()}
    pinned.clear()
    report("save host tensors, O_DIRECT", save(host, folder, threads, True))
    report("save host tensors, page cache", save(host, folder, threads, False))
    torch.serialization.set_crc32_options(False)
    report("save host tensors, O_DIRECT, no torch.save CRC32", save(host, folder, threads, True))
    torch.serialization.set_crc32_options(True)
    report(f"save host tensors, O_DIRECT, {2 * threads} threads", save(host, folder, 2 * threads, True))
    del host
    report("save GPU tensors, O_DIRECT (the blocking save)", save(state, folder, threads, True))
    report("save GPU tensors, page cache", save(state, folder, threads, False))


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_stages(state: dict, folder: Path, threads: int, report, dcp_reader: bool) -> None:
    target = folder / "load"
    writer = storage_writer(target, threads, True)
    dcp.save(state, storage_writer=writer)
    files = sorted(target.glob("*.distcp"))
    empty = lambda device: {
        part: {n: torch.empty_like(t, device=device) for n, t in p.items()} for part, p in state.items()
    }
    gpu = empty(state["model"]["norm"].device)

    def load(reader, into: dict) -> None:
        dcp.load(into, storage_reader=reader)

    def check_beside(action) -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            checking = pool.submit(integrity.checksum, files)
            action()
            checking.result()

    parallel = lambda: ParallelReader(target, threads)
    stages = {
        "checksums from the disk": lambda: integrity.checksum(files),
        f"load into GPU tensors, ParallelReader {threads} threads, cold": lambda: load(parallel(), gpu),
        "checksums, then the load (as initial_load_path)": lambda: (
            integrity.checksum(files),
            load(parallel(), gpu),
        ),
        "checksums beside the load (as a resume)": lambda: check_beside(lambda: load(parallel(), gpu)),
    }
    if dcp_reader:
        stages["load into GPU tensors, FileSystemReader, cold"] = lambda: load(
            dcp.FileSystemReader(str(target)), gpu
        )
    for name, action in stages.items():
        drop_from_page_cache(files)
        report(name, timed(action))
    report(
        f"load into GPU tensors, ParallelReader {threads} threads, warm", timed(lambda: load(parallel(), gpu))
    )
    assert all(torch.equal(a, b) for a, b in zip(tensors(gpu), tensors(state))), "loaded state differs"
    host = empty("cpu")
    gpu.clear()  # (frees the GPU copies)
    report(
        f"load into host tensors, ParallelReader {threads} threads, warm",
        timed(functools.partial(load, ParallelReader(target, threads), host)),
    )
    shutil.rmtree(target)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument("--threads", type=int, default=8, help="checkpoint.writer_threads")
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer: a smaller state")
    parser.add_argument("--parts", nargs="+", choices=["save", "load"], default=["save", "load"])
    parser.add_argument("--dcp-reader", action="store_true", help="load: also DCP's FileSystemReader")
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

    if "save" in args.parts:
        save_stages(state, folder, args.threads, report)
        results.append({"stage": "dd 8 GiB, direct and buffered + fsync", **dd(folder, 8)})
        print(json.dumps(results[-1]), flush=True)
    if "load" in args.parts:
        load_stages(state, folder, args.threads, report, args.dcp_reader)
    shutil.rmtree(folder)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
