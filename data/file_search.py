"""The text files a training.dataset_path names: a file, a folder (searched recursively) or a glob.

Links are followed, but never around a loop (a folder reached again through a link is not entered
again: `latest -> .` or two links pointing at each other), and a file reached by several paths is
read once, under the first of its paths in sorted order. glob's own `**` follows links without
either check: a corpus with `latest -> .` was read 41 times per epoch, two looping links never
returned.
"""

import fnmatch
import os
import re
from pathlib import Path

from configs import UserError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
GLOB_CHARACTERS = re.compile(r"[*?[]")


def find_text_files(dataset_path: str) -> list[Path]:
    """The .txt, .jsonl and .parquet files dataset_path names, sorted, each file once."""
    path = Path(dataset_path)
    if path.is_file():
        candidates = [path]
    elif path.is_dir():
        candidates = list(_walk(path))
    else:
        candidates = _glob(dataset_path)
    files, seen = [], set()
    for file in sorted(p for p in candidates if p.suffix in TEXT_SUFFIXES):
        identity = _identity(file)
        if identity is not None and identity not in seen:
            seen.add(identity)
            files.append(file)
    if not files:
        raise UserError(f"training.dataset_path '{dataset_path}' names no .txt, .jsonl or .parquet files")
    return files


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:  # a dangling link
        return None
    return status.st_dev, status.st_ino


def _walk(root: Path):
    """Every file under root, following links into folders not entered before."""
    entered = set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        identity = _identity(Path(folder))
        if identity in entered:
            subfolders[:] = []  # reached again through a link: already read
            continue
        entered.add(identity)
        subfolders.sort()
        for name in names:
            yield Path(folder) / name


def _glob(pattern: str) -> list[Path]:
    """glob with `**` (any number of folders), `*`, `?` and `[...]` per path component."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if GLOB_CHARACTERS.search(part)), len(parts))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    if not root.is_dir():
        return []
    wanted = parts[fixed:]
    return [file for file in _walk(root) if _matches(wanted, file.relative_to(root).parts)]


def _matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":  # zero or more folders
        return any(_matches(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(pattern[1:], parts[1:])
