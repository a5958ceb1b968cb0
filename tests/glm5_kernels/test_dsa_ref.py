"""DSA indexer references: Hadamard + FP8 keys/queries, k-pool pages, pool logits, and the
pool compression against transformers' Glm5NextTextIndexer.

Tolerances: a power-of-two scale puts the vector's amax in [224, 448] e4m3 units, where half
an ulp is 16, so each dequantized element is within amax/14 (1/16 of the top binade plus the
BF16 rounding of the rotated vector, 2^-9 relative). Pool logits sum head dot products of two
such vectors with signed head weights, which cancel: relative L2 against the exact logits was
at most 0.083 over 300 fresh draws per shape (0.058 at the real 32 heads x 128 pools), so the
bound is 0.15; a lost scale or a one-sided rotation is off by ~1 or more."""

import pytest
import torch

from glm5_kernels.dsa import (
    index_logits_fp8_ref,
    kpool_compress_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    unpack_kpool_pages_ref,
)
from glm5_kernels.dsa.reference import _hadamard

SHAPES = [(1,), (3, 7), (64, 32), (5, 17)]  # (tokens,), (tokens, heads): off-grid and real


def test_hadamard_is_orthonormal_and_symmetric():
    h = _hadamard(128, "cpu").double()
    torch.testing.assert_close(
        h @ h, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-6
    )  # FP32 entries
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("lead", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_rotate_quant_round_trips_within_the_fp8_bound(lead, magnitude):
    x = (torch.randn(*lead, 128) * magnitude).to(torch.bfloat16)
    q, scale = rotate_quant_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == lead
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert q.float().abs().max() <= 448 and not q.float().isnan().any()
    # In the rotated domain: FP8 error <= amax/14 (see above) plus BF16's 2^-9 of the
    # rotation's own rounding, elementwise.
    y = x.double() @ _hadamard(128, "cpu").double()
    err = (q.double() * scale[..., None].double() - y).abs().amax(-1)
    amax = y.abs().amax(-1)
    assert torch.all(err <= amax * (1 / 14 + 2**-8))


def test_pages_round_trip_exactly_with_keys_before_scales():
    q = (torch.randn(6, 4, 128) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(6, 4) + 0.5
    pages = pack_kpool_pages_ref(q, scale)
    assert pages.shape == (6, 4, 132) and pages.dtype == torch.uint8
    row = pages.reshape(6, -1)
    assert torch.equal(row[:, : 4 * 128], q.view(torch.uint8).reshape(6, -1))
    assert torch.equal(row[:, 4 * 128 :].contiguous().view(torch.float32), scale)
    q2, s2 = unpack_kpool_pages_ref(pages)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)


@pytest.mark.parametrize("tokens, heads, pools", [(1, 32, 128), (3, 4, 7), (9, 32, 300)])
def test_fp8_logits_match_the_exact_logits(tokens, heads, pools):
    qb = torch.randn(tokens, heads, 128).to(torch.bfloat16)
    kb = torch.randn(pools, 128).to(torch.bfloat16)
    w = torch.randn(tokens, heads)
    q, qs = rotate_quant_fp8_ref(qb)
    k, ks = rotate_quant_fp8_ref(kb)
    got = index_logits_fp8_ref(q, qs, w, k.expand(tokens, -1, -1), ks.expand(tokens, -1))
    exact = torch.einsum(
        "th,thp->tp",
        w.double() * 128**-0.5 * heads**-0.5,
        torch.relu(torch.einsum("thd,pd->thp", qb.double(), kb.double())),
    )
    assert got.shape == (tokens, pools)
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.15


def test_pool_compression_matches_transformers_indexer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = transformers.Glm5NextTextConfig(
        hidden_size=64,
        index_head_dim=128,
        index_kpool=16,
        index_topk=32,
        q_lora_rank=32,
        num_hidden_layers=1,
        pad_token_id=None,
    )
    indexer = Glm5NextTextIndexer(cfg, 0)
    with torch.no_grad():
        indexer.index_kpool_compress_ape.normal_(0, 0.5)
    keys = torch.randn(2, 48, 128)
    gates = torch.randn(2, 48, 128)
    packed = torch.cat([keys, gates, torch.ones(2, 48, 1)], -1)
    want, indices, valid = indexer.get_pooled_states(packed)
    got = kpool_compress_ref(
        keys.view(2, 3, 16, 128), gates.view(2, 3, 16, 128), indexer.index_kpool_compress_ape
    )
    assert valid.all() and indices.shape == (2, 3, 16)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
