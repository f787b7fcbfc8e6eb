"""Turn a Hugging Face folder of safetensors into a checkpoint that checkpoint.initial_load_path takes.

    python scripts/convert_hf_to_dcp.py --hf ~/models/Llama-3.1-8B --config configs/llama3_8b.toml \\
        --output checkpoints/llama3_8b_hf

(train.py also reads a Hugging Face folder given as checkpoint.initial_load_path directly; a
converted checkpoint loads faster on many ranks, each reading only its shards.) One process, CPU;
memory holds the model once, in the files' dtype. The output folder must not exist.
"""

import argparse
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import UserError
from scripts.model_from_config import build_meta_model, load_run_config


def convert(args: argparse.Namespace) -> None:
    source, output = Path(args.hf), Path(args.output)
    if output.exists():
        raise UserError(f"--output '{output}' already exists; choose a new folder")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise UserError(f"--hf '{source}' holds no .safetensors files")
    spec, model_args, model = build_meta_model(load_run_config(args.config, None))
    adapter = spec.state_dict_adapter(model_args)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for hf_name in tensors.keys():
                try:
                    state.update(adapter.from_hf({hf_name: tensors.get_tensor(hf_name)}))
                except KeyError as e:
                    raise UserError(f"{file}: {e.args[0]}") from None
    for name, shape in expected.items():
        if name not in state:
            raise UserError(f"{source} has no tensor for {name}")
        if tuple(state[name].shape) != shape:
            raise UserError(f"{source}: {name} is {tuple(state[name].shape)}, the model's is {shape}")
    dcp.save({"model": {name: state[name] for name in expected}}, checkpoint_id=str(output))
    print(f"wrote {output}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, help="folder with *.safetensors")
    parser.add_argument("--config", required=True, help="a config (.toml) naming the model")
    parser.add_argument("--output", required=True, help="new checkpoint folder")
    try:
        convert(parser.parse_args())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
