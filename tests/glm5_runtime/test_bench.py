"""The bench's inputs off the GPU: random caches (no step timed on zeros) and token ids each
held rank embeds; its tables straight from a results file; the stage marks leave a stock's
own stages installed."""

import torch

from glm5_runtime.bench import StageMarks, _fill_caches, _token_ids, floor_bytes, table
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone
from glm5_runtime.reference.stages import FUSED_PARTS, _pages


def test_caches_are_filled_finite_and_nonzero():
    model = ReferenceModel.random(geometry("tiny"), max_requests=2, max_context=32)
    _fill_caches(model)
    c = model.ranks[0].c
    for kind in (c.conv, c.latent, c.tail, c.recurrent):
        for t in kind.values():
            assert torch.isfinite(t.float()).all() and (t != 0).float().mean() > 0.9
    for t in c.kpool.values():
        keys, scales = _pages(t)
        assert torch.isfinite(keys.view(torch.float8_e4m3fn).float()).all()
        assert (scales > 0).all() and torch.isfinite(scales).all()


def test_token_ids_embed_on_the_held_rank():
    model = ReferenceModel.random(
        geometry("tiny", tp_size=2, ranks=(1,)), max_requests=3, max_context=16
    )
    ids = _token_ids(model, 3, 2)
    assert ids.shape == (3, 2)
    assert (model.ranks[0].embed(ids).abs().sum(-1) > 0).all()


def test_table_of_a_committed_result():
    text = table(["benchmarks/results/decode_h200_tp4.json"])
    assert "| flash-tp4-rank | 1 |" in text and "mhc, norms, reduce" in text


def test_fused_projections_share_their_parts_bytes():
    """The fused attention weights a stage serves are built from their parts, which become
    views of them: no weight is held twice, and the floor counts each byte once."""
    model = ReferenceModel.random(geometry("tiny"), max_requests=2, max_context=32)
    rank, before = model.ranks[0], floor_bytes(model, 1, 16)
    held = {n: t.clone() for n, t in rank.w.items()}
    backbone = ReferenceBackbone(model)
    built = 0
    for layer in backbone.layers:
        for fused, parts in FUSED_PARTS.items():
            prefix = f"layers.{layer.index}.self_attn"
            w = backbone.weight(0, f"{prefix}.{fused}.weight")
            if w is None:
                continue
            built += 1
            names = [f"{prefix}.{p}.weight" for p in parts]
            assert torch.equal(w, torch.cat([held[n] for n in names]))
            for n in names:
                assert rank.w[n].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                assert torch.equal(rank.w[n], held[n])
    assert built == len(backbone.layers)  # one per layer: in_proj (KDA) or q_a | kv_a (MLA)
    assert floor_bytes(model, 1, 16) == before


def test_stage_marks_put_a_stocks_own_stage_back():
    """A stock installs its own stage on a rank (VllmStock's kda): the marks wrap it while
    they are entered and leave it installed after, every other stage the rank's method."""
    model = ReferenceModel.random(geometry("tiny"), max_requests=1, max_context=16)
    rank = model.ranks[0]

    def own(*args):
        return "own"

    rank.kda = own
    with StageMarks(model):
        assert rank.kda is not own and "mla" in vars(rank)
    assert rank.kda is own and "mla" not in vars(rank)
