"""What the checkpoint checksums (checkpoint/integrity.py) cost: seconds per GiB to record and to verify.

    python benchmarks/benchmark_checksums.py --gib 1 --ranks 4 [--folder /fast/disk/tmp]

Writes a checkpoint-like folder (one __<rank>_0.distcp file of random bytes per rank, and a small
.metadata), then times what a save adds (each rank's files checksummed, one rank after the other,
then checksums.json) and what a resume adds (every file checked), each with the default threads and
with one thread. The files are in the page cache, as right after a save: the numbers are the
checksum's CPU cost, not the disk's. On a GPU node eight ranks do this at once, each on its share.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import integrity


def write_folder(folder: Path, gib: float, ranks: int) -> int:
    per_rank = int(gib * 2**30 / ranks)
    for rank in range(ranks):
        with (folder / f"__{rank}_0.distcp").open("wb") as f:
            for start in range(0, per_rank, 2**26):
                f.write(os.urandom(min(2**26, per_rank - start)))
    (folder / ".metadata").write_bytes(os.urandom(2**20))
    return per_rank * ranks + 2**20


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="size of the folder (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=4, help="data files (default: %(default)s)")
    parser.add_argument("--folder", help="where to write it (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        folder = Path(tmp)
        total = write_folder(folder, args.gib, args.ranks)

        def record() -> None:
            files = {}
            for rank in range(args.ranks):
                files.update(integrity.checksum(integrity.own_files(folder, rank)))
            files.update(integrity.checksum([folder / ".metadata"]))
            integrity.write_manifest(folder, files)

        def verify() -> None:
            manifest = integrity.read_manifest(folder)
            assert not integrity.problems(folder, manifest, list(manifest["files"]))

        results = {"gib": round(total / 2**30, 3), "ranks": args.ranks}
        for threads in (integrity.THREADS, 1):
            integrity.THREADS = threads
            record_s, verify_s = timed(record), timed(verify)
            results[f"record_s_per_gib_{threads}_threads"] = round(record_s / (total / 2**30), 3)
            results[f"verify_s_per_gib_{threads}_threads"] = round(verify_s / (total / 2**30), 3)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
