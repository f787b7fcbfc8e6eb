"""How the model is cut into pipeline stages, and which stages a rank runs (no processes needed)."""

import pytest
import torch

from configs import UserError, load_config
from models import get_model_spec
from models.spec import model_args
from parallelisms.pipeline import check_schedule, keep_only, stage_module_names, stages_of_rank

HEAD, TAIL = ["tok_embeddings"], ["norm", "output"]


def layers(n):
    return [f"layers.{i}" for i in range(n)]


def split(n_layers, pp, *argv):
    config = load_config(list(argv)).parallelism
    return stage_module_names(HEAD, layers(n_layers), TAIL, config, pp)


def test_balanced_split_counts_embedding_and_output_as_layers():
    # 8 layers + 2 = 10 units over 4 stages: 2, 3, 3, 2; embedding and output one unit each.
    assert split(8, 4) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2", "layers.3"],
        ["layers.4", "layers.5", "layers.6"],
        ["layers.7", "norm", "output"],
    ]
    # Interleaved schedules default to two stages per rank.
    stages = split(6, 2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    assert (
        len(stages) == 4
        and stages[0] == ["tok_embeddings", "layers.0"]
        and stages[-1] == ["layers.5", "norm", "output"]
    )
    assert [name for stage in stages for name in stage] == [*HEAD, *layers(6), *TAIL]


def test_explicit_layers_per_stage_and_split_points():
    assert split(6, 2, "--parallelism.pipeline_parallel_layers_per_stage", "3") == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]
    assert split(6, 2, "--parallelism.pipeline_parallel_split_points", "layers.2") == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "output"],
    ]


def test_split_errors():
    with pytest.raises(UserError, match="need at least 6 layers; the model has 4"):
        split(4, 4, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    with pytest.raises(UserError, match=r"\['layers.9'\] are not layers"):
        split(4, 2, "--parallelism.pipeline_parallel_split_points", "layers.9")
    with pytest.raises(UserError, match="1F1B runs one stage per rank, but the split gives 2"):
        stages_of_rank(0, 2, 4, "1F1B")
    with pytest.raises(UserError, match="3 pipeline stages do not divide over pipeline_parallel_degree 2"):
        stages_of_rank(0, 2, 3, "1F1B")
    with pytest.raises(UserError, match="ZBVZeroBubble runs two stages per rank"):
        stages_of_rank(0, 2, 6, "ZBVZeroBubble")


def test_stage_placement():
    assert [stages_of_rank(r, 4, 8, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, 8, "DualPipeV") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stages_of_rank(1, 2, 2, "GPipe") == [1]


def test_zero_bubble_schedules_refused_with_fsdp_only():
    for schedule in ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]:
        config = load_config(["--parallelism.pipeline_parallel_schedule", schedule]).parallelism
        with pytest.raises(UserError, match=f"{schedule} with FSDP gives wrong gradients"):
            check_schedule(config, fsdp_enabled=True)
        check_schedule(config, fsdp_enabled=False)


def test_stages_keep_the_names_of_the_full_model():
    spec = get_model_spec("llama3")
    args = model_args(spec, "tiny", 16, 258)
    with torch.device("meta"):
        model = spec.model_cls(args)
    body = [f"layers.{key}" for key in model.layers]
    middle = keep_only(model, ["layers.1", "layers.2"], [*spec.head, *body, *spec.tail])
    names = [name for name, _ in middle.named_parameters()]
    assert names and all(name.startswith(("layers.1.", "layers.2.")) for name in names)
    assert middle.tok_embeddings is None and middle.output is None and middle.norm is None
    full = dict(model.named_parameters())
    assert all(full[name].shape == p.shape for name, p in middle.named_parameters())
