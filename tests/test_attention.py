"""Document masking (models/attention.py): what it means, for every model family and for a fork.

Its parity on the parallel layouts is in tests/test_parallel.py (CP x TP, PP x TP) and, compiled
with activation checkpointing, in tests/test_speed_features.py; the CUDA (flex attention) path in
tests/test_gpu.py.
"""

import importlib.util
import sys

import pytest
import torch
from test_forking import NAME as FORK_NAME
from test_forking import fork

from models import get_model_spec
from models.attention import document_ids, document_mask
from models.spec import model_args
from parallelisms.context_parallel import local_positions
from training.weight_init import init_weights, materialize

EOS = 257  # the byte-level tokenizer's


def test_an_eos_ends_its_own_document():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def test_the_mask_of_some_queries_is_rows_of_the_whole_mask():
    """What a context-parallel rank builds for its chunks: the same rows of the whole mask."""
    documents = document_ids(torch.randint(250, 258, (2, 16)), EOS)
    whole = document_mask(documents)
    assert whole.shape == (2, 1, 16, 16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(whole[0, 0] & ~causal, torch.zeros(16, 16, dtype=torch.bool))
    positions = local_positions(16, 1, 2)
    assert torch.equal(document_mask(documents, positions), whole[:, :, positions])


def build(model_cls, spec, seed: int = 0):
    args = model_args(spec, "tiny", 24, 258)
    with torch.device("meta"):
        model, template = model_cls(args), model_cls(args)
    materialize(model, torch.device("cpu"))
    init_weights(model, template, seed)
    model.init_buffers()
    return model.eval()


def assert_documents_do_not_see_each_other(model) -> None:
    """Three documents in one window: changing one changes no other's outputs under document
    masking; under causal masking the later ones change (so the check can fail)."""
    tokens = torch.randint(0, 250, (2, 24))
    tokens[:, 7] = tokens[:, 15] = EOS  # documents 0-7, 8-15, 16-23
    middle = tokens.clone()
    middle[:, 9:14] = (middle[:, 9:14] + 1) % 250
    mask = document_mask(document_ids(tokens, EOS))
    assert torch.equal(mask, document_mask(document_ids(middle, EOS)))  # same boundaries
    with torch.no_grad():
        before, after = model(tokens, attention_mask=mask), model(middle, attention_mask=mask)
        causal_before, causal_after = model(tokens), model(middle)
    for others in (slice(0, 8), slice(16, 24)):
        torch.testing.assert_close(after[:, others], before[:, others], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, 9:16], before[:, 9:16])
    assert not torch.allclose(causal_after[:, 16:], causal_before[:, 16:])
    # The first document sees only itself either way: masking changes nothing there.
    torch.testing.assert_close(before[:, :8], causal_before[:, :8], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
def test_documents_do_not_see_each_other(family):
    spec = get_model_spec(family)
    assert_documents_do_not_see_each_other(build(spec.model_cls, spec))


def test_a_forked_model_gets_document_masking_from_the_shared_kernel(tmp_path):
    """docs/forking.md's copy of Llama (LayerNorm instead of RMSNorm), built from its own file."""
    path = fork(tmp_path) / "models" / FORK_NAME / "model.py"
    loader = importlib.util.spec_from_file_location("forked_model", path)
    forked = importlib.util.module_from_spec(loader)
    sys.modules["forked_model"] = forked
    loader.loader.exec_module(forked)
    model = build(forked.Transformer, get_model_spec("llama3"))
    assert isinstance(model.layers["0"].attention_norm, torch.nn.LayerNorm)
    assert_documents_do_not_see_each_other(model)
