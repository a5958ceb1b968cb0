"""A real vLLM 0.33 Glm5NextForCausalLM built on CPU for a tiny geometry (KDA and MLA + DSA
layers, dense and MoE MLPs), its weights loaded through vLLM's own `load_weights` from the
reference's random checkpoint (renamed to the checkpoint's names, FP8 blocks dequantized:
vLLM's CPU build has no FP8 linear), beside the reference model over the same weights.
`build(..., fp8=True)` loads the FP8 checkpoint itself, as vLLM loads GLM-5.3-Flash's: a
block-FP8 `quantization_config`, MLPs and experts FP8 with their block scales, under GPU
kernels of vLLM's that keep the checkpoint's layouts (`fp8_kernels`: its CPU ones need its
CPU build).

Where vLLM stops on CPU (README): building needs vLLM's CpuPlatform as the current platform
and the checkpoint fields transformers' config lacks; the CPU platform refuses sparse MLA, so
MLA layers get FlashMLA-sparse's backend here, to be built and loaded, never run; KDA attention
needs Triton GPU kernels, so it is not run either."""

from __future__ import annotations

import json
import re
import socket
from contextlib import contextmanager, nullcontext

import torch

from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.weights import dequantized, random_state_dict

HC = re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$")


def tiny_geometry(mtp_layers=0, **changes):
    """Eight layers: KDA, with MLA + DSA at 3, 4 and 7; dense MLPs at 0-2, MoE after; MTP
    layers (MLA + MoE) from 8. Every indexer "full", as in the real checkpoint (vLLM builds
    an indexer in every MLA layer). `changes` override fields (fewer layers, say)."""
    fields = dict(hidden_size=128, moe_intermediate_size=128, num_nextn_predict_layers=mtp_layers,
                  indexer_types=("full",) * 8)  # fmt: skip
    return geometry("tiny", **{**fields, **changes})


def checkpoint(state_dict):
    """The reference's HF-named tensors under the checkpoint's names that vLLM loads (FP8
    ones with their block scales beside, `<weight>_scale_inv`, split per expert as the
    weights: an expert's gate and up rows are whole 128-row blocks)."""
    out = {}
    for name, w in state_dict.items():
        key = name if name.startswith("lm_head") else f"model.{name}"
        key = HC.sub(lambda m: f".hc_{m[1]}_{m[2]}", key)
        key = key.replace(".forget_gate.", ".")
        base, scale = key.removesuffix("_scale_inv"), key.endswith("_scale_inv")
        leaf = "weight_scale_inv" if scale else "weight"
        if key.endswith(".self_attn.conv1d.weight"):
            for part, chunk in zip("qkv", w.chunk(3), strict=True):
                out[key.replace("conv1d", f"{part}_conv1d")] = chunk
        elif base.endswith(".experts.gate_up_proj"):
            for e, gate_up in enumerate(w):
                gate, up = gate_up.chunk(2)
                out[base.replace("gate_up_proj", f"{e}.gate_proj.{leaf}")] = gate
                out[base.replace("gate_up_proj", f"{e}.up_proj.{leaf}")] = up
        elif base.endswith(".experts.down_proj"):
            for e, down in enumerate(w):
                out[base.replace("down_proj", f"{e}.down_proj.{leaf}")] = down
        else:
            out[key] = w
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_platform():
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    class CpuBuildingSparseMla(CpuPlatform):
        """vLLM's CPU platform, except that a sparse-MLA layer gets FlashMLA-sparse's
        backend instead of a refusal: enough to build and load the layer (its attention
        never runs here)."""

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.use_sparse:
                from vllm.v1.attention.backends.registry import AttentionBackendEnum

                return AttentionBackendEnum.FLASHMLA_SPARSE.get_path()
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    # First: modules imported later read the current platform when they load.
    vllm.platforms._current_platform = CpuBuildingSparseMla()


def cpu_config(model_config, **sections):
    """VllmConfig(**sections) on CPU, with prefix caching off unless `cache_config` says.

    Off because vLLM's CPU platform decides it after the model's config hooks: the hybrid
    (KDA + MLA) hook ties `mamba_block_size` to the block size while prefix caching is on,
    then `CpuPlatform.check_and_update_config` turns prefix caching off for MLA models
    without AMX tiles (`torch.cpu._is_amx_tile_supported()`), and `validate_mamba_block_size`
    rejects the pair. Off from the start, the hook keeps `mamba_block_size` at
    max_model_len and both kinds of CPU build the same config."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    sections.setdefault("cache_config", CacheConfig(enable_prefix_caching=False))
    device = DeviceConfig(device="cpu")
    return VllmConfig(model_config=model_config, device_config=device, **sections)


# GLM-5.3-Flash's quantization_config: FP8 e4m3 in 128x128 blocks, activations per token.
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip


def tiny_config(folder, additional_config=None, draft=False, g=None, fp8=False):
    """The VllmConfig of build(), its checkpoint config written to `folder` (geometry `g`,
    default tiny_geometry(); `fp8`: with GLM-5.3-Flash's quantization_config)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    g = g or tiny_geometry(1 if draft else 0)
    config = g.to_hf().to_dict()
    config.update(
        architectures=["Glm5NextForCausalLM"], mhc=True, topk_method="noaux_tc",
        scoring_func="sigmoid", mla_use_nope=True,
        num_nextn_predict_layers=g.num_nextn_predict_layers,
        indexer_rope_interleave=False,
    )  # fmt: skip
    if fp8:
        config["quantization_config"] = FP8_CONFIG
    if draft:
        from transformers import Glm5NextConfig

        config = {**Glm5NextConfig().to_dict(), "text_config": config}
        config["architectures"] = ["Glm5NextForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    speculative = None
    if draft:
        speculative = SpeculativeConfig(
            method="mtp", num_speculative_tokens=1, target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )  # fmt: skip
    return cpu_config(
        model_config, additional_config=additional_config or {}, speculative_config=speculative
    )


def process(model, vllm_config):
    """What vLLM 0.33's loader does after `load_weights` (base_loader.py): its own
    `process_weights_after_loading` — every module's quant method (CPU linears pick their GEMM
    here), the attention layers, then the model-level hook, where the plugin binds. The CPU
    experts' weight prepack is skipped: it needs vLLM's CPU build (`vllm._C`), absent from the
    CUDA wheel, and nothing here runs the routed experts."""
    from unittest import mock

    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with mock.patch.object(CPUUnquantizedExperts, "process_weights_after_loading"):
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))


@contextmanager
def fp8_kernels():
    """While vLLM builds an FP8 model on CPU: its TRITON FP8 MoE backend (TritonExperts, what
    it picks for block-FP8 experts on Hopper at TP; w13 kept in the checkpoint's [gate; up]
    order) and its Triton block-FP8 GEMM for FP8 linears (on its CUDA list; weight and block
    scales kept row-major). vLLM's CPU kernels for both need its CPU build (AMX-FP8,
    `fp8_scaled_mm_cpu`), absent from the CUDA wheel; the kernels chosen only decide the
    layouts vLLM keeps (nothing here runs them: vllm.triton_utils turns Triton into a
    placeholder on a host without a GPU driver)."""
    from unittest import mock

    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.layers.quantization.fp8 as fp8_method
    from vllm.model_executor.kernels.linear.scaled_mm.triton import TritonFp8BlockScaledMMKernel
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    linear = mock.patch.object(kernels, "choose_scaled_mm_linear_kernel",
                               lambda *a, **k: TritonFp8BlockScaledMMKernel)  # fmt: skip
    moe = mock.patch.object(fp8_method, "select_fp8_moe_backend",
                            lambda **k: (Fp8MoeBackend.TRITON, TritonExperts))  # fmt: skip
    with linear, moe:
        yield


def build(folder, additional_config=None, draft=False, g=None, fp8=False, q=1):
    """(vLLM model, VllmConfig, reference model over the FP8 checkpoint, the HF-named FP32
    state dict vLLM loaded). `draft`: the checkpoint gains an MTP layer and the model is
    vLLM's MTP drafter for it (the speculative config needs the checkpoint's top-level
    "glm5_next" config, whose text config is the model's). `g`: the geometry (default
    tiny_geometry()). `fp8`: vLLM loads the FP8 checkpoint itself (`fp8_kernels`) and the
    reference quantizes its FP8 linears' activations per token as vLLM's do; `q`: the
    reference's tokens per verify (its KDA state slots and conv columns per request)."""
    cpu_platform()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    from glm5_vllm.models import Glm5NextForCausalLM, Glm5NextMTP

    vllm_config = tiny_config(folder, additional_config, draft, g, fp8)
    g = g or tiny_geometry(1 if draft else 0)
    state = random_state_dict(g, seed=3)
    sd = dequantized(state)
    with set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            )  # fmt: skip
            parallel_state.initialize_model_parallel(1, 1)
        from vllm.v1.worker import workspace

        if workspace._manager is None:  # the sparse-MLA backend reserves its buffers here
            workspace.init_workspace_manager(torch.device("cpu"))
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            cls = Glm5NextMTP if draft else Glm5NextForCausalLM
            with fp8_kernels() if fp8 else nullcontext():
                model = cls(vllm_config=vllm_config, prefix="")
        finally:
            torch.set_default_dtype(default)
        model.load_weights(iter(checkpoint(state if fp8 else sd).items()))
        if draft:  # vLLM's proposer shares the target's embedding with the drafter
            model.model.embed_tokens.weight.data.copy_(sd["embed_tokens.weight"])
        process(model, vllm_config)
    reference = ReferenceModel.from_state_dict(
        g, state, max_requests=2, max_context=64, block_size=16, q=q, fp8_activations=fp8
    )
    return model, vllm_config, reference, sd
