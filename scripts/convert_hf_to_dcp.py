"""Turn a Hugging Face folder of safetensors into a checkpoint that checkpoint.initial_load_path takes.

    python scripts/convert_hf_to_dcp.py --hf ~/models/Llama-3.1-8B --config configs/llama3_8b.toml \\
        --output checkpoints/llama3_8b_hf

(train.py also reads a Hugging Face folder given as checkpoint.initial_load_path directly, each
rank reading only its shard of each tensor.) One process, CPU;
memory holds the model once, in the files' dtype unless --dtype converts. The output folder must
not exist.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import hf, integrity
from configs import UserError
from scripts.model_from_config import build_meta_model, load_run_config, one_process_dcp


def convert(args: argparse.Namespace) -> None:
    source, output = Path(args.hf), Path(args.output)
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    if not hf.is_hf_folder(source):
        raise UserError(f"--hf '{source}' holds no .safetensors files")
    spec, model_args, model = build_meta_model(load_run_config(args.config, None))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    dtype = getattr(torch, args.dtype) if args.dtype else None
    state = hf.read_full(source, hf.require(spec.adapter(model_args)), shapes, dtype)
    with one_process_dcp():
        dcp.save({"model": state}, checkpoint_id=str(output))
    integrity.record(output)
    print(f"wrote {output}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, help="folder with *.safetensors")
    parser.add_argument("--config", required=True, help="a config (.toml) naming the model")
    parser.add_argument("--output", required=True, help="new checkpoint folder")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="dtype of the checkpoint's tensors (default: the Hugging Face files' own)",
    )
    try:
        convert(parser.parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
