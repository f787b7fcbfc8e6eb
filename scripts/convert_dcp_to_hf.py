"""Export a checkpoint's weights as a Hugging Face folder (safetensors + config.json).

    python scripts/convert_dcp_to_hf.py --checkpoint outputs/llama3_8b/checkpoint/step-1000 \\
        --output outputs/hf/llama3_8b_step1000 --dtype bfloat16

The model (family, flavor, model.args) comes from the run's resolved config.toml, found next to the
checkpoint folder unless --config names one. Runs in one process on the CPU: memory holds the full
model once. config.json and generation_config.json carry the BOS/EOS ids of the run's tokenizer
(model.hf_assets_path, whose files are copied along, or the built-in byte tokenizer's 256/257), so
transformers' generate() stops at the end of text. The output folder must not exist. A parameter
the model's adapter has no Hugging Face name for (a fork's) is refused in one line naming it.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint import data_only, hf, integrity
from configs import UserError
from configs.errors import first_line
from scripts.model_from_config import build_meta_model, load_run_config, one_process_dcp


def convert(args: argparse.Namespace) -> None:
    checkpoint, output = Path(args.checkpoint), Path(args.output)
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    if not (checkpoint / ".metadata").is_file():
        raise UserError(f"'{checkpoint}' is not a complete checkpoint (no .metadata)")
    integrity.verify(checkpoint)
    data_only.read_metadata(checkpoint)  # (refused here, in one line, rather than inside DCP's load)
    config = load_run_config(args.config, checkpoint)
    spec, model_args, model = build_meta_model(config)
    state = {name: torch.empty(p.shape, dtype=torch.float32) for name, p in model.named_parameters()}
    try:
        with one_process_dcp():
            dcp.load(
                {"model": state},
                storage_reader=data_only.DataOnlyReader(checkpoint),
                planner=DefaultLoadPlanner(allow_partial_load=True),
            )
    except (Exception, dcp.CheckpointException) as e:
        if refusal := data_only.not_data_in(e):
            raise data_only.refused(checkpoint, refusal) from None
        raise UserError(f"cannot read the model from {checkpoint}: {first_line(e)}") from None
    adapter = hf.require(spec.adapter(model_args))
    hf.save(state, adapter, output, getattr(torch, args.dtype), config.model.hf_assets_path)
    print(f"wrote {output}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder")
    parser.add_argument("--output", required=True, help="new folder for the Hugging Face files")
    parser.add_argument("--config", help="the run's config.toml (default: next to the checkpoint)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the exported tensors (default: %(default)s)",
    )
    try:
        convert(parser.parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
