"""Checksums of a checkpoint's files: recorded when it is saved, verified before it is loaded.

A file damaged after it was written (a bad sector, a broken copy, a flipped page) would otherwise
load without a complaint: DCP reads whatever bytes sit at the offsets that .metadata names.
checksums.json in each step-N folder holds, per file, its size and the CRC32 of each 64 MiB piece:
pieces, so that a rank's threads share one large file and an error can say where the damage is.

Saving (checkpoint/manager.py): each rank's data files are checksummed piece by piece as they are
written (checkpoint/fast_io/data_files.py); rank 0 gathers the results, adds .metadata and writes
checksums.json before the checkpoint is committed. Loading: .metadata is checked first, on the bytes
that are then unpickled (checkpoint/data_only.py); the data files are shared out over the ranks
(a file goes to the rank that wrote it, so that on the same layout each rank checks what DCP then
reads from it) while DCP reads the same files, and any problem stops every rank before anything read
is used. Every file of the folder must be in checksums.json: one that is not (added, or left out
of a checksums.json rewritten) would otherwise be read unchecked, if .metadata named it. A
checkpoint without checksums.json (written before it existed) is loaded unverified. checksums.json
also names the run that saved the checkpoint (checkpoint/run_identity.py).
Checksums find damage, not an attacker, who can recompute them: docs/checkpointing.md, "Trust model".
"""

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from configs import UserError
from configs.errors import first_line

MANIFEST = "checksums.json"
PIECE_BYTES = 64 * 2**20
READ_BYTES = 8 * 2**20
# Per rank; zlib releases the GIL, so threads run in parallel. Checksums are read back only when a
# checkpoint is loaded (a save takes them as it writes, checkpoint/fast_io/data_files.py), before training
# runs. H200 machine, 18 GB from the disk: 1.64 GB/s with 4 threads, 1.68 with 8 (the disk's
# speed); beside DCP's reads, as a resume runs them, the two together took 10.1 s
# (benchmarks/benchmark_checkpoint_stages.py).
THREADS = 8
WRITER = re.compile(r"^__(\d+)_")  # DCP's FileSystemWriter names a rank's files __<rank>_<n>.distcp


def own_files(folder: Path, rank: int) -> list[Path]:
    """The data files that this rank wrote in a DCP save."""
    return sorted(folder.glob(f"__{rank}_*.distcp"))


def checksum(paths: list[Path], piece_bytes: int = PIECE_BYTES) -> dict[str, dict]:
    """{file name: {"size": bytes, "crc32": [one hex CRC32 per piece]}}."""
    sizes = {path: path.stat().st_size for path in paths}
    pieces = [(path, start) for path in paths for start in range(0, sizes[path] or 1, piece_bytes)]
    with ThreadPoolExecutor(THREADS) as pool:
        crcs = dict(zip(pieces, pool.map(lambda piece: _piece_crc32(*piece, piece_bytes), pieces)))
    return {
        path.name: {"size": size, "crc32": [crcs[path, start] for start in range(0, size or 1, piece_bytes)]}
        for path, size in sizes.items()
    }


def _piece_crc32(path: Path, start: int, length: int) -> str:
    crc, left = 0, length
    with path.open("rb") as f:
        f.seek(start)
        while left > 0 and (block := f.read(min(READ_BYTES, left))):
            crc, left = zlib.crc32(block, crc), left - len(block)
    return f"{crc:08x}"


def write_manifest(folder: Path, files: dict[str, dict], run_id: str | None = None) -> None:
    """checksums.json, on the disk when this returns (a commit deletes older checkpoints next);
    run_id: the run that saved it (None: a conversion script's checkpoint, of no run)."""
    manifest = {"piece_bytes": PIECE_BYTES, **({"run_id": run_id} if run_id else {}),
                "files": dict(sorted(files.items()))}  # fmt: skip
    with (folder / MANIFEST).open("w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


def record(folder: Path) -> None:
    """Checksum every file of a checkpoint written by one process (the conversion scripts)."""
    write_manifest(folder, checksum(sorted(folder.glob("*.distcp")) + [folder / ".metadata"]))


def read_manifest(folder: Path) -> dict | None:
    """The recorded checksums; None for a checkpoint saved before they were recorded."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("piece_bytes"), int):
            raise ValueError("no 'files' or 'piece_bytes'")
        if not isinstance(manifest.get("run_id", ""), str):
            raise ValueError("its 'run_id' is not a string")
        return manifest
    except (ValueError, OSError, AttributeError) as e:
        raise UserError(
            f"checkpoint {folder} is damaged: its {MANIFEST} cannot be read ({first_line(e)})"
        ) from None


def share(manifest: dict, rank: int, world_size: int) -> list[str]:
    """The files that this rank verifies: those its writer's rank maps to (.metadata: rank 0)."""
    writer = lambda name: int(match.group(1)) if (match := WRITER.match(name)) else 0
    return [name for name in manifest["files"] if writer(name) % world_size == rank]


def problems(folder: Path, manifest: dict, names: list[str]) -> list[str]:
    """What differs from the recorded checksums among the named files, one phrase per file."""
    found, intact = [], []
    for name in names:
        path, recorded = folder / name, manifest["files"][name]
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != recorded["size"]:
            found.append(f"{name} is {path.stat().st_size} bytes, {recorded['size']} when it was saved")
        else:
            intact.append(path)
    piece_bytes = manifest["piece_bytes"]
    for name, now in checksum(intact, piece_bytes).items():
        if problem := _differs(name, now, manifest["files"][name]["crc32"], piece_bytes):
            found.append(problem)
    return found


def unlisted(folder: Path, manifest: dict) -> list[str]:
    """The folder's entries that checksums.json does not cover (besides itself), one phrase each."""
    return [
        f"{path.name} is not in its {MANIFEST} (added after saving?)"
        for path in sorted(folder.iterdir())
        if path.name != MANIFEST and path.name not in manifest["files"]
    ]


def problem_in(manifest: dict, name: str, data: bytes) -> str | None:
    """What differs from the recorded checksums in a file's bytes, already read (.metadata, checked
    on the very bytes that are then unpickled); None if nothing. A file the manifest lacks is a
    problem: every checksums.json this repository writes names .metadata."""
    recorded = manifest["files"].get(name)
    if recorded is None:
        return f"{name} has no checksum in {MANIFEST}"
    if len(data) != recorded["size"]:
        return f"{name} is {len(data)} bytes, {recorded['size']} when it was saved"
    piece_bytes, view = manifest["piece_bytes"], memoryview(data)
    starts = range(0, len(data) or 1, piece_bytes)
    crc32 = [f"{zlib.crc32(view[start : start + piece_bytes]):08x}" for start in starts]
    return _differs(name, {"size": len(data), "crc32": crc32}, recorded["crc32"], piece_bytes)


def _differs(name: str, now: dict, recorded: list[str], piece_bytes: int) -> str | None:
    damaged = [i for i, (a, b) in enumerate(zip(now["crc32"], recorded)) if a != b]
    if not damaged and len(now["crc32"]) == len(recorded):
        return None
    start = damaged[0] * piece_bytes if damaged else 0
    end = min(start + piece_bytes, now["size"])
    return f"{name} does not match its checksum: bytes {start}-{end} changed after saving"


def verify(folder: Path) -> None:
    """Check every file in one process (the conversion scripts); an unverifiable checkpoint passes."""
    manifest = read_manifest(folder)
    if manifest is None:
        return
    if found := unlisted(folder, manifest) + problems(folder, manifest, list(manifest["files"])):
        raise UserError(f"checkpoint {folder} is damaged: {found[0]}; nothing was loaded")
