"""The plugin binds to the weights vLLM runs (issue 20), over a real tiny vLLM 0.33 model on CPU.

- binding order: the model binds in vLLM's model-level post-load hook, which vLLM's own
  `process_weights_after_loading` calls after every module's quant method rewrote its
  weights; `load_weights` alone binds nothing; the stages hold the rewritten tensors;
- block-FP8 MLPs (vLLM's Fp8LinearMethod under its DeepGEMM kernel) after vLLM's real
  UE8M0 re-quantization (`requant_weight_ue8m0_inplace`, pure torch) are served and equal
  the FP8 reference over the re-quantized tensors;
- layouts CPU cannot produce (SM100 packed int32 scales, Marlin, transposed weights and
  scales, FlashInfer's [up; gate] and TRT-LLM shuffles) are fabricated as the state vLLM
  leaves and refused: one warning per layout naming backend and modules, vLLM's op runs.
"""

import logging
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def built(tmp_path_factory, cpu_linears):
    from tiny_model import build

    return build(tmp_path_factory.mktemp("glm5-vllm-layouts"))


def _config(policy):
    from glm5_policy import DecodeConfig

    return DecodeConfig.build(max_context=64, q=1, capture_sizes=[2], policy=policy)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_binds_after_vllms_post_processing_not_in_load_weights(built):
    """vLLM's loader order (base_loader.py): load_weights, then process_weights_after_loading
    (quant methods, attention, then the model's hook). A quant method that swaps in a fresh
    parameter, as DeepGEMM's does, must be what the stage reads."""
    from tiny_model import checkpoint, process
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    import glm5_vllm.models as models

    model, vllm_config, _, sd = built
    target = model.model.layers[5].self_attn.in_proj_qkvbfg_a
    events, original = [], UnquantizedLinearMethod.process_weights_after_loading
    bind = models._bind

    def rewrite(self, layer):
        original(self, layer)
        if layer is target:  # a fresh tensor, as replace_parameter rebinds a new layout
            layer.weight.data = layer.weight.data.clone()
            events.append("rewrote")

    def binding(*a, **k):
        events.append("bind")
        return bind(*a, **k)

    model.glm5_decode = _config({"kda_proj": "gemm"})
    try:
        with (
            mock.patch.object(UnquantizedLinearMethod, "process_weights_after_loading", rewrite),
            mock.patch.object(models, "_bind", binding),
        ):
            model.load_weights(iter(checkpoint(sd).items()))
            assert model.glm5_specialized is None and events == []  # not bound at load
            before = target.weight.data_ptr()
            process(model, vllm_config)  # vLLM's own process_weights_after_loading
        assert events == ["rewrote", "bind"]
        decode = model.glm5_specialized
        assert decode is not None and not model._glm5_prepared
        ops = {name: op for _, name, op in decode.routes[2]}
        held = ops["layers.5.self_attn.in_proj_qkvbfg_a.weight"].weight
        assert held.data_ptr() == target.weight.data_ptr() and held.data_ptr() != before
    finally:
        model.glm5_decode = model.glm5_specialized = None


def test_the_multimodal_wrapper_binds_its_language_model_from_its_own_hook():
    """vLLM calls the model-level hook on the model it loaded only (the wrapper)."""
    from torch import nn

    import glm5_vllm.models as models

    wrapper = models.Glm5NextForConditionalGeneration.__new__(
        models.Glm5NextForConditionalGeneration
    )
    nn.Module.__init__(wrapper)
    wrapper.language_model = mock.Mock()
    wrapper.process_weights_after_loading()
    wrapper.language_model.process_weights_after_loading.assert_called_once_with()


@pytest.fixture
def fp8_mlps(built):
    """The tiny model's dense MLPs rebuilt block-FP8 (vLLM's Fp8LinearMethod; its DeepGEMM
    kernel, as on SM90 / SM100, since CPU kernels need AMX) from the reference's FP8
    checkpoint, processed as vLLM does: the kernel's own post-processing, then DeepGEMM's
    UE8M0 re-quantization (`requant_weight_ue8m0_inplace`, vLLM's pure-torch function)
    in place. Yields {layer: mlp}; the BF16 MLPs are put back afterwards."""
    import vllm.model_executor.kernels.linear as kernels
    from tiny_model import tiny_geometry
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel,
    )
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        requant_weight_ue8m0_inplace,
    )
    from vllm.models.glm5next.common.model import Glm5NextMLP

    from glm5_runtime.reference.weights import random_state_dict

    model, vllm_config, reference, _ = built
    g = reference.g
    fp8 = random_state_dict(tiny_geometry(), seed=3)
    quant = Fp8Config(
        is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
        weight_block_size=[128, 128],
    )  # fmt: skip
    dense = [i for i, t in enumerate(g.mlp_layer_types) if t == "dense"]
    stock, mlps = {}, {}
    choose = mock.patch.object(
        kernels, "choose_scaled_mm_linear_kernel", lambda *a, **k: DeepGemmFp8BlockScaledMMKernel
    )
    default = torch.get_default_dtype()
    with set_current_vllm_config(vllm_config), choose:
        torch.set_default_dtype(torch.bfloat16)
        try:
            for i in dense:
                mlps[i] = Glm5NextMLP(
                    g.hidden_size, g.intermediate_size, "silu", quant_config=quant,
                    prefix=f"model.layers.{i}.mlp", swiglu_limit=g.swiglu_limit,
                )  # fmt: skip
        finally:
            torch.set_default_dtype(default)
    for i, mlp in mlps.items():
        p = f"layers.{i}.mlp"
        up = (fp8[f"{p}.gate_proj.weight"], fp8[f"{p}.up_proj.weight"])
        s_up = (fp8[f"{p}.gate_proj.weight_scale_inv"], fp8[f"{p}.up_proj.weight_scale_inv"])
        mlp.gate_up_proj.weight.data.copy_(torch.cat(up))
        mlp.gate_up_proj.weight_scale_inv.data.copy_(torch.cat(s_up))
        mlp.down_proj.weight.data.copy_(fp8[f"{p}.down_proj.weight"])
        mlp.down_proj.weight_scale_inv.data.copy_(fp8[f"{p}.down_proj.weight_scale_inv"])
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.quant_method.process_weights_after_loading(linear)
            requant_weight_ue8m0_inplace(linear.weight.data, linear.weight_scale_inv.data)
        stock[i], model.model.layers[i].mlp = model.model.layers[i].mlp, mlp
    yield mlps
    for i, mlp in stock.items():
        model.model.layers[i].mlp = mlp


def test_ue8m0_requantized_block_fp8_mlps_are_served(built, fp8_mlps, caplog):
    import glm5_vllm.models as models
    from glm5_kernels.gemm import fp8_mlp_ref
    from glm5_vllm.layouts import linear_layout

    model = built[0]
    for mlp in fp8_mlps.values():
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            layout = linear_layout(linear)
            assert layout.served and "DeepGemmFp8BlockScaledMMKernel" in layout.backend
            s = linear.weight_scale_inv.data
            assert s.dtype == torch.float32 and torch.equal(s, 2.0 ** s.log2().round())  # UE8M0
    with caplog.at_level(logging.WARNING, logger="glm5_vllm"):
        decode = models._bind(model, _config({"dense_mlp": "gemv"}))
    assert not [w for w in _warnings(caplog) if "dense_mlp" in w or "no stage reads" in w]
    routed = {name for _, name, _ in decode.routes[2]}
    assert {f"layers.{i}.mlp" for i in fp8_mlps} <= routed
    decode.prepare()
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    x = x.bfloat16()
    for i, mlp in fp8_mlps.items():
        up, down = mlp.gate_up_proj, mlp.down_proj
        # vLLM's FP8 GEMMs need a GPU (or AMX); the FP8 reference is their math, over the
        # tensors vLLM holds now, after the re-quantization.
        want = fp8_mlp_ref(
            x, up.weight, up.weight_scale_inv, down.weight, down.weight_scale_inv,
            model.config.swiglu_limit, decode.backbone.ue8m0,
        )  # fmt: skip
        layer = next(each for each in decode.layers if each.index == i)
        with torch.no_grad(), decode.installed(2):
            got = decode.mlp(layer, x)  # the layer loop's call: the stage, not vLLM's block
        assert "forward" not in vars(mlp)
        assert _rel(got, want) < 2**-7


def _packed_scales(n, k):
    """DeepGEMM's SM100 scale layout: int32 (N, ceil(K/512)), four UE8M0 exponents per word,
    MN-major with stride (1, round_up(N, 4))."""
    return torch.empty_strided((n, -(-k // 512)), (1, -(-n // 4) * 4), dtype=torch.int32)


def test_sm100_packed_scales_are_refused_with_one_warning(built, fp8_mlps, caplog):
    from vllm.model_executor.utils import replace_parameter

    import glm5_vllm.models as models

    model = built[0]
    for mlp in fp8_mlps.values():
        n, k = mlp.gate_up_proj.weight.shape
        replace_parameter(mlp.gate_up_proj, "weight_scale_inv", _packed_scales(n, k))
    with caplog.at_level(logging.WARNING, logger="glm5_vllm"):
        decode = models._bind(model, _config({"dense_mlp": "gemv"}))
    refused = [w for w in _warnings(caplog) if "no stage reads" in w]
    assert len(refused) == 1, refused
    assert "packed int32" in refused[0] and "DeepGemmFp8BlockScaledMMKernel" in refused[0]
    assert "model.layers.0.mlp.gate_up_proj" in refused[0]
    assert not {f"layers.{i}.mlp" for i in fp8_mlps} & {n for _, n, _ in decode.routes[2]}


@pytest.mark.parametrize(
    "case", ["marlin", "other_kernel", "transposed_scales", "transposed_weight", "e8m0_block"]
)
def test_block_fp8_layouts_not_identified_are_refused(fp8_mlps, case):
    """Each case keeps every shape a served layout has; only the kernel or strides differ."""
    from vllm.model_executor.utils import replace_parameter

    from glm5_vllm.layouts import linear_layout

    linear = fp8_mlps[0].down_proj
    method = linear.quant_method
    assert linear_layout(linear).served
    if case == "marlin":
        method.use_marlin = True
    elif case == "other_kernel":
        method.fp8_linear = object()  # a kernel not known to keep the checkpoint layout
    elif case == "transposed_scales":  # [2, 2] blocks: the served shape, column-major
        w = torch.zeros(256, 256).to(torch.float8_e4m3fn)
        replace_parameter(linear, "weight", w)
        replace_parameter(linear, "weight_scale_inv", torch.empty_strided((2, 2), (1, 2)))
    elif case == "transposed_weight":  # a weight.t() view of [K, N] storage, as CUTLASS's
        replace_parameter(linear, "weight", linear.weight.data.t().contiguous().t())
    else:  # a block size other than 128 x 128
        method.weight_block_size = [64, 64]
    assert not linear_layout(linear).served, case


def test_bf16_layouts(built):
    from torch import nn

    from glm5_vllm.layouts import linear_layout

    model = built[0]
    gate = model.model.layers[3].mlp.gate
    assert linear_layout(gate).served  # the router, BF16 [E, H]
    assert linear_layout(model.lm_head).served
    assert linear_layout(nn.Linear(8, 4, dtype=torch.bfloat16)).served  # the MTP eh_proj
    assert not linear_layout(nn.Linear(8, 4)).served  # FP32: the router kernels read BF16
    w = gate.weight.data
    gate.weight.data = w.t().contiguous().t()  # a transposed weight: same shape, strides not
    try:
        assert not linear_layout(gate).served
    finally:
        gate.weight.data = w


def test_refused_router_runs_stock_with_one_warning(built, caplog):
    """The router's weight in a layout no stage reads: the stage stays off, vLLM's gate runs."""
    import glm5_vllm.models as models

    model = built[0]
    gates = [layer.mlp.gate for layer in model.model.layers if layer._mlp_is_moe]
    methods = [g.quant_method for g in gates]
    for g in gates:
        g.quant_method = object()  # a quantization no stage reads
    try:
        with caplog.at_level(logging.WARNING, logger="glm5_vllm"):
            decode = models._bind(model, _config({"router": "split_k"}))
    finally:
        for g, m in zip(gates, methods, strict=True):
            g.quant_method = m
    refused = [w for w in _warnings(caplog) if "no stage reads" in w]
    assert len(refused) == 1 and "model.layers.2.mlp.gate" in refused[0], refused
    assert not any(n.endswith("mlp.gate.weight") for _, n, _ in decode.routes[2])


def _experts(backend, w13, w2, s13=None, s2=None):
    """A module carrying what vLLM's FusedMoE holds after processing under `backend`
    (vLLM's own method class and backend enum; the method not built, its GPU kernel absent)."""
    from torch import nn
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    experts = nn.Module()
    experts.quant_method = Fp8MoEMethod.__new__(Fp8MoEMethod)
    experts.quant_method.fp8_backend = Fp8MoeBackend[backend]
    experts.w13_weight, experts.w2_weight = nn.Parameter(w13, False), nn.Parameter(w2, False)
    if s13 is not None:
        experts.w13_weight_scale_inv = nn.Parameter(s13, False)
        experts.w2_weight_scale_inv = nn.Parameter(s2, False)
    return experts


def test_expert_row_order_comes_from_the_backend_never_the_shape():
    """[gate; up] (Triton) and [up; gate] (FlashInfer CUTLASS, vLLM's own swap) share every
    shape and dtype: only the backend tells them apart."""
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31

    from glm5_vllm.layouts import expert_layout

    e, i, h = 4, 256, 128
    w13 = torch.randn(e, 2 * i, h).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, h, i).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(e, 2 * i // 128, h // 128), torch.rand(e, h // 128, i // 128)
    served = expert_layout(_experts("TRITON", w13, w2, s13, s2))
    assert served.served and "[gate; up]" in served.name
    w31, s31 = swap_w13_to_w31(w13.view(torch.uint8)).view(w13.dtype), swap_w13_to_w31(s13)
    assert w31.shape == w13.shape and s31.shape == s13.shape
    swapped = expert_layout(_experts("FLASHINFER_CUTLASS", w31, w2, s31, s2))
    assert not swapped.served and "[up; gate]" in swapped.name
    assert "FLASHINFER_CUTLASS" in str(swapped)
    # The TRT-LLM block shuffle: 4-D (E, H/128, 2I, 128) / (E, I/128, H, 128).
    shuffled = _experts(
        "FLASHINFER_TRTLLM", w31.view(torch.uint8).view(e, 2 * i, h // 128, 128).transpose(1, 2),
        w2.view(torch.uint8).view(e, h, i // 128, 128).transpose(1, 2),
    )  # fmt: skip
    assert not expert_layout(shuffled).served
    packed = torch.empty_strided((e, 2 * i, 1), (2 * i, 1, 2 * i), dtype=torch.int32)
    deepgemm = expert_layout(_experts("DEEPGEMM", w13, w2, packed, s2))
    assert not deepgemm.served and "packed int32" in deepgemm.name
    assert not expert_layout(_experts("MARLIN", w13, w2, s13, s2)).served


def test_the_tiny_models_real_experts_are_identified_by_their_backend(built):
    """vLLM's own FusedMoE on CPU: its CPU backend's layout is none the MoE stage reads."""
    from glm5_vllm.layouts import expert_layout

    experts = built[0].model.layers[2].mlp.experts
    layout = expert_layout(experts)
    assert not layout.served and layout.backend == "UnquantizedFusedMoEMethod, CPU", layout
