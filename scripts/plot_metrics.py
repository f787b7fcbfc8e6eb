"""Plot metrics.jsonl files (or run folders) to a PNG: loss, validation loss, grad norm, lr,
throughput and memory against the step, one line per run.

    python scripts/plot_metrics.py outputs/bf16 outputs/float8 --output outputs/compare.png
    python scripts/plot_metrics.py outputs/run/metrics.jsonl --keys loss,tps

metrics.jsonl holds one training record per step (a resumed run drops the records of the steps it
redoes); in a file written before that was so, a repeated step keeps its last record. Needs matplotlib.

Runs with the same curve would hide each other (a run and its resume on another layout should be
identical): each run gets its own line style, and the legend says which runs' first panel (the loss
by default) is identical to an earlier run's.
"""

import argparse
import json
import math
import sys
from pathlib import Path

PANELS = ["loss", "val_loss", "grad_norm", "lr", "tps", "memory_gib"]
# Drawn later on top, a dashed or dotted line still shows the solid one under it.
LINE_STYLES = ["-", "--", ":", "-."]


def read(path: Path) -> dict[int, dict]:
    file = path / "metrics.jsonl" if path.is_dir() else path
    records = {}
    for line in file.read_text().splitlines():
        record = json.loads(line)
        # A step's validation record joins its training record; a later line of the same step wins.
        records.setdefault(record["step"], {}).update(record)
    return dict(sorted(records.items()))


def curve(records: dict[int, dict], key: str) -> list[tuple[int, float]]:
    return [(step, r[key]) for step, r in records.items() if r.get(key) is not None]


def legend_labels(runs: dict[str, dict[int, dict]], key: str) -> list[str]:
    """Each run's name, with "identical to <run>" where its curve of key equals an earlier run's."""
    labels, seen = [], {}
    for name, records in runs.items():
        points = tuple(curve(records, key))
        same = seen.setdefault(points, name) if points else name
        labels.append(f"{name} ({key} identical to {same})" if same != name else name)
    return labels


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="metrics.jsonl files or run folders")
    parser.add_argument("--output", default="metrics.png")
    parser.add_argument("--keys", default=",".join(PANELS), help="comma-separated metrics to plot")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    runs = {}
    for run in args.runs:
        path = Path(run)
        if not (path / "metrics.jsonl").is_file() and not path.is_file():
            print(f"error: no metrics.jsonl at '{run}'", file=sys.stderr)
            return 2
        runs[str(path.parent if path.is_file() else path)] = read(path)
    keys = [k for k in args.keys.split(",") if any(k in r for run in runs.values() for r in run.values())]
    if not keys:
        print(f"error: none of {args.keys} is in the metrics", file=sys.stderr)
        return 2
    columns = min(3, len(keys))
    rows = math.ceil(len(keys) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
    labels = legend_labels(runs, keys[0])
    for axis, key in zip(axes.flat, keys):
        for index, (label, records) in enumerate(zip(labels, runs.values())):
            points = curve(records, key)
            if points:
                axis.plot(*zip(*points), label=label, linestyle=LINE_STYLES[index % len(LINE_STYLES)])
        axis.set_title(key)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(keys) :]:
        axis.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
