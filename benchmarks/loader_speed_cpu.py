"""The loader alone, on the CPU: tokens per second one rank's StepLoader hands out, no training.

    taskset -c 1 python benchmarks/loader_speed_cpu.py --out /tmp/loader_speed [--seconds 10] \\
        [--seq-len 8192] [--hf-assets-path FOLDER_WITH_TOKENIZER_JSON]

Cases: a shuffled mixture of three token-shard sources (weights 0.6/0.3/0.1, ~200 M tokens each,
written once under --out; seq 8192, local batch 1) as rank 0 of 1 and rank 0 of 8; the bundled
text sample tokenized while loading with the byte tokenizer, and with --hf-assets-path's tokenizer.
The bar (issue 52): the mixture >= 1.1 M tokens/s per rank on one core, 20x what one H200 trains
the 1B model at. Writes <out>/results.json and prints one line per case.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config  # noqa: E402
from data.loader import build_dataloader  # noqa: E402
from data.shards import write_meta  # noqa: E402
from data.tokenizer import build_tokenizer  # noqa: E402


def write_sources(root: Path, tokens_per_source: int) -> list[Path]:
    folders = []
    generator = np.random.default_rng(0)
    for name in ("web", "code", "math"):
        folder = root / name
        folders.append(folder)
        if (folder / "meta.json").exists():
            continue
        folder.mkdir(parents=True)
        chunk = 2**24
        with (folder / "tokens-00000.bin").open("wb") as f:
            for start in range(0, tokens_per_source, chunk):
                generator.integers(0, 258, min(chunk, tokens_per_source - start), dtype=np.uint16).tofile(f)
        shards = [{"file": "tokens-00000.bin", "num_tokens": tokens_per_source}]
        write_meta(folder, "uint16", 258, 257, "benchmark", "bytes", shards)
    return folders


def measure(argv: list[str], dp_rank: int, dp_degree: int, seconds: float, hf_assets_path: str = "") -> float:
    training = load_config(["--training.local_batch_size", "1", *argv]).training
    tokenizer = build_tokenizer(hf_assets_path)
    loader = build_dataloader(training, tokenizer, dp_degree, dp_rank, dp_degree, prefetch_steps=0)
    loader.next_step()  # opened (memory maps, first documents)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in loader.next_step():
            tokens += batch["input"].numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--tokens-per-source", type=int, default=200_000_000)
    parser.add_argument("--hf-assets-path", default="")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folders = write_sources(args.out / "sources", args.tokens_per_source)
    mixture = ["--training.dataset", "tokens", "--training.dataset_path", ",".join(map(str, folders)),
               "--training.dataset_weights", "0.6,0.3,0.1",
               "--training.seq_len", str(args.seq_len)]  # fmt: skip
    text = ["--training.dataset", "python_docs", "--training.seq_len", str(args.seq_len)]
    cases = {
        "mixture of 3, shuffled, rank 0 of 1": (mixture, 0, 1, ""),
        "mixture of 3, shuffled, rank 0 of 8": (mixture, 0, 8, ""),
        "text, byte tokenizer, rank 0 of 1": (text, 0, 1, ""),
    }
    if args.hf_assets_path:
        cases[f"text, {args.hf_assets_path}, rank 0 of 1"] = (text, 0, 1, args.hf_assets_path)
    results = {}
    for name, (argv, rank, degree, assets) in cases.items():
        results[name] = measure(argv, rank, degree, args.seconds, assets)
        print(f"{name}: {results[name]:,.0f} tokens/s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
