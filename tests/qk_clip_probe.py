"""Run under torchrun: MuonClip on one batch, as train.py builds the model (arguments: config
overrides). The attention weights are scaled up (logits of ~10-50), one forward of a fixed global
batch (each data-parallel rank its share) records the logit maxima, and one clip brings every head
to the threshold. Rank 0 prints each query/key weight's whole-tensor norm before and after the clip, which
tests/test_muon.py compares between layouts and one process."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import load_config
from parallelisms import ParallelDims
from training.model_setup import build_model
from training.qk_clip import qk_clip_for

dist.init_process_group("gloo")
config = load_config(["--model.flavor", "tiny", "--training.device", "cpu", *sys.argv[1:]])
dims = ParallelDims.from_config(config.parallelism, dist.get_world_size())
mesh = dims.build_mesh("cpu")
model = build_model(config, dims, mesh, torch.device("cpu"))
clip = qk_clip_for(model.parts, config.optimizer.qk_clip_threshold, dims, mesh, torch.device("cpu"))
(part,) = model.parts
attentions = [m for m in part.modules() if hasattr(m, "qk_clip_scales")]
names = [f"{i}.{name}" for i, m in enumerate(attentions) for name in m.qk_clip_scales(torch.ones(m.n_heads))]
with torch.no_grad():
    for name in names:
        index, weight = name.split(".", 1)
        attentions[int(index)].get_parameter(weight).mul_(6.0)
    tokens = torch.randint(0, 258, (4, 16), generator=torch.Generator().manual_seed(0))
    share = 4 // dims.dp
    dp_rank = mesh["dp"].get_local_rank()
    part(tokens[dp_rank * share : (dp_rank + 1) * share])


def print_norms(when: str) -> None:
    for name in names:
        index, weight = name.split(".", 1)
        param = attentions[int(index)].get_parameter(weight)
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        if dist.get_rank() == 0:
            print(f"{when} {name} {whole.double().norm().item():.9e}")


print_norms("before")
clip.after_step()
print_norms("after")
dist.barrier()
dist.destroy_process_group()
