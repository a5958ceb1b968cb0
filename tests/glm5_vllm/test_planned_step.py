"""A whole planned step over vLLM's own modules (issue 33): `SpecializedDecode.forward` over
`VllmBackbone` on a real tiny vLLM 0.33 Glm5NextForCausalLM against the reference backbone's
planned step, on the same weights, caches and placement.

The model. vLLM loads the reference's FP8 checkpoint itself (`tiny_model.build(fp8=True)`:
GLM-5.3-Flash's block-FP8 quantization_config through vLLM's own `load_weights` and
`process_weights_after_loading`; MLPs and experts FP8, under vLLM's TRITON FP8 MoE backend,
Hopper's pick at TP, whose w13 layout the MoE stage reads, and its Triton block-FP8 GEMM)
in four layers: KDA (dense MLP), MLA + DSA, MLA + DSA, KDA, the last three MoE (4 of 16
experts by score + a non-zero correction bias); every indexer full, pools of 4 tokens, top
2 pools + the tail. Two requests, 23 and 22 tokens in (prefilled by the
reference, whose stock verify before kept 2 and 1 tokens: KDA resumes from the second and
from the first state slot), run one uniform verify of q = 2 tokens each: 4 rows, planned as
a FULL-graph capture (on CPU nothing captures: the test hands `plan` the capture flag, the
rest comes from vLLM's forward context). About a minute on two cores.

Every stage is on, vLLM's side and the reference's alike (their Triton kernels interpreted):
the embedding, the projections, the MoE layer (router to sum), the dense MLP, the fused KDA
step (f_b and g_b included), the MLA sublayer (its projections, input norms and latent
write, the indexer's pool write and selection, the query absorption, the sparse attention
and value-up), the mHC boundaries and the LM head: no op of vLLM's modules runs in the
planned step, only their weights and caches are read. The kernels' warm-up runs (`prepare`
per op: compile and run once on zeros before capture) are skipped on both sides,
LayerStages.prepare's own bookkeeping kept: under the interpreter they compile nothing and
would run every kernel once more.

What is enforced, and why the bound is zero. Both steps run the same stage kernels on the
same tensors: every weight a stage reads from vLLM equals the reference's (the same FP8
codes and block scales, BF16 values; vLLM keeps the mHC weights in FP32, the reference the
same numbers in BF16: vLLM's loading and post-processing keep the checkpoint's tensors),
both start from the same cache contents, both decodes install the same ops at the same
sites, and both read the same placement: vLLM's from its metadata and slot mappings, the
reference's from its own. So each indexer call's selection must equal the reference's, and
no rounding differs anywhere: every row of the final hidden states
[N, D] and of the logits [N, V], and every cache of every layer (KDA conv and recurrent
state, latent pages, indexer pool pages and tail ring) must be bit-equal to the reference's,
the rows the step writes among them (checked to have changed: the step wrote them on both
sides). A wrong weight slice, slot, block table, state offset or request index moves rows by
O(1). Each stage op installed for the step must have run on both sides, as often, and the
selections must keep fewer tokens than the context holds (the indexer chooses)."""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.vllm

Q = 2  # tokens per request in a verify
REQUESTS = 2
STAGES = {
    stage: {"1-8": choice}
    for stage, choice in [
        ("dsa_proj", "split_k"), ("kda_proj", "gemm"), ("router", "split_k"),
        ("shared_expert", "gemv"), ("dense_mlp", "gemv"), ("moe", "per_route"),
        ("kda", "fused"), ("dsa_attn", "sparse"), ("dsa_kpool", "fused"),
        ("dsa_indexer", "fused"), ("boundary", "triton"), ("logits_head", "skinny"),
        ("embed", "gather"),
    ]
}  # fmt: skip
# The router and shared expert stages do not build where the MoE stage serves the count:
# it runs both inside its own launches.
KINDS = {"Projection", "DenseMlp", "MoeLayer", "KdaDecode", "SparseMlaDecode", "LatentWrite",
         "KpoolWrite", "IndexerTopk", "MhcBoundary", "Embedding"}  # fmt: skip


def _geometry():
    from tiny_model import tiny_geometry

    kda, mla = "linear_attention", "deepseek_sparse_attention"
    return tiny_geometry(
        num_hidden_layers=4, layer_types=(kda, mla, mla, kda),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"), indexer_types=("full",) * 4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory, cpu_linears):
    from tiny_model import build

    folder = tmp_path_factory.mktemp("glm5-vllm-planned")
    return build(folder, g=_geometry(), fp8=True, q=Q)  # on conftest's CPU platform


def _caches(model, g):
    """{(layer, kind): the vLLM module holding it and its attribute} of every layer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if g.is_mla(i):
            out[i, "latent"] = (attn.mla_attn.mla_attn, "kv_cache")
            out[i, "kpool"] = (attn.indexer.k_cache, "kv_cache")
            out[i, "tail"] = (attn.indexer.tail_cache, "kv_cache")
        else:
            out[i, "kda"] = (attn, "kv_cache")  # (conv, recurrent), as vLLM binds them
    return out


def _bind(model, reference, monkeypatch):
    """vLLM's attention modules bound to copies of the reference's caches (vLLM's layouts:
    conv [slots, W-2+q, C] BF16 and recurrent [slots, H, V, K] FP32 per KDA layer; latent
    [blocks, block_size, kv_lora] BF16, pool pages [blocks, block_size / kpool, hd + 4] uint8
    and tail ring [requests + 1, 2, ring, hd] BF16 per MLA layer)."""
    c = reference.ranks[0].c
    for (i, kind), (module, attr) in _caches(model, reference.g).items():
        if kind == "kda":
            bound = (c.conv[i].clone(), c.recurrent[i].clone())
        else:
            bound = getattr(c, kind)[i].clone()
        monkeypatch.setattr(module, attr, bound, raising=False)


def _vllm_caches(model, g):
    """{(layer, kind): tensor} of the caches bound to vLLM's modules, kinds as the
    reference's (`conv`, `recurrent`, `latent`, `kpool`, `tail`)."""
    out = {}
    for (i, kind), (module, attr) in _caches(model, g).items():
        bound = getattr(module, attr)
        if kind == "kda":
            out[i, "conv"], out[i, "recurrent"] = bound
        else:
            out[i, kind] = bound
    return out


def _reference_caches(reference):
    c = reference.ranks[0].c
    kinds = ("conv", "recurrent", "latent", "kpool", "tail")
    return {(i, k): t for k in kinds for i, t in getattr(c, k).items()}


def _metadata(model, g, step):
    """vLLM's attention metadata of a uniform verify at the reference's placement, by layer
    name as its forward context holds it (real dataclasses, filled as vLLM's builders fill
    them): per KDA layer GDN metadata of spec decodes (state slots [R, T], accepted counts),
    per MLA layer sparse-MLA metadata of decode rows (block table, each row's request, the
    latent slot mapping) and the indexer's (its pages' decode block table; the tail ring's
    slots, ring row x ring + position % ring); and the latent slot mapping by layer."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
    )

    r, t = step.positions.shape
    n = r * t
    i32 = torch.int32
    seq_lens = (step.positions[:, -1] + 1).to(i32)
    slots = step.slots.reshape(-1)
    fields = dict.fromkeys(GDNAttentionMetadata.__dataclass_fields__)
    fields.update(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=r, num_spec_decode_tokens=n, num_actual_tokens=n,
        spec_state_indices_tensor=step.write_slots.to(i32),
        num_accepted_tokens=(step.conv_offset + 1).to(i32),
    )  # fmt: skip
    gdn = GDNAttentionMetadata(**fields)
    mla = FlashMLASparseMetadata(
        num_reqs=r, max_query_len=t, max_seq_len=int(seq_lens.max()), num_actual_tokens=n,
        query_start_loc=torch.arange(0, n + 1, t, dtype=i32), slot_mapping=slots,
        num_decodes=r, num_decode_tokens=n, num_prefills=0, block_table=step.block_table.to(i32),
        req_id_per_token=step.row_request.to(i32), block_size=step.block_size,
    )  # fmt: skip
    common = dict(seq_lens=seq_lens, max_seq_len=int(seq_lens.max()), num_prefill_tokens=0,
                  num_decodes=r, num_decode_tokens=n, num_prefills=0)  # fmt: skip
    decode = DeepSeekV32IndexerDecodeMetadata(
        block_table=step.block_table.to(i32), seq_lens=seq_lens,
        decode_lens=torch.full((r,), t, dtype=i32), requires_padding=False,
        schedule_metadata=torch.empty(0),
    )  # fmt: skip
    by_layer, latent_slots = {}, {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if not g.is_mla(i):
            by_layer[attn.prefix] = gdn
            continue
        core, ix = attn.mla_attn.mla_attn, attn.indexer
        by_layer[core.layer_name], latent_slots[core.layer_name] = mla, slots
        by_layer[ix.k_cache.prefix] = DeepseekV32IndexerMetadata(
            slot_mapping=slots, decode=decode, **common
        )
        ring = ix.tail_cache.kv_cache.shape[2]
        tail = (step.tail_rows[:, None] * ring + step.positions % ring).reshape(-1)
        by_layer[ix.tail_cache.prefix] = DeepseekV32IndexerMetadata(slot_mapping=tail, **common)
    return by_layer, latent_slots


def _written(step, g, kind):
    """Rows of cache `kind` (flattened to its slots) that the step writes: each request's
    conv row and kept states, each token's latent slot, each request's ring row, the page
    row of every pool a token completes."""
    if kind == "conv":
        return step.conv_slots
    if kind == "recurrent":
        return step.write_slots[step.write_slots >= 0]
    if kind == "latent":
        return step.slots.reshape(-1)
    if kind == "tail":
        return step.tail_rows
    done = (step.positions + 1) % g.index_kpool == 0  # kpool: [block, pool] page rows
    pos = step.positions[done]
    blocks = step.block_table.gather(1, step.positions // step.block_size)[done]
    per_block = step.block_size // g.index_kpool
    return blocks * per_block + pos % step.block_size // g.index_kpool


def _rows(t, kind):
    """A cache as its slot rows (the latent and pool pages flattened to token / pool rows)."""
    return t.flatten(0, 1) if kind in ("latent", "kpool") else t


class Counted:
    """A stage op that keeps a clone of each call's output; everything else is the op's."""

    def __init__(self, op):
        self.op, self.outputs = op, []

    def __getattr__(self, name):
        return getattr(self.op, name)

    def __call__(self, *args, **kw):
        out = self.op(*args, **kw)
        self.outputs.append(out.clone() if isinstance(out, torch.Tensor) else out)
        return out


def _count(decode, tokens):
    """Each route of `tokens`-token steps and the embedding wrapped in Counted: {name:
    Counted}."""
    counted = {}
    routes = decode.routes[tokens]
    for j, (shard, name, op) in enumerate(routes):
        routes[j] = (shard, name, counted.setdefault(name, Counted(op)))
    ops = decode.embedding[tokens]  # the embedding: not a route, `run` calls it
    decode.embedding[tokens] = [counted.setdefault(f"embed {j}", Counted(op))
                                for j, op in enumerate(ops)]  # fmt: skip
    return counted


def _prepare(decode):
    """LayerStages.prepare without the kernels' warm-up runs (module docstring)."""
    for op, _ in decode.ops:
        op.prepare = lambda tokens: None
    assert decode.prepare() == set()  # no stage failed


def _equal_rows(what, got, want):
    """Every row of got [N, ...] bit-equal to want's; else the differing rows' relative L2."""
    got, want = got.flatten(1), want.flatten(1)  # a cache row, a token's hidden state
    assert got.shape == want.shape, (what, got.shape, want.shape)
    same = ((got == want) | (got.isnan() & want.isnan())).all(1)
    if not same.all():
        diff = (got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1)
        bad = {int(r): f"{float(diff[r]):.2e}" for r in (~same).nonzero()[:, 0]}
        raise AssertionError(f"{what}: rows differ from the reference's (relative L2): {bad}")


def test_a_planned_step_over_vllms_modules_equals_the_reference_backbones(built, monkeypatch):
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import create_forward_context, override_forward_context

    import glm5_vllm.models as models
    from glm5_policy import DecodeConfig
    from glm5_runtime.decode import SpecializedDecode
    from glm5_runtime.reference.backbone import ReferenceBackbone
    from glm5_vllm.backbone import VllmStep
    from glm5_vllm.metadata import attention_metadata, slot_mappings, step_context

    model, vllm_config, reference, _ = built
    g = reference.g
    gen = torch.Generator().manual_seed(7)
    requests = [reference.add() for _ in range(REQUESTS)]
    reference.forward(requests, torch.randint(0, g.vocab_size, (REQUESTS, 21), generator=gen))
    verify = torch.randint(0, g.vocab_size, (REQUESTS, Q), generator=gen)
    reference.forward(requests, verify, verify=True)  # stock: the step before the planned one
    reference.accept(0, 2)
    reference.accept(1, 1)
    n = REQUESTS * Q
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=[n], policy=STAGES)
    _bind(model, reference, monkeypatch)  # before binding: the indexer's stages read them
    with set_current_vllm_config(vllm_config):
        decode = models._bind(model, config)
    assert decode is not None and not decode.backbone.refused
    ours = SpecializedDecode(ReferenceBackbone(reference), config)
    for d in (decode, ours):
        assert {type(op).__name__ for op, _ in d.ops} == KINDS
        _prepare(d)
        assert n in d.mhc_tokens and n in d.head  # the boundaries and the LM head: stages
    # The same stage ops at the same sites on both sides, on equal weights.
    assert {r[1] for r in decode.routes[n]} == {r[1] for r in ours.routes[n]}
    fp8 = torch.float8_e4m3fn
    for name, want in sorted(reference.ranks[0].w.items()):
        got = decode.backbone.weight(0, name)  # None: not read from vLLM (the builds above)
        if got is not None:  # vLLM keeps the mHC weights FP32, the reference's BF16 values
            same = (got.dtype == fp8) == (want.dtype == fp8) and got.shape == want.shape
            assert same and torch.equal(got.double(), want.double()), (name, got.dtype)
    counted = {"vllm": _count(decode, n), "reference": _count(ours, n)}

    step = reference.step(requests, Q, verify=True)  # where each request's tokens go
    assert step.conv_offset.tolist() == [1, 0]  # resuming from the second / first state
    before = {k: t.clone() for k, t in _reference_caches(reference).items()}
    tokens = torch.randint(0, g.vocab_size, (REQUESTS, Q), generator=gen)

    def stock(*_):
        raise AssertionError("the step ran stock")

    by_layer, latent_slots = _metadata(model, g, step)
    context = create_forward_context(by_layer, vllm_config, slot_mapping=latent_slots,
                                     cudagraph_runtime_mode=CUDAGraphMode.FULL)  # fmt: skip
    with set_current_vllm_config(vllm_config), torch.no_grad():
        with override_forward_context(context):
            seen = dataclasses.replace(step_context(n), capturing=True)  # nothing captures here
            placement = VllmStep(step.positions.reshape(-1), seen, attention_metadata(),
                                 slot_mappings())  # fmt: skip
            h_vllm = decode.forward(tokens.reshape(-1), placement, stock, capturing=True)
        model.glm5_specialized, model._glm5_prepared = decode, True
        try:
            logits_vllm = model.compute_logits(h_vllm)  # the model's hook: the skinny head
        finally:
            model.glm5_specialized, model._glm5_prepared = None, False

    def planned(ids, placed):
        decision = ours.plan(placed, capturing=True)
        assert decision.step is not None, decision.reason
        return ours.run(decision.step, ids, placed)

    h_ref = reference.forward(requests, tokens, verify=True, step=step, run=planned)
    logits_ref = ours.compute_logits(h_ref)
    # vLLM's modules as they were: every route uninstalled.
    for name, module in model.named_modules():
        assert not {"forward", "forward_mqa", "_v_up_proj"} & set(vars(module)), name

    # Every installed stage op ran on both sides, as often.
    calls = {side: {k: len(op.outputs) for k, op in c.items()} for side, c in counted.items()}
    assert calls["vllm"] == calls["reference"] and all(calls["vllm"].values()), calls
    # Each indexer's selection: the reference's; fewer tokens than the context holds.
    chose = False
    for name, op in counted["vllm"].items():
        if name.endswith(".indexer.topk"):
            (got,), (want,) = op.outputs, counted["reference"][name].outputs
            _equal_rows(f"{name} selection", got[:n].long(), want.reshape(n, -1).long())
            kept = (want.reshape(n, -1) >= 0).sum(1)
            chose |= bool((kept < step.positions.reshape(-1) + 1).any())
    assert chose, "every selection kept the whole context"
    # vLLM's model-wide top-k buffer holds the last layer's selection, -1 past its columns,
    # as its own indexer op leaves it (its MTP drafter's later steps read it).
    last = g.mla_layers[-1]
    (want,) = counted["reference"][f"layers.{last}.self_attn.indexer.topk"].outputs
    buffer = model.model.layers[last].self_attn.indexer.topk_indices_buffer
    width = want.shape[-1]
    _equal_rows("top-k buffer", buffer[:n, :width].long(), want.reshape(n, -1).long())
    assert (buffer[:n, width:] == -1).all()
    _equal_rows("hidden states", h_vllm, h_ref.reshape(n, -1))
    _equal_rows("logits", logits_vllm, logits_ref.reshape(n, -1))
    got, want = _vllm_caches(model, g), _reference_caches(reference)
    assert got.keys() == want.keys()
    for (i, kind), cache in want.items():
        rows = _written(step, g, kind)
        fresh = _rows(cache, kind)[rows] != _rows(before[i, kind], kind)[rows]
        assert fresh.flatten(1).any(1).all(), (i, kind, "a written row unchanged")
        _equal_rows(f"layer {i} {kind} (written rows)", _rows(got[i, kind], kind)[rows],
                    _rows(cache, kind)[rows])  # fmt: skip
        _equal_rows(f"layer {i} {kind}", _rows(got[i, kind], kind), _rows(cache, kind))
