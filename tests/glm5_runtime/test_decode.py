"""The specialized decode over the reference backbone, on CPU (Triton kernels under the
interpreter): planned decode and verify steps equal the stock forward, caches included;
unplanned steps run stock; a stage that cannot be built warns once and runs stock.

Bound. Both sides run BF16 with vLLM's FP8 numerics (activations quantized per token); they
differ only in accumulation order and output rounding, which BF16 and FP8 re-quantization
amplify through the layers. So each row (a token's hidden state or logits, a cache slot) of
the specialized decode must stay within twice the stock BF16 model's own worst row distance
from the same model in FP32 on the same discrete path (its noise; twice: both BF16 sides
round where FP32 does not), and far below any semantic slip (a missed route, a wrong weight
or row: O(1)). The models route for real, so rows are compared only for the requests whose
experts and selections agree with stock (decode_cases.Yardstick); each stage op's every row
is held to its rounding bound on the same input (decode_cases.CALL_BOUND)."""

import logging
import os

import pytest
import torch
from decode_cases import (
    ALL_STAGES,
    NoHostRead,
    Yardstick,
    agreeing_logs,
    agreeing_tokens,
    capturing_everywhere,
    check_calls,
    copy_caches,
    shadow,
)

from glm5_policy import DecodeConfig
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

Q = 2
SIZES = [1, 2, 4]  # capture sizes: 2 and 4 are q-multiples (planned), 1 is not
# Of the rows a whole-step test runs, those whose request made the same discrete choices as
# stock, at least: real routing in BF16 / FP8 numerics flips near ties often (a verify of 5
# requests x 5 tokens through 3 MoE layers and 2 indexers, 75 expert sets and 25 selections,
# keeps about a quarter of its requests' choices); what must not happen is comparing none.
MIN_COMPARED = 1 / 8
# For the tests that count the build's warnings: ALL_STAGES with the Triton boundary where it
# picks the CuTe one (which warns on CPU that Triton runs instead, one warning more).
TRITON_STAGES = {**ALL_STAGES, "boundary": {"1-16": "triton", "21-64": "triton"}}


def _model(g, dtype=torch.bfloat16, q=Q, requests=2):
    return ReferenceModel.random(
        g, seed=5, max_requests=requests, max_context=64, block_size=16, q=q, dtype=dtype,
        fp8_activations=True,
    )  # fmt: skip


def _decoder(model, policy=ALL_STAGES, q=Q, sizes=SIZES):
    config = DecodeConfig.build(max_context=64, q=q, capture_sizes=sizes, policy=policy)
    decode = SpecializedDecode(ReferenceBackbone(model), config)
    decode.prepare()
    return decode


def _small(**changes):
    """Tiny at whole FP8 blocks (hidden 128), in four layers that hold every stage and layer
    kind: KDA before and after MLA, the first MLA layer's indexer full and the next one's
    shared, a dense MLP and MoE. Each planned step runs the Triton interpreter through every
    layer, so layers beyond these would repeat the same kernels."""
    return geometry(
        "tiny", hidden_size=128, moe_intermediate_size=128, num_hidden_layers=4,
        layer_types=("linear_attention",) + ("deepseek_sparse_attention",) * 2
        + ("linear_attention",),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full", "full", "shared", "full"), **changes,
    )  # fmt: skip


@pytest.mark.parametrize("q", [2, 3])
def test_planned_steps_equal_stock(q, monkeypatch):
    """q requests: their decode steps (q tokens) and verify steps (q x q) are both planned,
    every stage op at a token count it was prepared for (a capture's rule, enforced here).

    The model routes for real: each token picks 4 of 16 experts by score + a non-zero
    correction bias, each indexer 2 of up to 5 pools. Per call, the MoE stage's routing must
    be route_ref's from its logits (tie-tolerant) and each selection the reference's. End to
    end, a near tie that the models' rounding resolves differently moves a token's output
    O(1): each step starts every model from the stock caches, and a request's rows (hidden
    states, logits; the caches where every request agreed) are compared per row only where
    the two models made the same choices for it, against the same per-row errors of the stock
    BF16 model vs FP32 (decode_cases.Yardstick); MIN_COMPARED of the rows at least."""
    # q = 2 at a latent of whole 64-column tiles (as the model's 512): the query absorption
    # as the skinny GEMM; q = 3 at tiny's 32: the batched GEMM.
    g = _small(kv_lora_rank=64) if q == 2 else _small()
    dtypes = (torch.bfloat16, torch.bfloat16, torch.float32)
    stock, spec, fp32 = models = [_model(g, dtype, q=q, requests=q) for dtype in dtypes]
    decode = _decoder(spec, q=q, sizes=[1, q, q * q])
    pairs = []
    shadow(decode, spec, pairs)
    kinds = {op.__class__.__name__ for op, _ in decode.ops}
    # The router and shared expert stages where the MoE stage leaves a count (4 at q = 2).
    beside = {"Router", "SharedExpert"} if q == 2 else set()
    assert kinds == beside | {
        "Projection", "DenseMlp", "MoeLayer", "MhcBoundary", "KdaDecode", "SparseMlaDecode",
        "IndexerTopk", "KpoolWrite", "LatentWrite", "Embedding",
    }  # fmt: skip
    attends = [op for op, _ in decode.ops if type(op).__name__ == "SparseMlaDecode"]
    assert attends and all((op._absorb is not None) == (q == 2) for op in attends)
    assert decode.mhc is not None and decode.mhc_tokens == {q, q * q}
    assert decode.batches == [q, q * q]
    capturing_everywhere(monkeypatch)  # first_call's rule; no check that reads values

    def planned(tokens, step):
        decision = decode.plan(step, capturing=True)
        assert decision.step is not None, decision.reason
        with NoHostRead():  # the step and the shadows' references, as a capture takes them
            return decode.run(decision.step, tokens, step)

    gen = torch.Generator().manual_seed(q)
    requests = list(range(q))
    for m in models:
        assert [m.add() for _ in requests] == requests
    prompt = torch.randint(0, g.vocab_size, (q, 9), generator=gen)
    for m in (stock, spec, fp32):
        m.forward(requests, prompt)  # prefill: stock on every side
    calls, yardstick = {}, Yardstick(stock, spec, fp32, [decode])
    # A decode (q requests x 1 token) then a verify (q x q), twice. The verifies keep 1 token,
    # then 2 (all of q = 2's, part of q = 3's): KDA resumes from its first, last or a middle
    # state slot.
    for i in range(4):
        verify = i % 2 == 1
        t = q if verify else 1
        tokens = torch.randint(0, g.vocab_size, (q, t), generator=gen)
        yardstick.start()
        step = stock.step(requests, t, verify=verify)  # where each request writes
        h_stock = stock.forward(requests, tokens, verify=verify, step=step)
        h_spec = spec.forward(requests, tokens, verify=verify, run=planned)
        h_fp32 = fp32.forward(requests, tokens, verify=verify)
        routed = {name for _, name, _ in decode.routes[q * t]}
        assert {name for _, name, _, _ in pairs} == routed  # every stage op ran
        # vLLM's fused attention projections, one op each (their parts never routed apart).
        parts = {n.rsplit(".", 2)[-2] for n in routed if ".self_attn." in n}
        assert {"fused_qkv_a_proj", "in_proj_qkvbfg_a"} <= parts, parts
        assert not parts & {"q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"}
        # The indexers' wk | gate | weights_proj as one projection, normed in the pool write.
        assert {"indexer.inputs", "indexer.kpool"} <= {n.split(".", 3)[-1] for n in routed}
        check_calls(pairs, calls)
        pairs.clear()
        if verify:
            for m in (stock, spec, fp32):
                for r in requests:
                    m.accept(r, 1 + (i // 2) % q)
        logits = decode.compute_logits(h_spec), stock.logits(h_stock), fp32.logits(h_fp32)
        yardstick.compare(h_stock, h_spec, h_fp32, logits, step)
    print(f"worst per call {calls}")
    yardstick.check(MIN_COMPARED)


def test_unplanned_steps_run_stock():
    g = _small()
    model = _model(g)
    decode = _decoder(model)
    r = model.add()
    step = model.step([r], 5)
    assert decode.plan(step, capturing=True).step is None  # a 5-token prefill
    calls = []

    def stock(tokens, placement):
        calls.append(tokens.shape)
        return model.backbone(tokens, placement)

    tokens = torch.zeros(1, 5, dtype=torch.long)
    decode.forward(tokens, step, stock, capturing=True)
    one = model.step([r], 1)
    decode.forward(tokens[:, :1], one, stock, capturing=False)  # eager: stock
    decode.forward(tokens[:, :1], one, stock, capturing=True)  # 1 token: not planned
    assert calls == [(1, 5), (1, 1), (1, 1)]
    assert not any(rank.routes for rank in model.ranks)  # nothing left installed


def test_stages_a_whole_sublayer_stage_leaves_nothing_to_serve_are_named(caplog):
    """Where moe serves every capture size, the router and shared expert stages serve none
    (and kda_proj where kda does, dsa_proj where the MLA stages do): no warning, no op, and
    `unserved` names who serves instead (what `tune` records for such a candidate)."""
    model = _model(_small())
    everywhere = {**TRITON_STAGES, "moe": {"1-64": "per_route"}, "kda": {"1-64": "fused"}}
    with caplog.at_level(logging.WARNING):
        whole = SpecializedDecode(ReferenceBackbone(model), DecodeConfig.build(
            max_context=64, q=Q, capture_sizes=SIZES, policy=everywhere))  # fmt: skip
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert set(whole.unserved) == {"router", "shared_expert", "kda_proj", "dsa_proj"}
    assert whole.unserved["router"] == "moe (the whole MoE layer) serves its token counts [2, 4]"
    assert "kda (the whole KDA sublayer)" in whole.unserved["kda_proj"]
    assert not {"router", "shared_expert", "kda_proj", "dsa_proj"} & set(whole.stage_of.values())
    # moe at 1-2 only: the router and shared expert serve the 4-token steps (1 is no
    # multiple of q: not a planned size).
    some = SpecializedDecode(ReferenceBackbone(model), DecodeConfig.build(
        max_context=64, q=Q, capture_sizes=SIZES,
        policy={**everywhere, "moe": {"1-2": "per_route"}}))  # fmt: skip
    assert set(some.unserved) == {"kda_proj", "dsa_proj"}
    assert {"router", "shared_expert"} <= set(some.stage_of.values())


def test_a_sublayer_part_at_one_count_is_a_route_at_another():
    """kda at 2 tokens and kda_proj at 4: o_proj is the KDA sublayer's part in the 2-token
    step and kda_proj's route in the 4-token one. (Sublayer parts were once filtered by name
    for every count: the 4-token step then ran o_proj and the input projection as stock
    GEMMs, ~1 ms of the H200's 32- and 64-token TP-4 steps in `tune`'s confirmation.)"""
    model = _model(_small())
    policy = {**TRITON_STAGES, "kda": {"2": "fused"}, "kda_proj": {"1-64": "gemm"}}
    decode = SpecializedDecode(ReferenceBackbone(model), DecodeConfig.build(
        max_context=64, q=Q, capture_sizes=SIZES, policy=policy))  # fmt: skip
    layer = next(i for i, t in enumerate(model.g.layer_types) if t == "linear_attention")
    o_proj = f"layers.{layer}.self_attn.o_proj.weight"
    routes = model.ranks[0].routes
    with decode.installed(2):
        assert o_proj not in routes  # the sublayer calls its own
        assert decode.stage_of[id(decode._serving[0, o_proj])] == "kda"
    with decode.installed(4):
        assert decode.stage_of[id(routes[o_proj])] == "kda_proj"
        assert (0, o_proj) not in decode._serving
    assert o_proj not in routes


def test_stage_that_cannot_build_warns_once_and_runs_stock(caplog):
    g = geometry("tiny")  # hidden 64: FP8 GEMMs need K % 128 == 0, so they cannot build
    model = _model(g)
    with caplog.at_level(logging.WARNING, logger="glm5_runtime"):
        decode = _decoder(model, TRITON_STAGES)
    # The runtime's own warnings (the CuTe boundary's, which cannot run on a CPU, is the
    # kernel package's: test_mhc checks it).
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and r.name == "glm5_runtime"]  # fmt: skip
    assert len(warned) == 3, warned
    assert any("shared_expert runs stock" in w for w in warned)
    assert any("dense_mlp runs stock" in w for w in warned)
    assert any("moe runs stock" in w for w in warned)
    kinds = {op.__class__.__name__ for op, _ in decode.ops}
    # The BF16 ones build.
    assert kinds == {
        "Projection",
        "Router",
        "MhcBoundary",
        "KdaDecode",
        "SparseMlaDecode",
        "IndexerTopk",
        "KpoolWrite",
        "LatentWrite",
        "Embedding",
    }
    routed = {name for _, name, _ in decode.routes[2]}
    assert not any(name.endswith((".mlp", ".shared_experts")) for name in routed)


def test_stage_that_cannot_compile_warns_once_and_runs_stock(caplog, monkeypatch):
    """A kernel that fails in prepare() (a compile error) takes its whole stage to stock
    (the MoE stage too: its layer op runs a Router), and a failed MoE stage its whole
    sublayer."""
    from glm5_kernels.gemm import Router
    from glm5_kernels.mhc import MhcBoundary

    def broken(self, tokens):
        raise RuntimeError("ptxas: out of registers")

    model = _model(_small())
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=SIZES, policy=TRITON_STAGES)
    decode = SpecializedDecode(ReferenceBackbone(model), config)
    monkeypatch.setattr(Router, "prepare", broken)
    monkeypatch.setattr(MhcBoundary, "prepare", broken)
    with caplog.at_level(logging.WARNING, logger="glm5_runtime"):
        assert decode.prepare() == {"router", "moe", "boundary"}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        f"Specialized decode: stage {s} runs stock (RuntimeError: ptxas: out of registers)"
        for s in ("router", "moe", "boundary")
    ]
    assert decode.mhc is None  # planned steps run the stock boundaries
    kinds = {op.__class__.__name__ for op, _ in decode.ops}
    # the shared expert stage at 4 tokens (where the MoE stage leaves the count) still builds
    assert kinds == {
        "Projection",
        "SharedExpert",
        "DenseMlp",
        "KdaDecode",
        "SparseMlaDecode",
        "IndexerTopk",
        "KpoolWrite",
        "LatentWrite",
        "Embedding",
    }
    # Where the MoE stage failed (2 tokens) its whole sublayer runs stock: no router or
    # shared expert stage left inside a stock layer.
    assert not any(name.endswith((".gate.weight", ".shared_experts"))
                   for _, name, _ in decode.routes[2])  # fmt: skip
    assert not any(type(op).__name__ == "MoeLayer" for _, _, op in decode.routes[2])
    assert any(name.endswith(".shared_experts") for _, name, _ in decode.routes[4])
    assert decode.head  # the other stages are untouched


def test_draft_steps_equal_stock(monkeypatch):
    """MTP draft decodes (one token per request) and draft prefills (q per request: every
    row, then only each request's last row past the attention) against the reference's
    draft_hidden, every stage op at a token count it was prepared for (as a CUDA-graph
    capture demands: a first call at another count is an error here too).

    Bound: as the decode's (decode_cases.Yardstick), per row against the stock BF16 draft's
    own distance from the FP32 draft on the same inputs, where the choices agree; the latent
    KV it wrote as closely."""
    from glm5_runtime.draft import SpecializedDraft

    g = _small()
    stock, spec, fp32 = _model(g), _model(g), _model(g, torch.float32)
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=SIZES, policy=ALL_STAGES)
    draft = SpecializedDraft(ReferenceBackbone(spec), config)
    draft.prepare()
    kinds = {op.__class__.__name__ for op, _ in draft.ops}
    assert kinds == {
        "Projection",
        "Router",
        "SharedExpert",
        "MoeLayer",
        "SparseMlaDecode",
        "IndexerTopk",
        "KpoolWrite",
        "LatentWrite",
        "Embedding",
    }
    assert not any(type(op).__name__ == "Router" for _, _, op in draft.routes[2])  # in MoE
    # The draft prefill (2 x Q = 4 tokens: the MoE's router and shared expert stages beside
    # the stock experts; only its 2 sampled rows past the attention: the MoE stage's) and the
    # decodes (2 tokens: the MoE stage).
    assert {type(op).__name__ for _, _, op in draft.routes[4]} >= {"Router", "SharedExpert"}
    routed = {name for b in (2, 4) for _, name, _ in draft.routes[b]}
    assert f"layers.{g.num_hidden_layers}.eh_proj.weight" in routed
    pairs = []
    shadow(draft, spec, pairs)
    gen = torch.Generator().manual_seed(4)
    requests = [0, 1]
    for m in (stock, spec, fp32):
        assert [m.add(), m.add()] == requests
    yardstick = Yardstick(stock, spec, fp32, [draft])
    hidden = torch.randn(2, Q, g.hidden_size, generator=gen).bfloat16()
    capturing_everywhere(monkeypatch)  # first_call's rule; no check that reads values
    # A draft prefill of every row, the same of the sampled rows only, then two decodes.
    for t, start, sampled in ((Q, 5, False), (Q, 5, True), (1, 5 + Q, True), (1, 6 + Q, True)):
        tokens = torch.randint(0, g.vocab_size, (2, t), generator=gen)
        # A decode's positions a column of a wider tensor (a row stride), as a draft after a
        # verify slices them.
        positions = (start + torch.arange(Q).expand(2, Q))[:, :t]
        yardstick.start()
        at = stock.place(requests, positions)
        ref, _ = stock.draft_hidden(tokens, hidden[:, :t], at)
        h32, _ = fp32.draft_hidden(tokens, hidden[:, :t].float(), fp32.place(requests, positions))
        placement = spec.place(requests, positions)
        decision = draft.plan(placement, capturing=True)
        assert decision.step is not None and decision.step.q == (Q if t > 1 else 1)
        with NoHostRead():  # as a capture takes the draft step and the shadows' references
            out = draft.run(decision.step, 0, tokens, hidden[:, :t], placement,
                            sampled_only=sampled)  # fmt: skip
        ref, h32 = (ref[:, -1:], h32[:, -1:]) if t > 1 and sampled else (ref, h32)
        assert out.shape == ref.shape
        # The draft's MLA wrote the same latent KV (every token of the prefill included).
        yardstick.compare(ref, out, h32, step=at)
    yardstick.check(MIN_COMPARED)
    assert {name for _, name, _, _ in pairs} == routed
    check_calls(pairs)


def test_planned_step_from_input_embeddings():
    """A multimodal model hands the step its input embeddings instead of token ids."""
    g = _small()
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, g.vocab_size, (Q, 5), generator=gen)
    tokens = torch.randint(0, g.vocab_size, (Q, Q), generator=gen)
    model = _model(g, requests=2 * Q)
    decode = _decoder(model)
    out = []
    for use_embeds in (False, True):  # two groups of Q requests, alike: a step writes caches
        requests = [model.add() for _ in range(Q)]
        model.forward(requests, prompt)
        step = model.step(requests, Q, verify=True)
        decision = decode.plan(step, capturing=True)
        assert decision.step is not None, decision.reason
        if use_embeds:
            out.append(decode.run(decision.step, None, step, decode.backbone.embed(tokens)))
        else:
            out.append(decode.run(decision.step, tokens, step))
    assert torch.equal(out[1], out[0])


def test_gate_up_is_read_in_place_where_the_backbone_holds_it_merged():
    from glm5_runtime.decode import _stacked

    merged = torch.randn(6, 4)  # vLLM's gate_up_proj: gate rows, then up rows
    both = _stacked(merged[:2], merged[2:])
    assert both.data_ptr() == merged.data_ptr() and torch.equal(both, merged)
    for a, b in ((torch.randn(2, 4), torch.randn(3, 4)), (merged[:2], merged[3:])):
        both = _stacked(a, b)  # apart (the checkpoint's), or not adjacent: a copy
        assert torch.equal(both, torch.cat([a, b]))
        assert both.untyped_storage().data_ptr() != merged.untyped_storage().data_ptr()


def _built(backbone, caplog, policy=TRITON_STAGES):
    """A SpecializedDecode over `backbone` and the warnings its build logged."""
    caplog.clear()
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=SIZES, policy=policy)
    with caplog.at_level(logging.WARNING, logger="glm5_runtime"):
        decode = SpecializedDecode(backbone, config)
    return decode, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_moe_stage_needs_glms_routing(caplog):
    """A backbone whose MoE layers route otherwise (`routing` None) keeps them stock."""
    model = _model(_small())
    backbone = ReferenceBackbone(model)
    backbone.routing = None
    decode, warned = _built(backbone, caplog)
    assert warned == [
        "Specialized decode: stage moe runs stock (ValueError: the backbone's MoE routing is "
        "not GLM's (Backbone.routing))"
    ]
    assert not any(type(op).__name__ == "MoeLayer" for op, _ in decode.ops)


def test_boundaries_need_glms_mhc_and_their_weights(caplog):
    """A backbone without GLM's mHC (`mhc` None), or whose boundary weights the kernel
    cannot read, keeps every boundary stock: one warning naming each problem, and its planned
    steps run the stock boundaries."""
    model = _model(_small())
    backbone = ReferenceBackbone(model)
    backbone.mhc = None
    decode, warned = _built(backbone, caplog)
    assert warned == [
        "Specialized decode: stage boundary runs stock (ValueError: the backbone's boundaries "
        "are not GLM's mHC (Backbone.mhc))"
    ]
    assert decode.mhc is None

    backbone = ReferenceBackbone(model)
    w = model.ranks[0].w
    saved = {n: w[n] for n in ("layers.1.ffn_hc.fn", "layers.2.attn_hc.base")}
    w["layers.1.ffn_hc.fn"] = saved["layers.1.ffn_hc.fn"][:, :8]
    w["layers.2.attn_hc.base"] = saved["layers.2.attn_hc.base"].double()
    try:
        decode, warned = _built(backbone, caplog)
    finally:
        w.update(saved)
    assert len(warned) == 1 and "stage boundary runs stock" in warned[0], warned
    assert decode.mhc is None
    assert not any(type(op).__name__ == "MhcBoundary" for op, _ in decode.ops)


def test_kda_stage_needs_the_backbones_route_and_split_gate_is_refused(caplog):
    """A backbone whose KDA layers take no fused stage (`kda` None)
    keeps them stock with one warning; a policy picking `split_gate` (not built) is refused
    by the policy, naming its key."""
    model = _model(_small())
    backbone = ReferenceBackbone(model)
    backbone.kda = None
    decode, warned = _built(backbone, caplog)
    assert warned == [
        "Specialized decode: stage kda runs stock (ValueError: the backbone's KDA layers do not "
        "take the fused stage (Backbone.kda))"
    ]
    assert not any(name.endswith(".kda") for _, name, _ in decode.routes[2])

    policy = {**TRITON_STAGES, "kda": {"1-2": "fused", "3-64": "split_gate"}}
    with pytest.raises(ValueError, match=r"policy\['kda'\]\['3-64'\]: 'split_gate' is not built"):
        _built(ReferenceBackbone(model), caplog, policy)


def test_mla_sublayer_selects_as_stock():
    """The MLA stages alone (`dsa_attn`, `dsa_kpool`, `dsa_indexer`: the MLA sublayer, its
    projections its own), where the indexer must choose (top 2 of up to 16 pools, tiny's
    index_topk 8 of pools of 4): every selection equal to the reference's on the same scores,
    every other op within its bound of its reference on the same inputs."""
    g = _small()
    stock, spec = (_model(g) for _ in range(2))
    mla = {"dsa_attn": {"1-64": "sparse"}, "dsa_kpool": {"1-64": "fused"},
           "dsa_indexer": {"1-64": "fused"}}  # fmt: skip
    decode = _decoder(spec, policy={stage: None for stage in ALL_STAGES} | mla)
    assert {type(op).__name__ for op, _ in decode.ops} == {
        "SparseMlaDecode",
        "LatentWrite",
        "Projection",
        "KpoolWrite",
        "IndexerTopk",
    }
    pairs = []
    shadow(decode, spec, pairs)
    gen = torch.Generator().manual_seed(11)
    requests = [0, 1]
    prompt = torch.randint(0, g.vocab_size, (Q, 9), generator=gen)
    for m in (stock, spec):
        assert [m.add() for _ in requests] == requests
        m.forward(requests, prompt)
    chose = 0
    for i in range(6):
        verify = i % 2 == 1
        t = Q if verify else 1
        tokens = torch.randint(0, g.vocab_size, (Q, t), generator=gen)
        stock.forward(requests, tokens, verify=verify)

        def planned(tokens, step):
            decision = decode.plan(step, capturing=True)
            assert decision.step is not None, decision.reason
            return decode.run(decision.step, tokens, step)

        spec.forward(requests, tokens, verify=verify, run=planned)
        assert "IndexerTopk" in {kind for kind, *_ in pairs}
        check_calls(pairs)  # each selection equal to the reference's on the same scores
        for _, _, y, _ in (p for p in pairs if p[0] == "IndexerTopk"):
            picked = (y[:, : g.index_topk] >= 0).sum(1) // g.index_kpool
            chose += int((picked == g.index_topk // g.index_kpool).sum())
        pairs.clear()
        copy_caches(spec, stock)  # the next step from the same state
        if verify:
            for m in (stock, spec):
                for r in requests:
                    m.accept(r, 1)
    assert chose > 0  # rows with more visible pools than it keeps


def test_agreeing_tokens_keep_each_request_s_prefix():
    """A token compares where it and its request's earlier tokens chose alike in every log:
    2 requests x 3 tokens; one MoE log of every row (request 0's token 1 differs), one of
    each request's last row only (request 1's differs); request-level agreement: none."""
    gen = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 288, (6, 8), generator=gen)
    last = torch.randint(0, 288, (2, 8), generator=gen)
    other, other_last = experts.clone(), last.clone()
    other[1, 3] += 1
    other_last[1, 0] += 1
    a = [("moe", experts), ("draft", last)]
    b = [("moe", other), ("draft", other_last)]
    want = torch.tensor([[True, False, False], [True, True, False]])
    assert torch.equal(agreeing_tokens(a, b, 2, 3), want)
    assert not agreeing_logs(a, b, 2).any()
    assert agreeing_tokens(a, a, 2, 3).all()


@pytest.mark.parametrize("tp, ranks", [(2, (0, 1)), (2, (1,))])
def test_embed_stage_equals_the_backbones_embedding(tp, ranks):
    """The `embed` stage (one `Embedding` launch a shard) gives the backbone's embedding bit
    for bit: every held shard's rows summed (a token's row lives in one shard, zeros in the
    others: the sum is exact), or one held rank's partial (its vocabulary's rows, zeros
    else), for ids across the whole vocabulary."""
    g = geometry("tiny", tp_size=tp, ranks=ranks)
    model = ReferenceModel.random(g, seed=3, max_requests=2, max_context=64, block_size=16, q=Q)
    decode = _decoder(model, policy={stage: None for stage in ALL_STAGES} | {
        "embed": {"1-64": "gather"}})  # fmt: skip
    assert [type(op).__name__ for op, _ in decode.ops] == ["Embedding"] * len(ranks)
    ids = torch.randint(0, g.vocab_size, (2, Q), generator=torch.Generator().manual_seed(1))
    step = decode.plan(model.step([model.add(), model.add()], Q, verify=True),
                       capturing=True).step  # fmt: skip
    assert step is not None and step.tokens == ids.numel()
    with decode.installed(step.tokens):
        got = decode._embed(ids, step)
    want = decode.backbone.embed(ids)
    assert got.shape == want.shape and torch.equal(got, want)


def test_mla_sublayer_attends_a_selection_the_placement_carries():
    """Where the backbone's placement carries the step's selection (vLLM's MTP drafter after
    step 0 reuses that step's), every MLA layer attends it without its indexer: no pool
    write or selection launch, the attention reads exactly those rows; the latent cache is
    still written."""
    import dataclasses

    g = _small()
    model = _model(g)
    mla = {"dsa_attn": {"1-64": "sparse"}, "dsa_kpool": {"1-64": "fused"},
           "dsa_indexer": {"1-64": "fused"}}  # fmt: skip
    decode = _decoder(model, policy={stage: None for stage in ALL_STAGES} | mla)
    backbone = decode.backbone
    requests = [model.add(), model.add()]
    model.forward(requests, torch.randint(0, g.vocab_size, (2, 9)))
    width = g.index_topk + g.index_kpool - 1
    chosen = torch.full((2, width), -1, dtype=torch.int32)
    chosen[:, :5] = torch.tensor([[0, 2, 4, 6, 8], [1, 3, 5, 7, 8]], dtype=torch.int32)
    placed = backbone.mla_placement
    backbone.mla_placement = lambda p, i: dataclasses.replace(placed(p, i), selection=chosen)
    calls: dict[str, list] = {"IndexerTopk": [], "KpoolWrite": [], "SparseMlaDecode": []}

    class Logged:  # a stage op whose calls are logged; everything else is the op's
        def __init__(self, op):
            self.op = op

        def __getattr__(self, name):
            return getattr(self.op, name)

        def __call__(self, *args, **kw):
            calls[type(self.op).__name__].append(args)
            return self.op(*args, **kw)

    routes = decode.routes[2]
    for j, (shard, name, op) in enumerate(routes):
        if type(op).__name__ in calls:
            routes[j] = (shard, name, Logged(op))
    step = model.step(requests, 1)
    latent_before = {i: c.clone() for i, c in model.ranks[0].c.latent.items()}
    decision = decode.plan(step, capturing=True)
    decode.run(decision.step, torch.randint(0, g.vocab_size, (2, 1)), step)
    assert not calls["IndexerTopk"] and not calls["KpoolWrite"]
    assert len(calls["SparseMlaDecode"]) == len(g.mla_layers)
    assert all(args[4] is chosen for args in calls["SparseMlaDecode"])
    for i in g.mla_layers:  # each layer's latent rows for the step written all the same
        assert not torch.equal(model.ranks[0].c.latent[i], latent_before[i])
