"""Tokenize a corpus once into memory-mapped token shards (training.dataset = "tokens").

    python scripts/prepare_data.py --dataset text --dataset-path "corpus/*.jsonl" \\
        --hf-assets-path assets/llama3 --output data/corpus_llama3
    python scripts/prepare_data.py --dataset python_docs --output /tmp/python_docs_bytes

Each document becomes its tokens followed by EOS, in the order training would read it. Shards are
raw uint16 (vocabulary <= 65536) or uint32 files plus meta.json. The output folder is written under
a temporary name and renamed when complete; an existing folder is never overwritten.
"""

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import UserError
from data.packing import tokenize
from data.shards import write_meta
from data.sources import build_document_source
from data.tokenizer import build_tokenizer


def prepare(args: argparse.Namespace) -> None:
    output = Path(args.output)
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    tokenizer = build_tokenizer(args.hf_assets_path)
    documents = build_document_source(
        args.dataset, args.dataset_path, args.text_field, args.subset, args.split
    )
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    partial = output.with_name(output.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # our own leftover from an interrupted run
    partial.mkdir(parents=True)

    shards: list[dict] = []
    pending: list[np.ndarray] = []
    pending_tokens = 0

    def flush() -> None:
        nonlocal pending, pending_tokens
        name = f"tokens-{len(shards):05d}.bin"
        np.concatenate(pending).astype(dtype).tofile(partial / name)
        shards.append({"file": name, "num_tokens": pending_tokens})
        print(f"wrote {name}: {pending_tokens:,} tokens", flush=True)
        pending, pending_tokens = [], 0

    total_documents = 0
    try:
        for _, tokens in tokenize(documents, tokenizer):  # one epoch, as training reads it
            pending.append(tokens)
            pending_tokens += len(tokens)
            total_documents += 1
            if pending_tokens >= args.shard_tokens:
                flush()
    except UserError:
        shutil.rmtree(partial)
        raise
    if pending_tokens:
        flush()
    tokenizer_name = args.hf_assets_path or "byte"
    write_meta(
        partial, np.dtype(dtype).name, tokenizer.vocab_size, tokenizer.eos_id, tokenizer_name,
        tokenizer.identity, shards,
    )
    partial.rename(output)
    total = sum(s["num_tokens"] for s in shards)
    files = f"{len(shards)} shard{'s' * (len(shards) != 1)}"
    print(f"{total_documents:,} documents, {total:,} tokens in {files} -> {output}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", choices=["python_docs", "text", "hf"], default="text")
    parser.add_argument("--dataset-path", default="", help="file, folder or glob (text); name (hf)")
    parser.add_argument("--text-field", default="text", help="field of .jsonl/.parquet rows")
    parser.add_argument("--subset", default="", help="HF dataset configuration name")
    parser.add_argument("--split", default="train", help="HF dataset split")
    parser.add_argument("--hf-assets-path", default="", help="folder with tokenizer.json; empty = bytes")
    parser.add_argument("--output", required=True, help="new folder for the shards")
    parser.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard file")
    try:
        prepare(parser.parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
