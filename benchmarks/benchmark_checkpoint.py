"""What checkpointing costs a run: save, stall, load and checksum times, and the speed of the steps
that run while a background save writes. Prints one JSON line.

    python benchmarks/benchmark_checkpoint.py --config configs/llama3_1b.toml --folder /fast/disk
    python benchmarks/benchmark_checkpoint.py --config configs/llama3_1b.toml \\
        --async-mode async_with_pinned_mem

Trains --steps steps saving every --interval steps into a fresh folder under --folder (the last
step's save is model-only, to keep the run short), then resumes from the last full checkpoint and
trains to the same step. Times are train.py's own log lines (rank 0): a synchronous save's total
and checksum seconds and its size; an async save's blocking time (staging, and the next optimizer
step's wait for the host copy); the resume's seconds: in all, preparing the state dict, reading
the files (byte records, tensors) and the checksum check beside the reading. `step_tps` is each
step's tok/s, so the steps after a save show what the background write costs; `resumed_loss` is
the loss of the first resumed step in the uninterrupted run and after the resume (equal if the
save was exact; on another layout, --resume-nproc and --resume-with, equal within the
layouts' rounding).
--dd first measures what the disk allows: dd writing --dd-gib GiB with direct I/O and through the
page cache.
"""

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(args: argparse.Namespace, folder: str, overrides: list[str], nproc: int) -> tuple[str, float]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(REPO / "train.py"), "--config", args.config, "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--job.dump_folder", folder,
        "--training.global_batch_size", "-1",  # one micro-batch per rank and step
        "--checkpoint.enable", "--checkpoint.interval", str(args.interval),
        "--checkpoint.async_mode", args.async_mode, "--checkpoint.keep_latest_k", "2",
        "--checkpoint.last_save_model_only", *overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        sys.exit(f"error: train.py exited with {result.returncode}:\n{log[-3000:]}")
    return log, time.perf_counter() - start


def dd(folder: Path, gib: int) -> dict:
    """GB/s of dd writing `gib` GiB with direct I/O and through the page cache (then synced)."""
    results = {}
    for name, flags in (("direct", ["oflag=direct"]), ("buffered", ["conv=fsync"])):
        target = folder / "dd.bin"
        start = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={gib * 16}", *flags],
            check=True, capture_output=True,
        )  # fmt: skip
        results[f"dd_{name}_gb_s"] = round(gib * 2**30 / 1e9 / (time.perf_counter() - start), 2)
        target.unlink()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", default="")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--async-mode", default="disabled", help="checkpoint.async_mode")
    parser.add_argument("--folder", default=None, help="disk to save on (default: the temporary folder)")
    parser.add_argument("--dd", action="store_true", help="measure the disk with dd first")
    parser.add_argument("--dd-gib", type=int, default=8)
    parser.add_argument("--out", help="also append the JSON line to this file")
    parser.add_argument("--resume-nproc", type=int, help="processes of the resumed run (default --nproc)")
    parser.add_argument(
        "--resume-with",
        default="",
        help="overrides added for the resumed run, one string: --resume-with='--parallelism.x 2'",
    )
    parser.add_argument("overrides", nargs="*", help="train.py overrides, after --")
    args = parser.parse_args()
    args.resume_nproc = args.resume_nproc or args.nproc

    folder = Path(tempfile.mkdtemp(dir=args.folder))
    try:
        result = {"name": args.name, "config": args.config, "async_mode": args.async_mode,
                  "overrides": " ".join(args.overrides), "resumed_with": args.resume_with,
                  "resumed_nproc": args.resume_nproc}  # fmt: skip
        if args.dd:
            result.update(dd(folder, args.dd_gib))
        log, wall = train(args, str(folder), args.overrides, args.nproc)
        sync = r"saved checkpoint \S+ in ([\d.]+) s \(([\d.]+) GB; checksums ([\d.]+) s of it\)"
        saves = [tuple(map(float, save)) for save in re.findall(sync, log)]
        result["sync_save_s"] = [total for total, _, _ in saves]
        result["checksum_s"] = [checksums for _, _, checksums in saves]
        if saves and args.async_mode == "disabled":  # the first: a full save
            total, size, checksums = saves[0]
            result["checkpoint_gb"] = size
            result["write_gb_s"] = round(size / max(total - checksums, 0.05), 2)
        background = r"saved checkpoint \S+ \(committed ([\d.]+) s after it began\)"
        result["async_total_s"] = [float(s) for s in re.findall(background, log)]
        blocked = r"in the background by the writer \w+ \(training blocked ([\d.]+) s\)"
        result["async_blocked_s"] = [float(s) for s in re.findall(blocked, log)]
        allocated = re.search(r"GB of (?:pinned )?host memory for checkpoints, allocated in ([\d.]+) s", log)
        result["buffers_allocated_s"] = float(allocated.group(1)) if allocated else None
        took_over = r"the optimizer step took over the checkpoint's host copy in ([\d.]+) s \(([\d.]+) GB"
        result["optimizer_took_over_s"] = [float(s) for s, _ in re.findall(took_over, log)]
        result["snapshot_gb"] = [float(gb) for _, gb in re.findall(took_over, log)]
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        tps = {r["step"]: r["tps"] for r in records if "tps" in r and r.get("tps")}
        result["step_tps"] = [tps.get(step) for step in range(1, args.steps + 1)]
        steady = [tps[s] for s in tps if s > 2 and (s - 1) % args.interval not in (0, 1, 2)]
        result["steady_tps"] = round(statistics.median(steady)) if steady else None
        result["train_wall_s"] = round(wall, 1)

        last_full = (args.steps - 1) // args.interval * args.interval
        for later in (folder / "checkpoint").glob("step-*"):  # the resumed run writes its own
            if int(later.name.removeprefix("step-")) > last_full:
                shutil.rmtree(later)
        resume = [*args.overrides, *args.resume_with.split(), "--checkpoint.load_step", str(last_full)]
        log, wall = train(args, str(folder), resume, args.resume_nproc)
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        again = {r["step"]: r["loss"] for r in map(json.loads, lines) if "tps" in r}
        first = {r["step"]: r["loss"] for r in records if "tps" in r}
        # The resumed run's first step against the uninterrupted one's: equal if the save was exact.
        result["resumed_loss"] = [first.get(last_full + 1), again.get(last_full + 1)]
        checked = re.search(r"against its checksums in ([\d.]+) s", log)
        loaded = re.search(r"resumed from \S+ in ([\d.]+) s", log)
        result["verify_s"] = float(checked.group(1)) if checked else None
        result["load_s"] = float(loaded.group(1)) if loaded else None
        # load_s's parts: the state dict prepared, the files read (byte records, tensors) with the
        # checksum check beside the read
        parts = {"prepare_s": "state prepared in", "read_s": "files read in",
                 "byte_records_s": "byte records", "tensors_s": "tensors"}  # fmt: skip
        for key, words in parts.items():
            found = re.search(words + r" ([\d.]+) s", log)
            result[key] = float(found.group(1)) if found else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
