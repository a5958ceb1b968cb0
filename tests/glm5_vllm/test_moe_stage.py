"""The MoE stage over vLLM's own MoE blocks (issue 16), on a real tiny vLLM 0.33 model on CPU.

Every MoE layer's `Glm5NextMoE` is rebuilt block-FP8 (vLLM's Fp8Config, its FusedMoE under
the Triton backend as on an SM90 GPU without expert parallelism; the shared expert's linears
under DeepGEMM, as in test_layouts.py) from the reference's FP8 checkpoint, and processed by
vLLM's own `process_weights_after_loading` (the Triton experts' kernel object, GPU-only, not
built). The stage then reads w13 / w2 and their block scales where vLLM left them, routes the
whole block, and equals the FP8 reference over those tensors; a backend whose layout it cannot
read, or a routing that is not GLM's, leaves every block to vLLM with one warning."""

import logging
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def built(tmp_path_factory, cpu_linears):
    from tiny_model import build

    return build(tmp_path_factory.mktemp("glm5-vllm-moe"))


@pytest.fixture
def fp8_blocks(built):
    """{layer: vLLM's block-FP8 Glm5NextMoE} in place of the tiny model's BF16 blocks."""
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.layers.quantization.fp8 as fp8_method
    from tiny_model import tiny_geometry
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.models.glm5next.common.model import Glm5NextMoE

    from glm5_runtime.reference.weights import random_state_dict

    model, vllm_config, _, _ = built
    fp8 = random_state_dict(tiny_geometry(), seed=3)
    quant = fp8_method.Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
        weight_block_size=[128, 128],
    )  # fmt: skip
    patches = [
        mock.patch.object(
            kernels, "choose_scaled_mm_linear_kernel",
            lambda *a, **k: DeepGemmFp8BlockScaledMMKernel,
        ),
        mock.patch.object(
            fp8_method, "select_fp8_moe_backend", lambda **k: (Fp8MoeBackend.TRITON, object)
        ),
        mock.patch.object(fp8_method.Fp8MoEMethod, "_init_moe_kernel", lambda self, layer: None),
    ]  # fmt: skip
    layers = [i for i, layer in enumerate(model.model.layers) if layer._mlp_is_moe]
    stock, blocks = {}, {}
    # vLLM registers each MoE block's experts by name; the stock blocks' entries step aside.
    context = vllm_config.compilation_config.static_forward_context
    held = {k: context.pop(k) for k in list(context) if k.endswith(".mlp.experts")}
    default = torch.get_default_dtype()
    with set_current_vllm_config(vllm_config), patches[0], patches[1], patches[2]:
        torch.set_default_dtype(torch.bfloat16)
        try:
            for i in layers:
                blocks[i] = Glm5NextMoE(
                    model.config, vllm_config.parallel_config, quant_config=quant,
                    prefix=f"model.layers.{i}.mlp",
                )  # fmt: skip
        finally:
            torch.set_default_dtype(default)
        for i, block in blocks.items():
            p = f"layers.{i}.mlp"
            block.gate.weight.data.copy_(fp8[f"{p}.gate.weight"])
            block.gate.e_score_correction_bias.data.copy_(fp8[f"{p}.gate.e_score_correction_bias"])
            routed = block.experts.routed_experts
            for vllm_name, name in (("w13", "gate_up_proj"), ("w2", "down_proj")):
                getattr(routed, f"{vllm_name}_weight").data.copy_(fp8[f"{p}.experts.{name}"])
                getattr(routed, f"{vllm_name}_weight_scale_inv").data.copy_(
                    fp8[f"{p}.experts.{name}_scale_inv"]
                )
            se, sp = block.shared_experts, f"{p}.shared_experts"
            up = [
                fp8[f"{sp}.{n}_proj.weight{s}"] for s in ("", "_scale_inv") for n in ("gate", "up")
            ]
            se.gate_up_proj.weight.data.copy_(torch.cat(up[:2]))
            se.gate_up_proj.weight_scale_inv.data.copy_(torch.cat(up[2:]))
            se.down_proj.weight.data.copy_(fp8[f"{sp}.down_proj.weight"])
            se.down_proj.weight_scale_inv.data.copy_(fp8[f"{sp}.down_proj.weight_scale_inv"])
            for linear in (se.gate_up_proj, se.down_proj):
                linear.quant_method.process_weights_after_loading(linear)
            routed.quant_method.process_weights_after_loading(routed)
            stock[i], model.model.layers[i].mlp = model.model.layers[i].mlp, block
    yield blocks
    for i, block in stock.items():
        model.model.layers[i].mlp = block
    for k in [k for k in context if k.endswith(".mlp.experts")]:
        del context[k]
    context.update(held)


def _bind(model, policy, caplog):
    import glm5_vllm.models as models
    from glm5_policy import DecodeConfig

    config = DecodeConfig.build(max_context=64, q=1, capture_sizes=[2], policy=policy)
    with caplog.at_level(logging.WARNING):
        decode = models._bind(model, config)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return decode, warned


def test_vllms_fp8_experts_are_served_and_equal_the_reference(built, fp8_blocks, caplog):
    from glm5_kernels.moe import moe_output_ref, moe_rows_ref, route_ref
    from glm5_vllm.layouts import expert_layout

    model = built[0]
    for block in fp8_blocks.values():
        layout = expert_layout(block.experts)
        assert layout.served and "TRITON" in layout.backend, layout
    decode, warned = _bind(model, {"moe": "per_route"}, caplog)
    assert not warned, warned
    assert decode.backbone.routing is not None
    ops = {name: op for _, name, op in decode.routes[2]}
    assert {f"layers.{i}.mlp" for i in fp8_blocks} <= set(ops)
    decode.prepare()
    cfg = model.config
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).bfloat16()
    for i, block in fp8_blocks.items():
        routed, se = block.experts.routed_experts, block.shared_experts
        # The stage reads vLLM's tensors in place: no copy of any expert's weights.
        held = ops[f"layers.{i}.mlp"].experts[2]
        assert held.w13.data_ptr() == routed.w13_weight.data_ptr()
        assert held.w2_scale.data_ptr() == routed.w2_weight_scale_inv.data_ptr()
        layer = next(each for each in decode.layers if each.index == i)
        with torch.no_grad(), decode.installed(2):
            got = decode.mlp(layer, x)  # the layer loop's call: the stage, not vLLM's block
        assert "forward" not in vars(block)  # no forward of vLLM's shadowed
        # vLLM's FP8 MoE needs a GPU; the FP8 reference is its math over the tensors vLLM holds.
        logits = x.float() @ block.gate.weight.float().T
        weights, ids = route_ref(
            logits, block.gate.e_score_correction_bias, cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
        )  # fmt: skip
        shared = (se.gate_up_proj.weight, se.gate_up_proj.weight_scale_inv, se.down_proj.weight,
                  se.down_proj.weight_scale_inv)  # fmt: skip
        rows = moe_rows_ref(
            x, ids, routed.w13_weight, routed.w13_weight_scale_inv, routed.w2_weight,
            routed.w2_weight_scale_inv, shared, cfg.swiglu_limit, decode.backbone.ue8m0,
        )  # fmt: skip
        want = moe_output_ref(rows, weights).double()
        assert (got.double() - want).norm() <= 2**-7 * want.norm()


def test_an_expert_layout_it_cannot_read_leaves_every_block_to_vllm(built, fp8_blocks, caplog):
    """FlashInfer CUTLASS keeps w13 as [up; gate] in the same shapes: refused by backend."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    model = built[0]
    first = next(iter(fp8_blocks))
    method = fp8_blocks[first].experts.routed_experts.quant_method
    method.fp8_backend = Fp8MoeBackend.FLASHINFER_CUTLASS
    decode, warned = _bind(model, {"moe": "per_route"}, caplog)
    refused = [w for w in warned if "no stage reads" in w]
    assert len(refused) == 1 and f"model.layers.{first}.mlp.experts" in refused[0], warned
    assert any("stage moe runs stock" in w for w in warned), warned
    assert not any(type(op).__name__ == "MoeLayer" for _, _, op in decode.routes[2])


def test_routing_other_than_glms_leaves_the_moe_stage_off(built, fp8_blocks, caplog):
    from glm5_vllm.backbone import _routing

    model = built[0]
    blocks = list(fp8_blocks.values())
    assert _routing(model.config, blocks) is not None
    for field, value in (("scoring_func", "softmax"), ("n_group", 8), ("norm_topk_prob", False)):
        with mock.patch.object(model.config, field, value, create=True):
            assert _routing(model.config, blocks) is None, field
    for field, value in (("ep_size", 2), ("enable_eplb", True), ("is_sequence_parallel", True)):
        with mock.patch.object(blocks[0], field, value):  # expert / sequence parallelism
            assert _routing(model.config, blocks) is None, field
