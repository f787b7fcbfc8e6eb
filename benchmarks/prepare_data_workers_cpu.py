"""Token shard preparation on the CPU: tokens per second of scripts/prepare_data.py --workers N, for
the byte tokenizer and a 32,000-token byte-level BPE.

Corpus: the Python standard library's sources (this interpreter's, site-packages left out), one
document per file, repeated into one .jsonl of --corpus-mib MiB, written once under --out. The BPE
is trained once on one copy of those sources (kept in <out>/bpe_<vocab>/) unless --hf-assets-path
names a folder with a tokenizer.json. Units are --unit-mib MiB, so that every worker has work.

Each run is the whole command (start-up, planning, tokenizing, joining into shards) into a new
folder; tokens/s is the tokens written over its wall time, the median of --repeats runs; speed-up
is against the first --workers value given. The shards of every run are checked to be the same
bytes as the first run's with the same tokenizer.

    python benchmarks/prepare_data_workers_cpu.py --out /tmp/prepare_data_workers --workers 1 2 \\
        --repeats 3

Writes <out>/results.json (every run) and <out>/summary.md (the table). Run it on an otherwise idle
machine: the workers need a core each.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def standard_library_texts() -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = []
    for path in files:
        if "site-packages" in path.parts:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def write_corpus(folder: Path, mib: int, texts: list[str]) -> Path:
    corpus = folder / f"corpus_{mib}mib" / "stdlib.jsonl"
    if corpus.is_file():
        return corpus
    corpus.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": text}) + "\n" for text in texts]
    written, partial = 0, corpus.with_suffix(".partial")
    with partial.open("w") as out:
        while written < mib * 2**20:
            for line in lines:
                out.write(line)
                written += len(line.encode())
                if written >= mib * 2**20:
                    break
    partial.rename(corpus)
    return corpus


def train_bpe(folder: Path, vocab_size: int, texts: list[str]) -> Path:
    assets = folder / f"bpe_{vocab_size}"
    if (assets / "tokenizer.json").is_file():
        return assets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    assets.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    return assets


def prepare_once(corpus: Path, hf_assets_path: str, workers: int, unit_mib: int, output: Path) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, str(REPO / "scripts/prepare_data.py"), "--dataset", "text",
               "--dataset-path", str(corpus), "--hf-assets-path", hf_assets_path, "--output", str(output),
               "--workers", str(workers), "--unit-bytes", str(unit_mib * 2**20)]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    seconds = time.perf_counter() - started
    meta = json.loads((output / "meta.json").read_text())
    digest = hashlib.sha256()
    for shard in meta["shards"]:
        digest.update((output / shard["file"]).read_bytes())
    shutil.rmtree(output)
    tokens = sum(shard["num_tokens"] for shard in meta["shards"])
    return {"seconds": seconds, "tokens": tokens, "sha256": digest.hexdigest()}


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus-mib", type=int, default=64)
    parser.add_argument("--unit-mib", type=int, default=4, help="--unit-bytes of each run, in MiB")
    parser.add_argument("--bpe-vocab", type=int, default=32000, help="vocabulary of the BPE trained here")
    parser.add_argument("--hf-assets-path", default="", help="a tokenizer.json folder instead of the BPE")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = standard_library_texts()
    corpus = write_corpus(args.out, args.corpus_mib, texts)
    bpe = args.hf_assets_path or str(train_bpe(args.out, args.bpe_vocab, texts))
    tokenizers = {"bytes": "", f"BPE {Path(bpe).name}": bpe}
    runs = []
    for name, assets in tokenizers.items():
        for repeat in range(args.repeats):
            for workers in args.workers:  # alternated, so that a slow spell of the machine hits every N
                run = prepare_once(corpus, assets, workers, args.unit_mib, args.out / "shards")
                runs.append({"tokenizer": name, "workers": workers, "repeat": repeat, **run})
                print(json.dumps(runs[-1]), flush=True)
        digests = {run["sha256"] for run in runs if run["tokenizer"] == name}
        if len(digests) != 1:
            raise SystemExit(f"{name}: the shards differ between runs: {sorted(digests)}")
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version()}  # fmt: skip
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    results = {"machine": machine, "settings": settings, "corpus_bytes": corpus.stat().st_size, "runs": runs}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    lines = [f"Corpus: {corpus.stat().st_size / 2**20:.0f} MiB of .jsonl, units of {args.unit_mib} MiB, "
             f"median of {args.repeats} runs, {os.cpu_count()} cores.", "",
             "| tokenizer | workers | tokens | seconds | tokens/s | tokens/s per worker | speed-up |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in tokenizers:
        base = None
        for workers in args.workers:
            mine = [run for run in runs if run["tokenizer"] == name and run["workers"] == workers]
            seconds = statistics.median(run["seconds"] for run in mine)
            rate = mine[0]["tokens"] / seconds
            base = base or rate
            lines.append(f"| {name} | {workers} | {mine[0]['tokens']:,} | {seconds:.1f} | {rate:,.0f} | "
                         f"{rate / workers:,.0f} | {rate / base:.2f}x |")  # fmt: skip
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
