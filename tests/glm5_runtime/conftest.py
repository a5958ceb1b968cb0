"""Shared builders: the reference model and transformers' Glm5NextTextModel on one set of
random weights."""

import pytest
import torch

from glm5_runtime.reference import ReferenceModel, geometry, random_state_dict
from glm5_runtime.reference.weights import dequantized


def dense_geometry(**changes):
    """Two layers (KDA, MLA+DSA) with dense MLPs: no MoE routes to flip under perturbation."""
    return geometry(
        "tiny",
        num_hidden_layers=2,
        layer_types=("linear_attention", "deepseek_sparse_attention"),
        mlp_layer_types=("dense", "dense"),
        indexer_types=("full", "full"),
        **changes,
    )


def build_pair(g, seed, dtype=torch.float32, **kw):
    """(reference, transformers oracle in `dtype`, the oracle's config)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    sd = random_state_dict(g, seed=seed)
    # transformers' indexer numerics (BF16 pool keys, no rotation or FP8) for the oracle.
    model = ReferenceModel.from_state_dict(
        g,
        sd,
        max_requests=4,
        max_context=kw.pop("max_context", 96),
        block_size=16,
        dtype=dtype,
        indexer_numerics="hf",
        **kw,
    )
    cfg = g.to_hf()
    cfg._attn_implementation = "eager"
    oracle = transformers.Glm5NextTextModel(cfg)
    weights = {k: v for k, v in dequantized(sd).items() if k in oracle.state_dict()}
    missing, unexpected = oracle.load_state_dict(weights, strict=False)
    assert not missing and not unexpected
    return model, oracle.eval(), cfg


def relative(a, b):
    """L2 error of a relative to b, over all elements."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def tiny_fp32():
    g = geometry("tiny")
    return ReferenceModel.random(
        g, seed=3, max_requests=4, max_context=96, block_size=16, dtype=torch.float32
    )
