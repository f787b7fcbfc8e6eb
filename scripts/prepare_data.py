"""Tokenize a corpus once into memory-mapped token shards (training.dataset = "tokens").

    python scripts/prepare_data.py --dataset text --dataset-path "corpus/*.jsonl" \\
        --hf-assets-path assets/llama3 --output data/corpus_llama3 --workers 16
    python scripts/prepare_data.py --dataset python_docs --output /tmp/python_docs_bytes

Each document becomes its tokens followed by EOS, in the order training would read it. Shards are
raw uint16 (vocabulary <= 65536) or uint32 files plus meta.json. --workers N processes tokenize
pieces of the corpus (units of about --unit-bytes: whole small files, line ranges of a large
.jsonl, row groups of a large .parquet); the output is the same bytes for any N. The output folder
is written under <output>.partial and renamed when complete; an existing folder is never
overwritten. An interrupted run (killed, Ctrl-C, a bad file fixed since) continues where it
stopped when run again with the same arguments. The engine: data/preparation.py.
"""

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import UserError
from data.preparation import Settings, prepare


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
    parser.add_argument("--workers", type=int, default=1, help="processes that tokenize")
    parser.add_argument("--unit-bytes", type=int, default=2**28, help="input bytes per unit of work")
    args = parser.parse_args()
    # SIGTERM stops the workers and keeps finished units, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for flag, value in (("--workers", args.workers), ("--unit-bytes", args.unit_bytes),
                            ("--shard-tokens", args.shard_tokens)):  # fmt: skip
            if value < 1:
                raise UserError(f"{flag} must be at least 1, got {value}")
        settings = Settings(args.dataset, args.dataset_path, args.text_field, args.subset, args.split,
                            args.hf_assets_path, args.shard_tokens)  # fmt: skip
        prepare(settings, Path(args.output), args.workers, args.unit_bytes)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
