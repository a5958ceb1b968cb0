"""vLLM's real metadata objects (GDN / KDA, sparse MLA, the DSA indexer's) as the runtime's
row counts, for decodes, uniform verifies, mixed batches and prefills, agreeing with the
seed's is_decode."""

import pytest
import torch

from glm5_runtime.plan import is_decode

pytestmark = pytest.mark.vllm


def _gdn(prefills=0, decodes=0, spec=0, q=1, prefill_tokens=0):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    fields = {f: None for f in GDNAttentionMetadata.__dataclass_fields__}
    fields.update(
        num_prefills=prefills, num_prefill_tokens=prefill_tokens, num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=spec, num_spec_decode_tokens=spec * q,
        num_actual_tokens=prefill_tokens + decodes + spec * q,
        spec_state_indices_tensor=torch.zeros(spec, q, dtype=torch.int32) if spec else None,
    )  # fmt: skip
    required = {k: v for k, v in fields.items()}
    return GDNAttentionMetadata(**required)


def _indexer(prefills=0, prefill_tokens=0, decodes=0, decode_tokens=0):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata

    fields = {f: None for f in DeepseekV32IndexerMetadata.__dataclass_fields__}
    fields.update(num_prefills=prefills, num_prefill_tokens=prefill_tokens, num_decodes=decodes,
                  num_decode_tokens=decode_tokens)  # fmt: skip
    return DeepseekV32IndexerMetadata(**fields)


def _mla(prefills=0, decodes=0, decode_tokens=0):
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata

    fields = {f: None for f in SparseMLACommonMetadata.__dataclass_fields__}
    fields.update(num_prefills=prefills, num_decodes=decodes, num_decode_tokens=decode_tokens)
    return SparseMLACommonMetadata(**fields)


def test_rows_of_each_metadata_kind():
    from glm5_vllm.metadata import rows_of

    r = rows_of(_gdn(spec=2, q=4))
    assert (r.spec_decodes, r.spec_decode_tokens, r.spec_state_rows, r.indexer) == (2, 8, 2, False)
    r = rows_of(_indexer(prefills=2, prefill_tokens=8))
    assert r.indexer and r.spec_decodes is None and (r.prefills, r.prefill_tokens) == (2, 8)
    r = rows_of(_mla(decodes=2, decode_tokens=8))
    assert not r.indexer and r.spec_decodes is None and (r.decodes, r.decode_tokens) == (2, 8)


# (kind, metadata of each layer, q, tokens, whether the step is uniform); built lazily, so
# collecting without vLLM (the CPU suite deselects these tests) imports nothing of it.
CASES = [
    ("decode", lambda: [_gdn(decodes=8), _mla(decodes=8, decode_tokens=8),
                        _indexer(decodes=8, decode_tokens=8)], 1, 8, True),
    ("verify", lambda: [_gdn(spec=2, q=4), _mla(decodes=2, decode_tokens=8),
                        _indexer(decodes=2, decode_tokens=8)], 4, 8, True),
    ("verify-indexer-as-prefills", lambda: [_gdn(spec=2, q=4), _mla(decodes=2, decode_tokens=8),
                                            _indexer(prefills=2, prefill_tokens=8)], 4, 8, True),
    ("mixed-decode-and-verify", lambda: [_gdn(decodes=1, spec=1, q=4)], 4, 5, False),
    ("prefill", lambda: [_gdn(prefills=1, prefill_tokens=8), _mla(prefills=1)], 1, 8, False),
    ("verify-with-a-prompt-row", lambda: [_gdn(spec=1, q=4, prefills=1, prefill_tokens=4)], 4,
     8, False),
]  # fmt: skip


@pytest.mark.parametrize("kind, layers, q, b, uniform", CASES, ids=[c[0] for c in CASES])
def test_conversion_agrees_with_is_decode(kind, layers, q, b, uniform):
    from glm5_vllm.metadata import rows_of

    assert all(is_decode(rows_of(md), q, b) for md in layers()) == uniform, kind


def test_step_context_reads_vllms_forward_context(vllm_config):
    """A FULL-graph verify under vLLM's own forward context becomes the same decision the
    runtime's plan makes; outside any forward context the step is eager (stock)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import create_forward_context, override_forward_context

    from glm5_runtime.plan import plan
    from glm5_vllm.metadata import step_context

    layers = {
        "model.layers.0.self_attn": _gdn(spec=2, q=4),
        "model.layers.3.self_attn": _mla(decodes=2, decode_tokens=8),
        "model.layers.3.self_attn.indexer": _indexer(prefills=2, prefill_tokens=8),
    }
    outside = step_context(8)
    assert outside.graph == "NONE" and not outside.rows and not outside.capturing
    context = create_forward_context(
        layers, vllm_config(), cudagraph_runtime_mode=CUDAGraphMode.FULL
    )
    with override_forward_context(context):
        inside = step_context(8)
    assert inside.graph == "FULL" and set(inside.rows) == set(layers)
    assert inside.rows["model.layers.0.self_attn"].spec_state_rows == 2
    # Not capturing on this CPU machine, so the step runs stock, for that reason alone.
    decision = plan(inside, (4, 8), q=4)
    assert decision.step is None and "capture" in decision.reason
    capturing = type(inside)(**{**vars(inside), "capturing": True})
    assert plan(capturing, (4, 8), q=4).step.q == 4


def test_kda_placement_from_real_gdn_metadata():
    """vLLM's GDN metadata as the fused KDA stage's neutral placement: a uniform verify reads
    each request's state at its accepted column and keeps every token's; a plain decode
    reads and writes in place; prefills and mixed batches get none (vLLM's path runs)."""
    from glm5_vllm.metadata import kda_placement

    verify = _gdn(spec=3, q=4)
    verify.spec_state_indices_tensor = torch.tensor(
        [[5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]], dtype=torch.int32
    )
    verify.num_accepted_tokens = torch.tensor([1, 3, 4], dtype=torch.int32)
    p = kda_placement(verify)
    assert p.keep
    assert p.conv_slots.tolist() == [5, 9, 1] and p.conv_offset.tolist() == [0, 2, 3]
    assert p.read_slots.tolist() == [5, 11, 4]
    assert torch.equal(p.write_slots, verify.spec_state_indices_tensor)
    # Every tensor as the kernel reads it (no copy per layer).
    assert all(getattr(p, f).is_contiguous() for f in ("conv_slots", "conv_offset",
                                                        "read_slots", "write_slots"))  # fmt: skip
    assert set(p.kwargs()) == {"conv_slots", "conv_offset", "read_slots", "write_slots", "keep"}

    decode = _gdn(decodes=2)
    decode.non_spec_state_indices_tensor = torch.tensor([7, 3, 0], dtype=torch.int32)  # padded
    p = kda_placement(decode)
    assert not p.keep
    assert p.read_slots.tolist() == [7, 3] and p.write_slots.tolist() == [[7], [3]]
    assert p.conv_slots.tolist() == [7, 3] and p.conv_offset.tolist() == [0, 0]

    mixed = _gdn(decodes=1, spec=1, q=2)
    mixed.num_accepted_tokens = torch.ones(1, dtype=torch.int32)
    for md in (_gdn(prefills=1, prefill_tokens=5), mixed):
        assert kda_placement(md) is None
