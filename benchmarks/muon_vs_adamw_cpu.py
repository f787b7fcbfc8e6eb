"""Muon against AdamW on the CPU, honestly: held-out loss against tokens on a real corpus that the
runs do not memorize, a small lr sweep for each optimizer, the same tokens for every run.

Corpus: the Python standard library's sources (this interpreter's), one document per file, every
20th file (by sorted path) held out for validation. Byte-level tokenizer (the built-in one).
Each run: `python train.py --config configs/<model>_debug-like settings>` with the overrides below;
validation every --val-every steps on the same held-out batches.

    python benchmarks/muon_vs_adamw_cpu.py --out /tmp/muon_cpu --steps 600 \
        --sweep AdamW:1e-3,3e-3,1e-2 --sweep Muon:1e-2,2e-2,4e-2 [--model llama3] [-- overrides]

Writes <out>/results.json (validation loss per run and step), <out>/summary.md (the best run of
each optimizer, and the tokens Muon needs to reach AdamW's final loss) and <out>/plot.png (needs
matplotlib, which the repository does not depend on).
"""

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {  # the debug flavors; qwen3_moe's with DeepSeek-V3-style routing as its parity tests run
    "llama3": ["--model.name", "llama3", "--model.flavor", "debugmodel"],
    "qwen3_moe": ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"],
}


def write_corpus(out: Path) -> tuple[Path, Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for f in files if "site-packages" not in f.parts and "test" not in f.parts]
    train, val = out / "train.jsonl", out / "val.jsonl"
    with train.open("w") as t, val.open("w") as v:
        for index, path in enumerate(files):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            (v if index % 20 == 0 else t).write(json.dumps({"text": text}) + "\n")
    return train, val


def run(out: Path, name: str, optimizer: str, lr: float, args, train: Path, val: Path) -> list[dict]:
    folder = out / name
    if not (folder / "metrics.jsonl").exists():
        command = [
            sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/llama3_debug.toml"),
            *MODELS[args.model],
            "--training.device", "cpu", "--training.dataset", "text", "--training.dataset_path", str(train),
            "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
            "--training.global_batch_size", str(args.batch),
            "--training.steps", str(args.steps), "--training.max_norm", "1.0",
            "--lr_scheduler.warmup_steps", str(args.steps // 20), "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.min_lr_factor", "0.1",
            "--optimizer.name", optimizer, "--optimizer.lr", str(lr),
            "--validation.enable", "--validation.freq", str(args.val_every), "--validation.steps", "8",
            "--validation.dataset", "text", "--validation.dataset_path", str(val),
            "--metrics.log_freq", str(args.val_every), "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(folder), *args.overrides,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=REPO)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_loss" in r]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama3", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--sweep", action="append", required=True, help="Optimizer:lr,lr,...")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every run (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    train, val = write_corpus(args.out)
    tokens_per_step = args.seq_len * args.batch
    results = {}
    for sweep in args.sweep:
        optimizer, lrs = sweep.split(":")
        for lr in lrs.split(","):
            name = f"{args.model}-{optimizer}-lr{lr}"
            records = run(args.out, name, optimizer, float(lr), args, train, val)
            results[name] = {"optimizer": optimizer, "lr": float(lr),
                             "tokens": [r["step"] * tokens_per_step for r in records],
                             "val_loss": [r["val_loss"] for r in records]}  # fmt: skip
            print(f"{name}: final validation loss {records[-1]['val_loss']:.4f}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    best = {}
    for name, result in results.items():
        if (
            result["optimizer"] not in best
            or result["val_loss"][-1] < results[best[result["optimizer"]]]["val_loss"][-1]
        ):
            best[result["optimizer"]] = name
    lines = [f"# {args.model}: Muon against AdamW, {args.steps} steps of {tokens_per_step} tokens", ""]
    lines += ["| run | lr | final validation loss |", "|---|---|---|"]
    lines += [f"| {n} | {r['lr']:g} | {r['val_loss'][-1]:.4f} |" for n, r in results.items()]
    if {"AdamW", "Muon"} <= set(best):
        adamw, muon = results[best["AdamW"]], results[best["Muon"]]
        target = adamw["val_loss"][-1]
        reached = next((t for t, loss in zip(muon["tokens"], muon["val_loss"]) if loss <= target), None)
        lines += ["", f"best AdamW: {best['AdamW']}, {target:.4f}; best Muon: {best['Muon']}, "
                  f"{muon['val_loss'][-1]:.4f}"]  # fmt: skip
        if reached:
            share = reached / adamw["tokens"][-1]
            total = adamw["tokens"][-1]
            lines.append(f"Muon reaches AdamW's final loss at {reached:,} tokens of {total:,} ({share:.0%})")
        else:
            lines.append("Muon does not reach AdamW's final loss")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        style = "-" if name in best.values() else ":"
        axes.plot(
            result["tokens"], result["val_loss"], style, label=f"{result['optimizer']} lr {result['lr']:g}"
        )
    axes.set_xlabel("training tokens")
    axes.set_ylabel("held-out validation loss (nats/byte)")
    axes.set_title(f"{args.model} debug model on the Python standard library, CPU")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.out / "plot.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
