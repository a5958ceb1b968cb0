"""The drafter's adapter (`VllmDraftBackbone`) and hooks over a real vLLM 0.33 Glm5NextMTP
built on CPU (one MTP layer: MLA + DSA + MoE), loaded by vLLM's own loader from the
reference's checkpoint: weights by checkpoint name, vLLM's eh_proj input / linear / norms
against the reference backbone's draft members, the SpecializedDraft stages over vLLM's
modules, and the forward hook's stock fallback and plan."""

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def built(tmp_path_factory, cpu_linears):
    from tiny_model import build

    return build(tmp_path_factory.mktemp("glm5-vllm-mtp"), draft=True)  # on conftest's CPU platform


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


MLA = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "indexer.wq_b")


def test_mtp_layers_and_weights_map_onto_vllms_parameters(built):
    from glm5_runtime.protocol import Layer
    from glm5_vllm.backbone import VllmDraftBackbone

    model, _, reference, sd = built
    b = VllmDraftBackbone(model)
    mtp = reference.g.num_hidden_layers
    assert b.draft_layers == (Layer(mtp, "mla", "moe"),) and b.layers == ()
    p = f"layers.{mtp}"
    names = [f"{p}.eh_proj.weight", f"{p}.mlp.gate.weight"]
    names += [f"{p}.self_attn.{n}.weight" for n in MLA]
    names += [f"{p}.mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
    for name in names:
        w = b.weight(0, name)
        assert w is not None, name
        assert torch.equal(w, sd[name].to(w.dtype)), name
    assert b.weight(0, "layers.0.self_attn.q_proj.weight") is None  # not the drafter's


def test_stock_draft_operations_match_the_reference_backbone(built):
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from glm5_runtime.reference.backbone import ReferenceBackbone
    from glm5_vllm.backbone import VllmDraftBackbone, VllmStep

    model, vllm_config, reference, _ = built
    b, r = VllmDraftBackbone(model), ReferenceBackbone(reference)
    gen = torch.Generator().manual_seed(0)
    n, d, mtp = 6, reference.g.hidden_size, reference.g.num_hidden_layers
    ids = torch.randint(0, reference.g.vocab_size, (n,), generator=gen)
    hidden = torch.randn(n, d, generator=gen).bfloat16()
    positions = torch.arange(n)  # position 0: the embedding is zeroed
    with set_current_vllm_config(vllm_config), torch.no_grad():
        got = b.draft_input(0, ids, hidden, VllmStep(positions, None))
        want = r.draft_input(0, ids[None], hidden[None], SimpleNamespace(positions=positions[None]))
        assert got.shape == (n, 2 * d)
        assert _rel(got, want[0]) < 2**-7  # one fused FP32 rounding vs two BF16 norms
        assert torch.equal(got[0, :d], torch.zeros(d, dtype=got.dtype))
        eh = f"layers.{mtp}.eh_proj.weight"
        x = b.linear(0, eh, got)
        assert _rel(x, r.linear(0, eh, got)) < 2**-8
        for norm in ("input_layernorm", "post_attention_layernorm", "shared_head.norm"):
            name = f"layers.{mtp}.{norm}.weight"
            assert _rel(b.norm(name, x), r.norm(name, x)) < 2**-7, norm


def test_mtp_model_binds_the_specialized_draft_and_runs_stock_when_unplanned(built, monkeypatch):
    from vllm.models.glm5next import Glm5NextMTP as Stock

    import glm5_vllm.models as models
    from glm5_policy import DecodeConfig
    from glm5_runtime.draft import SpecializedDraft
    from glm5_runtime.plan import Rows
    from glm5_runtime.reference.backbone import ReferenceBackbone
    from glm5_vllm.backbone import VllmStep
    from glm5_vllm.metadata import step_context

    model, _, reference, _ = built
    mtp = reference.g.num_hidden_layers
    policy = {"dsa_proj": {"1-64": "split_k"}, "dsa_attn": {"1-64": "sparse"}}
    config = DecodeConfig.build(max_context=64, q=2, capture_sizes=[1, 2, 4], policy=policy)
    draft = models._bind(model, config, draft=True)
    assert isinstance(draft, SpecializedDraft)
    # The MTP layer's MLA constants: the reference's.
    assert draft.backbone.mla == ReferenceBackbone(reference).mla
    routed = {name for _, name, _ in draft.routes[2]}
    # q_a | kv_a: one op over vLLM's fused weight; the other projections one each (`dsa_attn`
    # alone builds nothing: the MLA sublayer needs the indexer's stages too).
    assert routed == {f"layers.{mtp}.eh_proj.weight"} | {
        f"layers.{mtp}.self_attn.{n}.weight"
        for n in ("fused_qkv_a_proj", "q_b_proj", "o_proj", "indexer.wq_b")
    }
    draft.prepare()
    # Installed, the Triton eh_proj stage (interpreted) serves vLLM's nn.Linear eh_proj.
    eh_proj = model.model.layers[str(mtp)].eh_proj
    x = torch.randn(2, 2 * reference.g.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = eh_proj(x.bfloat16())
        with draft.installed(2):
            assert "forward" in vars(eh_proj)
            routed_out = eh_proj(x.bfloat16())
        assert "forward" not in vars(eh_proj)
    assert _rel(routed_out, stock) < 2**-8
    # The hook: eager steps run vLLM's drafter; FULL-graph draft decodes plan, PIECEWISE not.
    calls = []
    monkeypatch.setattr(Stock, "forward", lambda self, *a, **k: calls.append(a) or "stock")
    model.glm5_specialized, model._glm5_prepared = draft, True
    ids, positions = torch.zeros(2, dtype=torch.long), torch.arange(2)
    hidden = torch.zeros(2, reference.g.hidden_size, dtype=torch.bfloat16)
    assert model.forward(ids, positions, hidden) == "stock" and len(calls) == 1
    decode = Rows(decodes=2, decode_tokens=2)
    context = step_context(2)
    full = type(context)(2, True, "FULL", rows={f"layers.{mtp}.self_attn": decode})
    plan = draft.plan(VllmStep(positions, full), True, "FULL")
    assert plan.step is not None and (plan.step.q, plan.step.tokens) == (1, 2), plan.reason
    assert draft.plan(VllmStep(positions, full), True, "PIECEWISE").step is None
    model.glm5_specialized = None
