"""Export a checkpoint's weights as a Hugging Face folder (safetensors + config.json).

    python scripts/convert_dcp_to_hf.py --checkpoint outputs/llama3_8b/checkpoint/step-1000 \\
        --output exports/llama3_8b_step1000 --dtype bfloat16

The model (family, flavor, model.args) comes from the run's resolved config.toml, found next to the
checkpoint folder unless --config names one. Runs in one process on the CPU: memory holds the full
model once. Tokenizer files from model.hf_assets_path are copied along. The output folder must not
exist.
"""

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import hf
from configs import UserError
from configs.errors import first_line
from scripts.model_from_config import build_meta_model, load_run_config

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def convert(args: argparse.Namespace) -> None:
    checkpoint, output = Path(args.checkpoint), Path(args.output)
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    if not (checkpoint / ".metadata").is_file():
        raise UserError(f"'{checkpoint}' is not a complete checkpoint (no .metadata)")
    config = load_run_config(args.config, checkpoint)
    spec, model_args, model = build_meta_model(config)
    state = {name: torch.empty(p.shape, dtype=torch.float32) for name, p in model.named_parameters()}
    try:
        dcp.load(
            {"model": state},
            checkpoint_id=str(checkpoint),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    except (Exception, dcp.CheckpointException) as e:
        raise UserError(f"cannot read the model from {checkpoint}: {first_line(e)}") from None
    hf.save(state, spec.state_dict_adapter(model_args), output, getattr(torch, args.dtype))
    assets = Path(config.model.hf_assets_path) if config.model.hf_assets_path else None
    for name in TOKENIZER_FILES if assets else ():
        if (assets / name).is_file():
            shutil.copy(assets / name, output / name)
    print(f"wrote {output}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder")
    parser.add_argument("--output", required=True, help="new folder for the Hugging Face files")
    parser.add_argument("--config", help="the run's config.toml (default: next to the checkpoint)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    try:
        convert(parser.parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
