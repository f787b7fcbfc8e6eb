"""What the controller reads from a run's folder: the last logged step (its sign of progress) and the
latest complete checkpoint (where a restarted job resumes). Plain file reads, no torch: the
controller stays light and starts fast."""

import json
import re
from pathlib import Path

TAIL_BYTES = 65536  # more than a few metrics.jsonl records (source_samples can make them long)
COMPLETE_CHECKPOINT = re.compile(r"^step-(\d+)$")


def last_logged_step(metrics_file: Path) -> int | None:
    """The step of the last complete record in metrics.jsonl (training or validation), or None."""
    try:
        with open(metrics_file, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line being written, or cut at the tail's start
    return None


def latest_checkpoint_step(checkpoint_folder: Path) -> int | None:
    """The step of the latest complete checkpoint, by checkpoint/saving.py's rule: a folder step-N
    that holds .metadata (saves in progress are step-N.partial; DCP writes .metadata last)."""
    steps = []
    if checkpoint_folder.is_dir():
        for path in checkpoint_folder.iterdir():
            match = COMPLETE_CHECKPOINT.match(path.name)
            if match and (path / ".metadata").is_file():
                steps.append(int(match.group(1)))
    return max(steps, default=None)
