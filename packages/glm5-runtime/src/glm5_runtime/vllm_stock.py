"""The vLLM-kernel stock: the reference backbone's step with the ops vLLM 0.33 runs for
GLM-5.3-Flash on an H200 wherever vLLM's own Triton kernels run without its compiled
extension, loaded from a folder of the wheel's files (`glm5_runtime.vllm_files`), so
`glm5-decode bench --stock vllm` judges the specialized decode against what a vLLM user runs.

- Routed experts: `TritonExperts`' sequence (the FP8 MoE backend vLLM 0.33 picks for block
  FP8 on Hopper at TP), over the block-FP8 128x128 weights in place: the tokens quantized
  per token in 1x128 groups (`per_token_group_quant_fp8`), the block assignment
  (`_prepare_expert_assignment`: one token a block where tokens x top-k x 4 <= experts, else
  `moe_align_block_size`), `fused_moe_kernel` over w13 (swap-AB on SM90 as vLLM decides),
  SwiGLU clamped at GLM's `swiglu_limit` (vLLM hands it to the experts as their clamp_limit:
  silu(min(gate, L)) * clamp(up, ±L) in FP32, the only activation path it takes with a
  limit), the quantization again, `fused_moe_kernel` over w2 with the router weights
  applied in FP32 before its BF16 store, the sum over the top-k rows. Tiles:
  `get_default_config` (vLLM ships no tuned config for 288 experts).
- KDA: vLLM's Glm5Next decode core over the reference's caches (vLLM's layouts):
  `causal_conv1d_update` on the conv state in place, GLM-5's `fused_recurrent_kda` with the
  gate and beta computed in the kernel and the state updated in place (a verify stores every
  token's state and resumes from the accepted one, `num_accepted_tokens`), `rms_norm_gated`
  (FusedRMSNormGated's CUDA path; under vLLM's default Inductor compilation its torch
  `forward_native` is compiled instead, the same FP32 math). Decode steps and verifies only:
  a prefill's KDA stays the reference's, and a decode must start from its request's first
  state slot (vLLM without MTP; with MTP every step is a verify).
- mHC (`glm5_runtime.vllm_mhc`): each sublayer's pre gate by `mhc_pre_mix_triton` from the
  mix GEMM and the streams' square sums, and its stream collapse by `hc_collapse_triton`;
  the GEMM, post gate, comb (softmax, Sinkhorn), every hc_post and the head's mean stay
  torch: vLLM 0.33's Triton file has no whole pre, post or boundary kernel (TileLang runs
  them on CUDA), its post is FP32 with one rounding where the reference's is BF16, and its
  Glm5Next head is torch's mean too (vllm_mhc's docstring says it piece by piece).

In torch where vLLM's is a C++ op: `moe_align_block_size`'s sort (`_align`, capturable: fixed
shapes, no host sync) and `moe_sum` (a sum over the top-k rows). Where vLLM's CUDA build
calls a C++ op and the same function has a Triton path, the Triton path runs (the C++ sources
are not in the wheel): `per_token_group_quant_fp8`'s kernel for `per_token_group_fp8_quant`,
the pad-aware clamped SwiGLU kernel for `silu_and_mul_with_clamp` (both FP32 math, one
rounding). The routing is the reference's `route_ref`, its int64 ids cast to vLLM's int32;
every other op stays the reference's torch, named op by op in `sources`."""

from __future__ import annotations

import functools
import logging
import os
import typing
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm5_kernels.norm import rms_norm_ref

from . import vllm_mhc
from .reference import ReferenceModel
from .reference.stages import Placement, RankStages
from .vllm_files import load, manifest

__all__ = ["VllmKernels", "VllmStock", "fused_experts", "kda_core"]

BLOCK = [128, 128]  # the checkpoint's FP8 weight blocks, vLLM's block_shape
O_NORM_EPS = 1e-5  # vLLM's Glm5Next builds FusedRMSNormGated without eps: its default
OPS = ("experts", "kda")  # RankStages methods it replaces; and ReferenceModel._pre (mhc)
# The step's ops, each named with what runs it in `VllmStock.sources`.
SOURCES = ("embed", "kda_projections", "kda", "kda_prefill", "mla", "indexer", "dense_mlp",
           "router", "routing", "experts", "shared_expert", "mhc", "norms", "head")  # fmt: skip


class _Logger:
    """vLLM's logger as the loaded code calls it (warning_once, info_once, ...): debug lines."""

    def __getattr__(self, name: str):
        return lambda msg, *args, **kw: logging.getLogger(__name__).debug(msg, *args)


def _platform() -> SimpleNamespace:
    """vLLM's `current_platform` as the loaded kernels ask it: the GPU's capability (vLLM's
    swap-AB and PDL rules) where torch has one, and no CUDA C++ ops (is_cuda False), so a
    function with a Triton path beside its C++ op takes the Triton one."""
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    number = None if cap is None else 10 * cap[0] + cap[1]

    def is_capability(c) -> bool:
        return number == (c if isinstance(c, int) else 10 * c[0] + c[1])

    no = lambda: False  # noqa: E731
    return SimpleNamespace(
        is_cuda=no, is_cuda_alike=no, is_rocm=no, is_xpu=no, is_cpu=no, is_fp8_fnuz=no,
        is_device_capability=is_capability,
        is_arch_support_pdl=lambda: number is not None and number >= 90,
        fp8_dtype=lambda: torch.float8_e4m3fn,
    )  # fmt: skip


def _refused(what: str):
    """A function the loaded files import but only call on paths this stock never takes
    (other weight formats, TMA scales): called anyway, it says so instead of guessing."""

    def call(*args, **kwargs):
        raise RuntimeError(f"{what}: not a path of the vLLM stock (block-FP8 TP experts only)")

    return call


def _align(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad,
           expert_map=None, scatter_idx=None) -> None:  # fmt: skip
    """vLLM's C++ `moe_align_block_size` in torch, into its wrapper's buffers: each expert's
    routes (flat indices into topk_ids, in order) padded to whole blocks with the sentinel
    numel, experts in order; expert_ids the expert of each block (-1 past the last, which
    the kernel skips: it stops at num_tokens_post_pad); num_tokens_post_pad the padded total."""
    if expert_map is not None or scatter_idx is not None:
        raise ValueError("moe_align_block_size: expert parallelism is not a TP step's")
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices  # the routes by expert
    expert = flat[order]
    within = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids.fill_(n)
    sorted_ids[ends[expert] - padded[expert] + within] = order.to(sorted_ids.dtype)
    starts = torch.arange(expert_ids.numel(), device=flat.device) * block_size
    block_expert = torch.searchsorted(ends, starts, right=True)
    expert_ids.copy_(torch.where(block_expert < num_experts, block_expert, -1))
    num_tokens_post_pad.copy_(ends[-1:])


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _log(x):
    return tl.log(x)


def _swiglu_limit(output: Tensor, input: Tensor, topk_ids: Tensor, limit: float) -> None:
    """`_swiglu_limit_pad_aware` for every route valid, in torch: FP32 math, one rounding."""
    gate, up = input.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    output.copy_(gate * torch.sigmoid(gate) * up)


class VllmKernels:
    """vLLM 0.33's kernels from a checked folder of its files (`vllm_files.copy_files`), each
    file's definitions run over stand-ins for its imports: `moe` (fused_moe_kernel and its
    launch, tiles, block assignment, alignment wrapper, SwiGLU, FP8 quantization), `conv`
    (causal_conv1d), `kda` (GLM-5's fused_recurrent_kda), `norm` (rms_norm_gated), `kimi`
    (Kimi's KDA decode kernels: benchmarks/kda_decode.py's stock), `mhc` (the mHC pre gate
    and stream collapse: `vllm_mhc`)."""

    def __init__(self, folder: str | Path):
        self.folder, self.manifest = Path(folder), manifest(folder)
        # Triton's interpreter patches the tl functions a kernel names through `tl`, not
        # fla's `exp = tl.exp` aliases (jit wrappers there), and runs a tl.range loop over
        # Python ints, which the SwiGLU kernel's `row.to(tl.int64)` cannot take (the same
        # FP32 math in torch there).
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        exp, log = (_exp, _log) if interpreted else (tl.exp, tl.log)
        envs = SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TRITON_USE_TD=None,
                               VLLM_TUNED_CONFIG_FOLDER=None)  # fmt: skip
        math = dict(cdiv=triton.cdiv, next_power_of_2=triton.next_power_of_2,
                    round_up=lambda x, y: (x + y - 1) // y * y, RCP_LN2=1.4426950216)  # fmt: skip
        base = dict(torch=torch, triton=triton, tl=tl, current_platform=_platform(),
                    envs=envs, logger=_Logger(), functools=functools, Any=typing.Any,
                    Literal=typing.Literal, overload=typing.overload, **math)  # fmt: skip

        def get(file: str, *names: str, **scope) -> SimpleNamespace:
            return load(folder, file, list(names), base | scope)

        fp8 = get(
            "fp8", "_per_token_group_quant_fp8", "per_token_group_quant_fp8",
            get_fp8_min_max=lambda: (-448.0, 448.0), is_deep_gemm_e8m0_used=lambda: False,
            get_tma_aligned_size=_refused("TMA-aligned scales"),
        )  # fmt: skip
        utils = get(
            "moe_utils", "enable_swap_ab", "resolve_moe_use_td", "_warned_moe_use_td_ineffective",
            "warn_if_moe_use_td_ineffective", "_swiglu_limit_pad_aware_kernel",
            "_swiglu_limit_pad_aware",
        )  # fmt: skip
        align = get("moe_align", "moe_align_block_size",
                    ops=SimpleNamespace(moe_align_block_size=_align))  # fmt: skip
        moe = get(
            "fused_moe", "write_zeros_to_output", "fused_moe_kernel",
            "invoke_fused_moe_triton_kernel", "get_default_config", "_prepare_expert_assignment",
            enable_swap_ab=utils.enable_swap_ab, resolve_moe_use_td=utils.resolve_moe_use_td,
            warn_if_moe_use_td_ineffective=utils.warn_if_moe_use_td_ineffective,
            set_triton_allocator=_refused("the tensor-descriptor path"),
            should_moe_wna16_use_cuda=_refused("int4 / int8 weights"),
            moe_align_block_size=align.moe_align_block_size,
        )  # fmt: skip
        swiglu = _swiglu_limit if interpreted else utils._swiglu_limit_pad_aware
        self.moe = SimpleNamespace(**vars(moe), **vars(fp8), swiglu_limit=swiglu)
        self.conv = get("conv", "_causal_conv1d_update_kernel", "causal_conv1d_update",
                        NULL_BLOCK_ID=0, PAD_SLOT_ID=-1)  # fmt: skip
        recurrent = get("glm5_recurrent", "token_stride",
                        "fused_recurrent_gated_delta_rule_fwd_kernel", exp=exp)  # fmt: skip
        self.kda = get("glm5_kda", "fused_recurrent_kda_fwd", "fused_recurrent_kda",
                       **vars(recurrent))  # fmt: skip
        self.norm = get("gated_norm", "layer_norm_gated_fwd_kernel",
                        "layer_norm_gated_fwd_kernel1", "layer_norm_gated_fwd",
                        "rms_norm_gated")  # fmt: skip
        self.kimi = get(
            "kimi_kda", "_kda_gate_beta_fwd_kernel", "_fused_kda_gate_beta",
            "fused_recurrent_kda_fwd_kernel", "get_fused_recurrent_kda_fwd_warmup_profiles",
            "fused_recurrent_kda_fwd", "fused_recurrent_kda",
            "fused_recurrent_kda_packed_decode_kernel", "fused_recurrent_kda_packed_decode",
            exp=exp, log=log,
        )  # fmt: skip
        self.mhc = get("mhc", *vllm_mhc.NAMES, Tensor=Tensor)


def fused_experts(
    vk: VllmKernels, x: Tensor, w13: Tensor, s13: Tensor, w2: Tensor, s2: Tensor, ids: Tensor,
    weights: Tensor, limit: float, ue8m0: bool = False,
) -> Tensor:  # fmt: skip
    """x [M, D] BF16; w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I] e4m3 with FP32 block
    scales s13 [E, 2I/128, D/128], s2 [E, D/128, I/128]; ids, weights [M, top-k] (FP32) ->
    Σ_j weights[:, j] * expert_{ids[:, j]}(x) [M, D] BF16, as vLLM's TritonExperts computes
    it (the module docstring). Capturable: no host sync, no shape from the routing."""
    moe = vk.moe
    m, d = x.shape
    e, n, _ = w13.shape
    top_k = ids.shape[1]
    config = moe.get_default_config(m, e, w2.shape[2], d, top_k, "fp8_w8a8", BLOCK)
    ids = ids.to(torch.int32)
    weights = weights.float().contiguous()
    gemm = functools.partial(
        moe.invoke_fused_moe_triton_kernel, config=config, compute_type=tl.bfloat16,
        use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
        per_channel_quant=False, block_shape=BLOCK,
    )  # fmt: skip
    xq, sx = moe.per_token_group_quant_fp8(x, BLOCK[1], use_ue8m0=ue8m0)
    sorted_ids, expert_ids, padded = moe._prepare_expert_assignment(
        ids, config, m, top_k, e, None, block_shape=BLOCK
    )
    gate_up = torch.empty(m, top_k, n, dtype=x.dtype, device=x.device)
    gemm(xq, w13, gate_up, sx, s13, None, sorted_ids, expert_ids, padded,
         mul_routed_weight=False, top_k=top_k)  # fmt: skip
    act = torch.empty(m * top_k, n // 2, dtype=x.dtype, device=x.device)
    moe.swiglu_limit(act, gate_up.view(-1, n), ids.view(-1), limit)  # every route is valid
    aq, sa = moe.per_token_group_quant_fp8(act, BLOCK[1], use_ue8m0=ue8m0)
    down = torch.empty(m, top_k, d, dtype=x.dtype, device=x.device)
    gemm(aq, w2, down, sa, s2, weights, sorted_ids, expert_ids, padded,
         mul_routed_weight=True, top_k=1)  # fmt: skip
    return down.sum(1)  # moe_sum


def kda_core(
    vk: VllmKernels, mixed: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv: Tensor,
    recurrent: Tensor, conv_weight: Tensor, dt_bias: Tensor, A_log: Tensor,
    norm_weight: Tensor, lower_bound: float, placed: dict,
) -> Tensor:  # fmt: skip
    """`kda_decode_ref`'s contract (conv to gated norm, caches updated in place) on vLLM's
    Glm5Next decode ops: mixed [R, T, 3C'] (q | k | v; the conv overwrites it, as vLLM's
    does its projection's), f [R, T, H*K], b [R, T, H] (raw beta logits), gate [R, T, H*V];
    conv [slots, W-2+q, 3C'] BF16, recurrent [slots, H, V, K] FP32; `placed` the step's
    int32 indices (`_placed`). -> [R, T, H*V] in mixed's dtype."""
    r, t, c = mixed.shape
    h = A_log.shape[0]
    kd, vd = f.shape[-1] // h, gate.shape[-1] // h
    n = r * t
    state = conv.transpose(-1, -2)  # the SD cache as (slots, dim, state_len), as vLLM reads it
    qkv = mixed.reshape(n, c)
    verify = placed["accepted"] is not None
    if verify:
        qkv = vk.conv.causal_conv1d_update(
            qkv, state, conv_weight, None, activation="silu",
            conv_state_indices=placed["conv"], num_accepted_tokens=placed["accepted"],
            query_start_loc=placed["starts"], max_query_len=t,
        )  # fmt: skip
    else:
        qkv = vk.conv.causal_conv1d_update(
            qkv, state, conv_weight, None, activation="silu", conv_state_indices=placed["conv"]
        )
    q, k, v = (x.reshape(1, n, h, -1) for x in qkv.split([h * kd, h * kd, h * vd], dim=-1))
    core = torch.empty(1, n, h, vd, dtype=mixed.dtype, device=mixed.device)
    vk.kda.fused_recurrent_kda(
        q=q, k=k, v=v, g=f.reshape(1, n, h, kd), beta=b.reshape(1, n, h),
        initial_state=recurrent, use_qk_l2norm_in_kernel=True, cu_seqlens=placed["starts"],
        ssm_state_indices=placed["states"], num_accepted_tokens=placed["accepted"], out=core,
        sigmoid_beta=True, a_log=A_log, g_bias=dt_bias, compute_gate=True,
        lower_bound=lower_bound,
    )  # fmt: skip
    out = vk.norm.rms_norm_gated(core, gate.reshape(n, h, vd), norm_weight, None, "sigmoid",
                                eps=O_NORM_EPS)  # fmt: skip
    return out.reshape(r, t, h * vd)


def _placed(step: Placement, tokens: int) -> dict:
    """The step's KDA indices as vLLM's metadata builder hands them to the kernels (int32,
    built once a step, outside the graph: the first call of a step is eager): conv rows,
    query starts, the state slots (a verify's every token's), accepted counts (verify)."""
    r = step.conv_slots.shape[0]
    device = step.conv_slots.device
    verify = step.keep_states and tokens > 1
    return {
        "conv": step.conv_slots.int(),
        "starts": torch.arange(0, r * tokens + 1, tokens, dtype=torch.int32, device=device),
        "states": (step.write_slots if verify else step.read_slots).int().contiguous(),
        "accepted": (step.conv_offset + 1).int() if verify else None,
    }


class VllmStock:
    """While entered, `model`'s ranks run vLLM 0.33's kernels for the routed experts and the
    KDA core, and `model` its mHC pre (the module docstring); `sources` names what runs each
    op of the step (the bench records it). `kernels`: a loaded `VllmKernels`, or the folder
    of vLLM's files."""

    def __init__(self, model: ReferenceModel, kernels: VllmKernels | str | Path):
        self.model = model
        self.vk = kernels if isinstance(kernels, VllmKernels) else VllmKernels(kernels)
        self._step: tuple[Placement, int, dict] | None = None
        g = model.g
        fp8 = torch.float8_e4m3fn
        experts = [w for r in model.ranks for n, w in r.w.items() if ".experts." in n]
        shapes_ok = all(d % 128 == 0 for w in experts if w.dtype == fp8 for d in w.shape[1:])
        self.fallbacks: dict[str, str] = {}
        if not shapes_ok:
            self.fallbacks["experts"] = "expert dims not multiples of 128 (vLLM's FP8 blocks)"
        if g.linear_lower_bound is None:
            self.fallbacks["kda"] = "no gate lower bound (vLLM's in-kernel gate is the safe one)"
        torch_swiglu = self.vk.moe.swiglu_limit is _swiglu_limit
        vllm = dict(
            experts="vllm:fused_moe_kernel (w13; w2 x router weights) + "
            "vllm:per_token_group_quant_fp8 (x2) + "
            + ("torch clamped SwiGLU" if torch_swiglu else "vllm:_swiglu_limit_pad_aware")
            + "; torch: moe_align_block_size's sort, moe_sum",
            kda="vllm:causal_conv1d_update + vllm:fused_recurrent_kda + vllm:rms_norm_gated",
        )
        self.sources = {op: "torch" for op in SOURCES}
        self.sources["routing"] = "torch (route_ref)"
        self.sources |= {op: v for op, v in vllm.items() if op not in self.fallbacks}
        self.sources["mhc"] = vllm_mhc.SOURCE
        self.hc = vllm_mhc.hc_weights(model)  # FP32, as vLLM holds them

    def __enter__(self) -> VllmStock:
        for rank in self.model.ranks:
            if "experts" not in self.fallbacks:
                rank.experts = functools.partial(self._experts, rank)
            if "kda" not in self.fallbacks:
                rank.kda = functools.partial(self._kda, rank)
        self.model._pre = self._pre
        return self

    def __exit__(self, *exc) -> None:
        for rank in self.model.ranks:
            for name in OPS:
                rank.__dict__.pop(name, None)
        self.model.__dict__.pop("_pre", None)

    def _pre(self, streams: Tensor, hc: str, norm: str) -> tuple[Tensor, Tensor, Tensor]:
        """ReferenceModel._pre with vLLM's pre gate and collapse (`vllm_mhc.mhc_pre`)."""
        model, g = self.model, self.model.g
        if streams.dtype != torch.bfloat16:  # the collapse kernel's only dtype
            return ReferenceModel._pre(model, streams, hc, norm)
        post, comb, x = vllm_mhc.mhc_pre(
            self.vk.mhc, streams, self.hc[f"{hc}.fn"], self.hc[f"{hc}.scale"],
            self.hc[f"{hc}.base"], rms_eps=g.rms_norm_eps, hc_eps=g.hc_eps,
            sinkhorn_iters=g.hc_sinkhorn_iters,
        )  # fmt: skip
        return rms_norm_ref(x, model._w(norm), g.rms_norm_eps), post, comb

    def _experts(self, rank: RankStages, prefix: str, x: Tensor, ids: Tensor, weights: Tensor):
        w = rank.w
        if x.dtype != torch.bfloat16 or w[f"{prefix}.gate_up_proj"].dtype != torch.float8_e4m3fn:
            return RankStages.experts(rank, prefix, x, ids, weights)
        return fused_experts(
            self.vk, x, w[f"{prefix}.gate_up_proj"], w[f"{prefix}.gate_up_proj_scale_inv"],
            w[f"{prefix}.down_proj"], w[f"{prefix}.down_proj_scale_inv"], ids, weights,
            rank.g.swiglu_limit, rank.ue8m0,
        )  # fmt: skip

    def _kda(self, rank: RankStages, layer: int, x: Tensor, step: Placement) -> Tensor:
        """RankStages.kda with vLLM's core between the projections and o_proj."""
        a, t = f"layers.{layer}.self_attn", x.shape[1]
        if x.dtype != torch.bfloat16 or (t > 1 and not step.keep_states):  # a prefill
            return RankStages.kda(rank, layer, x, step)
        whole, (q, k, v, b, f_a, g_a) = rank._parts(x, a, "in_proj_qkvbfg_a")
        width = q.shape[-1] + k.shape[-1] + v.shape[-1]
        mixed = whole[..., :width] if whole is not None else torch.cat([q, k, v], dim=-1)
        f = rank.linear(f_a, f"{a}.forget_gate.f_b_proj.weight")
        gate = rank.linear(g_a, f"{a}.g_b_proj.weight")
        if self._step is None or self._step[0] is not step or self._step[1] != t:
            self._step = (step, t, _placed(step, t))
        w = rank.w
        o = kda_core(
            self.vk, mixed, f, b, gate, rank.c.conv[layer], rank.c.recurrent[layer],
            w[f"{a}.conv1d.weight"][:, 0], w[f"{a}.forget_gate.dt_bias"],
            w[f"{a}.forget_gate.A_log"], w[f"{a}.o_norm.weight"], rank.g.linear_lower_bound,
            self._step[2],
        )  # fmt: skip
        return rank.linear(o, f"{a}.o_proj.weight")
