"""The adapter (`VllmBackbone`) and the model hooks over a real vLLM 0.33 Glm5NextForCausalLM
built on CPU (tiny, KDA-only; tiny_model.py says where vLLM stops on CPU), its weights
loaded by vLLM's own loader from the reference's checkpoint.

- every weight the specialized decode reads maps, by its HF name, onto a view of the vLLM
  parameter holding exactly the checkpoint's tensor (fused projections sliced);
- vLLM's stock operations that run on CPU (embedding, mHC expand / post / contract and final
  norm, dense MLP, LM head) agree with the reference backbone on the same weights;
- routes make vLLM's modules run stage ops (whole, fused part, router, MLP block) and leave
  them exactly as they were;
- the model binds SpecializedDecode after load_weights, runs vLLM's forward for steps the
  plan does not take, and plans FULL-graph decode captures."""

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def built(tmp_path_factory, cpu_linears):
    from tiny_model import build

    return build(tmp_path_factory.mktemp("glm5-vllm-tiny"))  # on conftest's CPU platform


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def b_hidden(model):
    return model.config.hidden_size


def _backbone(built):
    from glm5_vllm.backbone import VllmBackbone

    return VllmBackbone(built[0])


def test_layers_and_weights_map_onto_vllms_parameters(built):
    from glm5_runtime.reference.backbone import ReferenceBackbone

    model, _, _, sd = built
    b = _backbone(built)
    g = built[2].g
    assert [(x.attention, x.mlp) for x in b.layers] == [
        ("mla" if g.is_mla(i) else "kda", "dense" if t == "dense" else "moe")
        for i, t in enumerate(g.mlp_layer_types)
    ]
    assert {x.attention for x in b.layers} == {"kda", "mla"}
    assert b.shards == (0,) and b.hidden_size == g.hidden_size and b.aux_layers == ()
    assert b.mhc == ReferenceBackbone(built[2]).mhc  # the boundary stage's constants
    mla = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "indexer.wq_b")
    names = ["lm_head.weight", "norm.weight"]
    for i, t in enumerate(g.mlp_layer_types):
        p = f"layers.{i}"
        # The mHC boundaries' weights (vLLM keeps them on the layer: hc_attn_fn, ...).
        names += [f"{p}.{site}_hc.{n}" for site in ("attn", "ffn") for n in ("fn", "scale", "base")]
        names += [f"{p}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
        projections = mla if g.is_mla(i) else ("q_proj", "k_proj", "v_proj", "o_proj")
        names += [f"{p}.self_attn.{n}.weight" for n in projections]
        if t == "dense":
            names += [f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        else:
            names += [f"{p}.mlp.gate.weight"]
            names += [f"{p}.mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
    params = [p.data for p in model.parameters()]
    for name in names:
        w = b.weight(0, name)
        assert w is not None, name
        assert torch.equal(w, sd[name].to(w.dtype)), name
        # A view into vLLM's own storage: read, never copied.
        assert any(w.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in params)
    # Each layer's fused attention weight holds its projections' rows in order, in one tensor.
    for i in range(g.num_hidden_layers):
        held = {f: b.weight(0, f"layers.{i}.self_attn.{f}.weight") for f in b.fused_projections}
        held = {f: w for f, w in held.items() if w is not None}
        assert list(held) == ["fused_qkv_a_proj" if g.is_mla(i) else "in_proj_qkvbfg_a"]
        for fused, whole in held.items():
            start = 0
            for p in b.fused_projections[fused]:
                w = b.weight(0, f"layers.{i}.self_attn.{p}.weight")
                assert w.data_ptr() == whole[start].data_ptr(), (i, p)
                start += w.shape[0]
    # Unquantized here: no block scales; a name no module holds is None.
    assert b.weight(0, "layers.0.mlp.gate_proj.weight_scale_inv") is None
    assert b.weight(0, "layers.0.self_attn.q_a_proj.weight") is None  # a KDA layer


def test_stock_operations_match_the_reference_backbone(built):
    from vllm.config import set_current_vllm_config

    from glm5_runtime.reference.backbone import ReferenceBackbone

    model, vllm_config, reference, _ = built
    b, r = _backbone(built), ReferenceBackbone(reference)
    gen = torch.Generator().manual_seed(0)
    n, d = 7, reference.g.hidden_size
    ids = torch.randint(0, reference.g.vocab_size, (n,), generator=gen)
    x = torch.randn(n, d, generator=gen).bfloat16()
    with set_current_vllm_config(vllm_config), torch.no_grad():
        assert torch.equal(b.embed(ids), r.embed(ids[None])[0])
        streams = b.expand(x)
        assert torch.equal(streams, r.expand(x))
        streams = (streams.float() + torch.randn(streams.shape, generator=gen)).bfloat16()
        # vLLM's CPU mHC ops need its CPU build: pre and post run their torch paths here,
        # whose pre leaves the input norm to the fused CUDA kernel (applied below).
        layer = model.model.layers[2]
        pre_op = layer.mhc_pre_op
        pre_op._forward_method = pre_op.forward_native
        for site, norm in (
            ("attn", layer.input_layernorm),
            ("ffn", layer.post_attention_layernorm),
        ):
            x_v, post_v, comb_v = b.pre(2, site, streams)
            x_r, post_r, comb_r = r.pre(2, site, streams)
            assert post_v.shape == (n, reference.g.hc_mult, 1)
            assert _rel(post_v[..., 0], post_r) < 1e-5 and _rel(comb_v, comb_r) < 1e-5, site
            assert _rel(norm(x_v), x_r) < 2**-7, site
        _, post, comb = r.pre(2, "ffn", streams)
        op = model.model.layers[0].mhc_post_op
        op._forward_method = op.forward_native
        got, want = b.post(x, streams, post[..., None], comb), r.post(x, streams, post, comb)
        assert _rel(got, want) < 2**-7  # one BF16 rounding of FP32 vs BF16 mixing
        assert torch.equal(b.final_norm(streams), r.final_norm(streams))
        assert _rel(b.mlp(0, 0, x), r.mlp(0, 0, x[None])[0]) < 2**-7
        assert torch.equal(b.gather([b.head(0, x)]), r.gather([r.head(0, x)]))
        assert b.reduce([x]) is x  # vLLM's modules reduce inside


def test_routes_run_stage_ops_and_leave_vllms_modules_as_they_were(built):
    import torch.nn.functional as F
    from vllm.config import set_current_vllm_config

    model, vllm_config, _, _ = built
    b = _backbone(built)
    layer = model.model.layers[2]
    attn, mlp = layer.self_attn, layer.mlp
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, b.hidden_size, generator=gen).bfloat16()
    with set_current_vllm_config(vllm_config), torch.no_grad():
        stock = {
            "in_proj": attn.in_proj_qkvbfg_a(x)[0], "gate": mlp.gate(x)[0],
            "shared": mlp.shared_experts(x),
        }  # fmt: skip
        w_k = b.weight(0, "layers.2.self_attn.k_proj.weight")
        w_g = b.weight(0, "layers.2.mlp.gate.weight")
        routes = {
            "layers.2.self_attn.k_proj.weight": lambda t: 2 * F.linear(t, w_k),
            "layers.2.mlp.gate.weight": lambda t: F.linear(t.float(), w_g.float()),
            "layers.2.mlp.shared_experts": lambda t: torch.zeros_like(t),
        }
        for name, op in routes.items():
            b.route(0, name, op)
        assert {"forward"} <= set(vars(attn.in_proj_qkvbfg_a))
        fused = attn.in_proj_qkvbfg_a(x)[0]
        k0, k1 = (
            attn.in_proj_qkvbfg_a.output_partition_sizes[0],
            sum(attn.in_proj_qkvbfg_a.output_partition_sizes[:2]),
        )
        assert torch.equal(fused[:, k0:k1], 2 * F.linear(x, w_k))  # the routed part
        assert torch.equal(fused[:, :k0], stock["in_proj"][:, :k0])  # the others: vLLM's
        assert torch.equal(fused[:, k1:], stock["in_proj"][:, k1:])
        logits = mlp.gate(x)[0]
        assert logits.dtype == (mlp.gate.out_dtype or logits.dtype)
        assert torch.equal(logits, F.linear(x.float(), w_g.float()).to(logits.dtype))
        assert torch.equal(mlp.shared_experts(x), torch.zeros_like(x))
        for name in routes:
            b.route(0, name, None)
        for module in (attn.in_proj_qkvbfg_a, mlp.gate, mlp.shared_experts):
            assert "forward" not in vars(module)  # the class's forward again
        assert torch.equal(attn.in_proj_qkvbfg_a(x)[0], stock["in_proj"])
        assert torch.equal(mlp.gate(x)[0], stock["gate"])
        assert torch.equal(mlp.shared_experts(x), stock["shared"])
    with pytest.raises(KeyError, match=r"layers\.99"):
        b.route(0, "layers.99.self_attn.o_proj.weight", lambda t: t)


def test_unreduced_leaves_every_sublayer_output_tp_partial(built, monkeypatch):
    """Inside `unreduced()` (a fused boundary all-reduces instead) vLLM's vocab-parallel
    embedding, row-parallel layers and MoE blocks skip their all-reduce, stock and routed
    alike; outside, and after it, they reduce as vLLM built them, and a stage's partial
    output is all-reduced by `all_reduce`. TP 2 is played by the
    layers' `tp_size` and a stand-in all-reduce that doubles (two ranks' equal partials); TP 1
    has no mailbox."""
    import vllm.distributed as vd
    import vllm.model_executor.layers.linear as vllm_linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vllm_vocab
    from vllm.config import set_current_vllm_config

    model, vllm_config, _, _ = built
    b = _backbone(built)
    layers = model.model.layers
    flags = b._reduce_flags()
    assert len(flags) == 1 + 2 * len(layers)  # the embedding's, then every sublayer's
    before = [getattr(h, n) for h, n, _ in flags]
    assert before == [not v for _, _, v in flags]  # vLLM reduces every sublayer's output
    with b.unreduced():
        assert [getattr(h, n) for h, n, _ in flags] == [v for _, _, v in flags]
    assert [getattr(h, n) for h, n, _ in flags] == before
    assert b.mailbox(b.hidden_size, 8) is None  # TP 1: nothing to exchange

    def doubled(t):
        return 2 * t

    monkeypatch.setattr(vllm_linear, "tensor_model_parallel_all_reduce", doubled)
    monkeypatch.setattr(vd, "tensor_model_parallel_all_reduce", doubled)
    monkeypatch.setattr(vd, "get_tensor_model_parallel_world_size", lambda: 2)
    embedding = model.model.embed_tokens
    ids = torch.tensor([0, 5, b.vocab_size - 1])
    with set_current_vllm_config(vllm_config), torch.no_grad():
        row = b.embed(ids)  # TP 1: the lookup, no all-reduce
        monkeypatch.setattr(embedding, "tp_size", 2)
        monkeypatch.setattr(vllm_vocab, "tensor_model_parallel_all_reduce", doubled)
        with b.unreduced():
            assert torch.equal(b.embed(ids), row)  # the shard's rows (here: all of them)
        assert torch.equal(b.embed(ids), 2 * row)
    dense = next(i for i, x in enumerate(b.layers) if x.mlp == "dense")
    moe = next(i for i, x in enumerate(b.layers) if x.mlp == "moe")
    down = layers[dense].mlp.down_proj
    monkeypatch.setattr(down, "tp_size", 2)
    x = torch.randn(3, b.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    with set_current_vllm_config(vllm_config), torch.no_grad():
        mlp = layers[dense].mlp
        reduced = down(mlp.act_fn(mlp.gate_up_proj(x)[0]))[0]  # "summed" over the 2 ranks
        with b.unreduced():
            assert torch.equal(b.mlp(0, dense, x), reduced / 2)  # stock: no all-reduce
        assert torch.equal(b.mlp(0, dense, x), reduced)
        # A routed MLP block (the shared expert's kind) reduces as vLLM's would, at each call.
        b.route(0, f"layers.{dense}.mlp", lambda t: t + 1)
        with b.unreduced():
            assert torch.equal(b.mlp(0, dense, x), x + 1)
        assert torch.equal(b.mlp(0, dense, x), 2 * (x + 1))
        b.route(0, f"layers.{dense}.mlp", None)
        # A whole sublayer the layer loop ran as a stage: its partial, all-reduced here.
        assert torch.equal(b.all_reduce([x]), 2 * x)
    # TP 2: vLLM's all-reduce until the fused one is asked for (not yet run on GPUs); an MoE
    # kernel that reduces inside cannot leave its output to a boundary.
    monkeypatch.delenv("GLM5_FUSED_ALL_REDUCE", raising=False)
    assert b.mailbox(b.hidden_size, 8) is None
    monkeypatch.setenv("GLM5_FUSED_ALL_REDUCE", "1")
    runner = type(layers[moe].mlp.experts)
    monkeypatch.setattr(runner, "_fused_output_is_reduced", True)
    with pytest.raises(ValueError, match=f"layer {moe}: its MoE kernel all-reduces inside"):
        b.mailbox(b.hidden_size, 8)


def test_kda_sublayer_runs_on_vllms_weights_caches_and_placement(built, monkeypatch):
    """The fused KDA sublayer over vLLM's KDA layer (seam 5): the layer's weights by HF name
    (the fused q | k | v | b | f_a | g_a projection whole, f_b and g_b, o_proj, the small
    ones), `Backbone.kda` from its modules, its caches (`kda_caches`) and the placement of
    the step's GDN metadata (`kda_placement`, derived once for the step's KDA layers, None
    for a prefill). The runtime's sublayer (`sublayers.kda_attention`, the Triton
    interpreter) on a uniform verify and a plain decode (padded, as a graph's step), with
    f_b and g_b as GEMMs (`fused`: two, or one two-block launch) and inside the core
    (`fused_gates`), equals the reference
    step (`kda_decode_ref`) over the checkpoint's weights; no forward of vLLM's is
    shadowed."""
    import torch.nn.functional as F
    from test_metadata import _gdn
    from vllm.config import set_current_vllm_config

    import glm5_vllm.backbone as backbone_module
    from glm5_kernels.gemm import Projection
    from glm5_kernels.kda import KdaDecode, kda_decode_ref
    from glm5_runtime.reference.backbone import ReferenceBackbone
    from glm5_runtime.sublayers import kda_attention
    from glm5_vllm.backbone import VllmStep

    model, vllm_config, reference, sd = built
    b = _backbone(built)
    ours = ReferenceBackbone(reference).kda
    assert (b.kda.lower_bound, b.kda.eps) == (ours.lower_bound, ours.eps)  # -5, 1e-5
    i, g = 1, reference.g
    p = f"layers.{i}.self_attn"
    names = ("conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log", "o_norm.weight",
             "forget_gate.f_b_proj.weight", "g_b_proj.weight", "o_proj.weight")  # fmt: skip
    w = {n: b.weight(0, f"{p}.{n}") for n in names}
    for n, t in w.items():
        assert torch.equal(t, sd[f"{p}.{n}"].to(t.dtype)), n
    parts = ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_a_proj", "g_a_proj")
    in_proj = b.weight(0, f"{p}.in_proj_qkvbfg_a.weight")  # vLLM's fused weight, whole
    assert torch.equal(in_proj, torch.cat([sd[f"{p}.{n}.weight"] for n in parts]).to(in_proj.dtype))
    small = dict(conv_weight=w["conv1d.weight"][:, 0], dt_bias=w["forget_gate.dt_bias"],
                 A_log=w["forget_gate.A_log"], norm_weight=w["o_norm.weight"])  # fmt: skip
    constants = dict(lower_bound=b.kda.lower_bound, eps=b.kda.eps, max_tokens=4)
    f_b, g_b = w["forget_gate.f_b_proj.weight"], w["g_b_proj.weight"]
    ops = {"in_proj_qkvbfg_a.weight": Projection(in_proj), "o_proj.weight":
           Projection(w["o_proj.weight"])}  # fmt: skip
    fused = ops | {"kda": KdaDecode(**small, **constants),
                   "forget_gate.f_b_proj.weight": Projection(f_b),
                   "g_b_proj.weight": Projection(g_b)}  # fmt: skip
    gated = ops | {"kda": KdaDecode(**small, **constants, f_b=f_b, g_b=g_b)}
    blocked = ops | {"kda": KdaDecode(**small, **constants),  # f_b and g_b in one launch
                     "f_b_g_b_proj": Projection(torch.cat([f_b, g_b]), blocks=2)}  # fmt: skip
    attn = model.model.layers[i].self_attn
    h, k, width = g.linear_num_heads, g.linear_head_dim, g.linear_conv_kernel_dim
    gen = torch.Generator().manual_seed(5)
    slots, q = 9, 3
    conv = torch.randn(slots, width - 2 + q, 3 * h * k, generator=gen).bfloat16()
    rec = 0.1 * torch.randn(slots, h, k, k, generator=gen)
    verify = _gdn(spec=2, q=q)
    verify.spec_state_indices_tensor = torch.tensor([[4, 7, 2], [8, 1, 5]], dtype=torch.int32)
    verify.num_accepted_tokens = torch.tensor([2, 3], dtype=torch.int32)
    decode = _gdn(decodes=3)
    decode.non_spec_state_indices_tensor = torch.tensor([6, 3, 1, 0], dtype=torch.int32)
    monkeypatch.setattr(attn, "kv_cache", (conv, rec), raising=False)

    def reference_step(x, place, caches):
        """The checkpoint's projections, kda_decode_ref, o_proj: the sublayer's equal."""
        lin = lambda t, n: F.linear(t, sd[f"{p}.{n}.weight"].to(t.dtype))  # noqa: E731
        r, t = place.write_slots.shape
        rows = [lin(x, "q_proj"), lin(x, "k_proj"), lin(x, "v_proj")]
        f = lin(lin(x, "forget_gate.f_a_proj"), "forget_gate.f_b_proj")
        gate = lin(lin(x, "g_a_proj"), "g_b_proj")
        x3 = [torch.cat(rows, -1), f, lin(x, "b_proj"), gate]
        o = kda_decode_ref(*(y.view(r, t, -1) for y in x3), *caches, **small, **place.kwargs(),
                           lower_bound=b.kda.lower_bound, eps=b.kda.eps)  # fmt: skip
        return lin(o.reshape(r * t, -1), "o_proj")

    def step(mds, rows):  # what glm5_vllm.models builds once a forward
        return VllmStep(torch.zeros(rows, dtype=torch.long), None, mds)

    with set_current_vllm_config(vllm_config), torch.no_grad():
        assert tuple(b.kda_caches(0, i)) == (conv, rec)
        for md, padding in ((verify, 0), (decode, 1)):  # the decode padded to 4 rows
            n = md.num_actual_tokens
            x = torch.randn(n + padding, g.hidden_size, generator=gen).bfloat16()
            place = b.kda_placement(step({attn.prefix: md}, n + padding), i)
            start = (conv.clone(), rec.clone())
            for kind, sublayer in (("fused", fused), ("fused_gates", gated),
                                   ("fused, two-block gates", blocked)):  # fmt: skip
                conv.copy_(start[0])
                rec.copy_(start[1])
                caches = (conv.clone(), rec.clone())
                want = reference_step(x[:n], place, caches)
                got = kda_attention(x, sublayer, *b.kda_caches(0, i), place)
                assert got.shape[0] == n + padding and got.isfinite().all()
                assert _rel(got[:n], want) < 2**-7, (kind, md.num_spec_decodes)
                assert _rel(conv, caches[0]) < 2**-8 and _rel(rec, caches[1]) < 2**-8, kind
        assert "forward" not in vars(attn)  # nothing of vLLM's shadowed
        # The step's placement is derived once for all its KDA layers (one metadata object),
        # again for the next step; a prefill has none (the sublayer runs vLLM's forward).
        j = 2
        second = model.model.layers[j].self_attn
        assert model.model.layers[j].layer_kind == "kda"
        placed = []
        real = backbone_module.kda_placement
        monkeypatch.setattr(backbone_module, "kda_placement",
                            lambda md: placed.append(md) or real(md))  # fmt: skip
        shared = step({attn.prefix: decode, second.prefix: decode}, 4)
        first = b.kda_placement(shared, i)
        assert first is not None and b.kda_placement(shared, j) is first
        assert placed == [decode]
        assert b.kda_placement(step({attn.prefix: decode}, 4), i) is not first
        assert placed == [decode, decode]
        prefill = _gdn(prefills=1, prefill_tokens=2)
        assert b.kda_placement(step({attn.prefix: prefill}, 2), i) is None
        assert b.kda_placement(step({}, 2), i) is None  # outside a forward context


def test_mla_sublayer_reads_vllms_caches_at_the_placement_of_its_metadata(built, monkeypatch):
    """The MLA sublayer's translation (seam 5): `Backbone.mla` and `Backbone.indexer` from
    vLLM's MLA layers and their indexers (the reference's constants); `mla_caches` the
    tensors vLLM binds (latent pages, pool pages, tail ring), None where the pages hold
    other blocks than the indexer's; `mla_placement` from real sparse-MLA and indexer
    metadata and the forward context's slot mapping — a uniform verify of two live requests
    and a padding one (its ring slot -1: ring row -1, which writes nothing), rows past the
    step's (vLLM's padded rows) cut — derived once for the layers sharing the step's
    metadata, afresh for the next step; None for a step with a prefill, padded requests,
    non-uniform decodes, a latent block size that is not the cache's, or no metadata (no
    forward context); where vLLM skips the indexer (`skip_topk`), the top-k buffer's rows as
    the step's selection. The numerics through these: test_planned_step.py."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata
    from vllm.v1.attention.backends.mla.indexer import (
        DeepSeekV32IndexerDecodeMetadata,
        DeepseekV32IndexerMetadata,
    )

    from glm5_runtime.protocol import Indexer
    from glm5_runtime.reference.backbone import ReferenceBackbone
    from glm5_vllm.backbone import VllmStep

    model, _, reference, _ = built
    g = reference.g
    h, hd, kp, topk = g.index_n_heads, g.index_head_dim, g.index_kpool, g.index_topk
    bs, blocks, ring, r, t = 16, 12, 8, 3, 3
    n = r * t
    gen = torch.Generator().manual_seed(8)
    mla = [i for i in range(g.num_hidden_layers) if g.is_mla(i)]
    attns = [model.model.layers[i].self_attn for i in mla]
    latent = torch.randn(blocks, bs, g.kv_lora_rank, generator=gen).bfloat16()
    pages = torch.zeros(blocks, bs // kp, hd + 4, dtype=torch.uint8)
    tail = torch.randn(6, 2, ring, hd, generator=gen).bfloat16()
    for a in attns:  # bound caches, as vLLM binds them before capture
        monkeypatch.setattr(a.mla_attn.mla_attn, "kv_cache", latent, raising=False)
        monkeypatch.setattr(a.indexer.k_cache, "kv_cache", pages, raising=False)
        monkeypatch.setattr(a.indexer.tail_cache, "kv_cache", tail, raising=False)
    b = _backbone(built)
    assert b.mla == ReferenceBackbone(reference).mla and b.mla.norm_eps == g.rms_norm_eps
    max_pools = attns[0].indexer.max_pool_len
    assert b.indexer == Indexer(h, hd, kp, topk, True, max_pools, bs, key_norm_eps=1e-6)
    i = mla[0]
    caches = b.mla_caches(0, i)
    assert (caches.latent, caches.pools, caches.ring) == (latent, pages, tail)
    assert caches.selected is attns[0].indexer.topk_indices_buffer  # the drafter reads it
    # A verify of 3 tokens for two live requests and a padding one (no ring: slot -1), and
    # a padded row past them.
    last = torch.tensor([39, 27, 4])
    positions = (last[:, None] - t + 1 + torch.arange(t)).reshape(-1)
    padded = torch.cat([positions, positions[:1]])
    table = torch.tensor([[3, 7, 1], [5, 2, 9], [0, 0, 0]]).int()
    pool_table = torch.tensor([[4, 8, 2], [6, 3, 10], [0, 0, 0]]).int()
    tail_rows = torch.tensor([2, 4, -1])
    tail_slots = torch.where(tail_rows[:, None] >= 0, tail_rows[:, None] * ring
                             + positions.view(r, t) % ring, -1).reshape(-1)  # fmt: skip
    latent_slots = torch.cat([(table[:, :1].long() * bs + positions.view(r, t) % bs)
                              .reshape(-1), torch.tensor([-1])])  # fmt: skip
    request = torch.arange(r).repeat_interleave(t).int()

    def metadata(prefills=0, padding=False, uniform=True, block_size=bs):
        decode = DeepSeekV32IndexerDecodeMetadata(
            block_table=pool_table, seq_lens=(last + 1).int(), decode_lens=torch.full((r,), t),
            requires_padding=padding, schedule_metadata=torch.empty(0),
        )  # fmt: skip
        decode.decode_is_uniform = uniform
        counts = dict(num_decodes=r - prefills, num_decode_tokens=n - t * prefills,
                      num_prefills=prefills)  # fmt: skip
        common = dict(seq_lens=(last + 1).int(), max_seq_len=int(last.max()) + 1,
                      num_prefill_tokens=t * prefills, **counts)  # fmt: skip
        md = FlashMLASparseMetadata(
            num_reqs=r, max_query_len=t, max_seq_len=int(last.max()) + 1, num_actual_tokens=n,
            query_start_loc=torch.arange(0, n + 1, t).int(), slot_mapping=latent_slots,
            block_table=table, req_id_per_token=request, block_size=block_size, **counts,
        )  # fmt: skip
        pools = DeepseekV32IndexerMetadata(
            slot_mapping=torch.zeros(n, dtype=torch.int64), decode=decode, **common
        )
        ring_md = DeepseekV32IndexerMetadata(slot_mapping=tail_slots, **common)
        by_layer = {}  # one object a kind for every layer, as vLLM's builders share them
        for a in attns:
            by_layer[a.mla_attn.mla_attn.layer_name] = md
            by_layer[a.indexer.k_cache.prefix] = pools
            by_layer[a.indexer.tail_cache.prefix] = ring_md
        slots = {a.mla_attn.mla_attn.layer_name: latent_slots for a in attns}
        return VllmStep(padded, None, by_layer, slots)

    step = metadata()
    place = b.mla_placement(step, i)
    assert torch.equal(place.slots, latent_slots[:n]) and place.slots.dtype == torch.int64
    assert torch.equal(place.block_table, table) and torch.equal(place.request, request)
    assert torch.equal(place.positions, positions.view(r, t))
    assert torch.equal(place.pool_table, pool_table)
    assert place.tail_rows.tolist() == [2, 4, -1]  # the padding request: no ring row
    # Once a step for the layers sharing its metadata; afresh for the next step.
    assert all(b.mla_placement(step, j) is place for j in mla)
    again = b.mla_placement(metadata(), i)
    assert again is not place and torch.equal(again.tail_rows, place.tail_rows)
    # Steps the stage does not serve: vLLM's module runs.
    assert b.mla_placement(metadata(prefills=1), i) is None
    assert b.mla_placement(metadata(padding=True), i) is None
    assert b.mla_placement(metadata(uniform=False), i) is None
    assert b.mla_placement(metadata(block_size=2 * bs), i) is None
    assert b.mla_placement(VllmStep(padded, None), i) is None  # outside a forward context
    # vLLM skips the layer's indexer (its MTP drafter after step 0): the placement carries
    # the buffer's rows step 0 left (compacted), which the layer attends; the buffer as it was.
    buffer = attns[0].indexer.topk_indices_buffer
    before = buffer.clone()
    monkeypatch.setattr(attns[0].mla_attn, "skip_topk", True)
    reused = b.mla_placement(metadata(), i)
    width = topk + kp - 1
    assert reused.selection.data_ptr() == buffer.data_ptr()
    assert reused.selection.shape == (n, width) and torch.equal(reused.slots, place.slots)
    assert torch.equal(buffer, before)
    # Pool pages of other blocks than the indexer's: not the stage's caches.
    monkeypatch.setattr(attns[0].indexer.k_cache, "kv_cache", pages[:, :1], raising=False)
    assert b.mla_caches(0, i) is None


def test_model_binds_the_specialized_decode_and_runs_stock_when_unplanned(built, monkeypatch):
    from vllm.models.glm5next import Glm5NextForCausalLM as Stock

    import glm5_vllm.models as models
    from glm5_policy import DecodeConfig
    from glm5_runtime.decode import SpecializedDecode
    from glm5_runtime.plan import Rows
    from glm5_vllm.backbone import VllmBackbone, VllmStep
    from glm5_vllm.metadata import step_context

    model = built[0]
    policy = {"kda_proj": {"1-64": "gemm"}, "dsa_proj": {"1-64": "split_k"},
              "dsa_attn": {"1-64": "sparse"}}  # fmt: skip
    config = DecodeConfig.build(max_context=64, q=2, capture_sizes=[2, 4], policy=policy)
    model.glm5_decode = config
    decode = models._bind(model, config)
    assert isinstance(decode, SpecializedDecode) and isinstance(decode.backbone, VllmBackbone)
    # The KDA and MLA / indexer projections of every layer are stage ops over views of vLLM's
    # weights; vLLM's fused q_a | kv_a and q | k | v | b | f_a | g_a weights are served
    # whole, one op each (as vLLM runs them: one GEMM, no concatenation of parts), and
    # either kind's o_proj.
    g = built[2].g
    mla = ("fused_qkv_a_proj", "q_b_proj", "o_proj", "indexer.wq_b")
    kda = ("in_proj_qkvbfg_a", "o_proj")
    routed = {name for _, name, _ in decode.routes[2]}
    assert routed == {
        f"layers.{i}.self_attn.{p}.weight"
        for i in range(g.num_hidden_layers)
        for p in (mla if g.is_mla(i) else kda)
    }  # `dsa_attn` alone builds nothing: the MLA sublayer needs the indexer's stages too
    layer5 = model.model.layers[5].self_attn
    ops = {name: op for _, name, op in decode.routes[2]}
    assert ops["layers.5.self_attn.in_proj_qkvbfg_a.weight"].weight.data_ptr() == (
        layer5.in_proj_qkvbfg_a.weight.data_ptr()
    )  # the whole fused weight, not a copy
    decode.prepare()
    # Installed for a planned 2-token step, the Triton stage ops (the interpreter, here)
    # serve vLLM's fused projections; uninstalled, vLLM's own GEMMs again.
    x = torch.randn(2, b_hidden(model), generator=torch.Generator().manual_seed(2)).bfloat16()
    layers = model.model.layers
    for fused in (layers[5].self_attn.in_proj_qkvbfg_a, layers[3].self_attn.fused_qkv_a_proj):
        with torch.no_grad():
            stock = fused(x)[0]
            with decode.installed(2):
                assert "forward" in vars(fused)
                routed_out = fused(x)[0]
            assert "forward" not in vars(fused)
        assert _rel(routed_out, stock) < 2**-8  # BF16 output rounding of another summation
    calls = []
    monkeypatch.setattr(Stock, "forward", lambda self, *a, **k: calls.append(a) or "stock")
    model.glm5_specialized, model._glm5_prepared = decode, True
    ids, positions = torch.zeros(4, dtype=torch.long), torch.arange(4)
    assert model.forward(ids, positions) == "stock"  # eager, no forward context: stock
    assert len(calls) == 1 and calls[0][0] is ids
    # A FULL-graph capture of two 2-token verifies is planned.
    verify = Rows(spec_decodes=2, spec_decode_tokens=4, spec_state_rows=2)
    context = step_context(4)
    context = type(context)(4, True, "FULL", rows={"layers.0.self_attn": verify})
    plan = decode.plan(VllmStep(positions, context), capturing=True)
    assert plan.step is not None and (plan.step.q, plan.step.tokens) == (2, 4), plan.reason
    piecewise = type(context)(4, True, "PIECEWISE", rows={"layers.0.self_attn": verify})
    assert decode.plan(VllmStep(positions, piecewise), True, "PIECEWISE").step is None
    model.glm5_specialized = None


def test_hooks_take_input_embeddings_and_the_multimodal_wrapper_delegates(built, monkeypatch):
    """A multimodal wrapper hands input embeddings (and M-RoPE positions [3, T]); vLLM's
    wrapper calls the language model's inner `model`, ours its hooked forward."""
    from torch import nn
    from vllm.models.glm5next import Glm5NextForCausalLM as Stock
    from vllm.models.glm5next import Glm5NextForConditionalGeneration as StockWrapper

    import glm5_vllm.models as models
    from glm5_policy import DecodeConfig

    model = built[0]
    config = DecodeConfig.build(max_context=64, q=1, capture_sizes=[4], policy={})
    decode = models._bind(model, config)
    model.glm5_specialized, model._glm5_prepared = decode, True
    calls = []
    monkeypatch.setattr(Stock, "forward", lambda self, *a, **k: calls.append(a) or "stock")
    monkeypatch.setattr(StockWrapper, "forward", lambda self, *a, **k: "vllm's wrapper")
    embeds = torch.zeros(4, b_hidden(model), dtype=torch.bfloat16)
    positions = torch.arange(4).expand(3, 4)
    assert model.forward(None, positions, None, embeds) == "stock"  # eager: stock
    assert calls[-1][0] is None and calls[-1][3] is embeds
    wrapper = models.Glm5NextForConditionalGeneration.__new__(
        models.Glm5NextForConditionalGeneration
    )
    nn.Module.__init__(wrapper)
    wrapper.language_model = model
    assert wrapper.forward(None, positions, None, embeds) == "stock"  # through our hooks
    assert calls[-1][3] is embeds and len(calls) == 2
    model.glm5_specialized = None  # unbound: vLLM's wrapper forward, untouched
    assert wrapper.forward(None, positions, None, embeds) == "vllm's wrapper"
