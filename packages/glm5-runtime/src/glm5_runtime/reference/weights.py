"""Weights of the reference backbone: HF names, TP shards, FP8 block quantization.

Every tensor has a `Spec`: its full shape, how TP splits it (`axis`, and `parts` for fused
tensors whose equal parts are split one by one, like KDA's conv over q|k|v), its init
statistics, and whether it is stored FP8 e4m3 with 128x128 block scales (MLP and expert
weights, as in the checkpoint) or BF16 / FP32.

Layout of a rank's weights: {hf_name: tensor}, FP8 tensors with `<name>_scale_inv` beside.
The MTP draft layer lives at `layers.{num_hidden_layers + i}.` as in the checkpoint."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from glm5_kernels.quant import dequantize_fp8_block_ref, quantize_fp8_block_ref

from .config import Geometry

FP32_NAMES = ("e_score_correction_bias", "dt_bias", "A_log", "conv1d.weight")


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    axis: int | None = None  # TP split axis; None: replicated
    parts: int = 1  # equal fused parts along `axis`, each split across ranks
    init: str = "linear"  # linear | norm | normal | zeros | ones | hc_fn | hc_scale | ...
    fp8: bool = False
    std: float = 1.0


def _mlp(prefix: str, d: int, i: int) -> dict[str, Spec]:
    return {
        f"{prefix}.gate_proj.weight": Spec((i, d), 0, fp8=True),
        f"{prefix}.up_proj.weight": Spec((i, d), 0, fp8=True),
        f"{prefix}.down_proj.weight": Spec((d, i), 1, fp8=True),
    }


def layer_specs(g: Geometry, layer: int, mtp: bool = False) -> dict[str, Spec]:
    """The tensors of decoder layer `layer` (an MTP layer when `mtp`), HF names."""
    d, p = g.hidden_size, f"layers.{layer}"
    s: dict[str, Spec] = {
        f"{p}.input_layernorm.weight": Spec((d,), init="norm"),
        f"{p}.post_attention_layernorm.weight": Spec((d,), init="norm"),
    }
    if not mtp:
        h = g.hc_mult
        for site in ("attn_hc", "ffn_hc"):
            s[f"{p}.{site}.fn"] = Spec(
                ((2 + h) * h, h * d), init="normal", std=0.5 / math.sqrt(h * d)
            )
            s[f"{p}.{site}.base"] = Spec(((2 + h) * h,), init="normal", std=0.5)
            s[f"{p}.{site}.scale"] = Spec((3,), init="hc_scale")
    else:
        s[f"{p}.enorm.weight"] = Spec((d,), init="norm")
        s[f"{p}.hnorm.weight"] = Spec((d,), init="norm")
        s[f"{p}.eh_proj.weight"] = Spec((d, 2 * d))
        s[f"{p}.shared_head.norm.weight"] = Spec((d,), init="norm")
    a = f"{p}.self_attn"
    if mtp or g.is_mla(layer):
        heads, qk = g.num_attention_heads, g.qk_nope_head_dim + g.qk_rope_head_dim
        s |= {
            f"{a}.q_a_proj.weight": Spec((g.q_lora_rank, d)),
            f"{a}.q_a_layernorm.weight": Spec((g.q_lora_rank,), init="norm"),
            f"{a}.q_b_proj.weight": Spec((heads * qk, g.q_lora_rank), 0),
            f"{a}.kv_a_proj_with_mqa.weight": Spec((g.kv_lora_rank, d)),
            f"{a}.kv_a_layernorm.weight": Spec((g.kv_lora_rank,), init="norm"),
            f"{a}.kv_b_proj.weight": Spec((heads * (qk + g.v_head_dim), g.kv_lora_rank), 0),
            f"{a}.o_proj.weight": Spec((d, heads * g.v_head_dim), 1),
        }
        if mtp or g.indexer_types[layer] == "full":
            x, ih, hd = f"{a}.indexer", g.index_n_heads, g.index_head_dim
            s |= {
                f"{x}.wq_b.weight": Spec((ih * hd, g.q_lora_rank)),
                f"{x}.wk.weight": Spec((hd, d)),
                f"{x}.k_norm.weight": Spec((hd,), init="norm"),
                f"{x}.k_norm.bias": Spec((hd,), init="normal", std=0.1),
                f"{x}.weights_proj.weight": Spec((ih, d)),
                f"{x}.index_kpool_compress_ape": Spec((g.index_kpool, hd), init="normal", std=0.5),
                f"{x}.index_kpool_compress_gate": Spec((hd, d)),
            }
    else:
        qkv, hk, kd = g.linear_num_heads * g.linear_head_dim, g.linear_num_heads, g.linear_head_dim
        w = g.linear_conv_kernel_dim
        s |= {
            f"{a}.q_proj.weight": Spec((qkv, d), 0),
            f"{a}.k_proj.weight": Spec((qkv, d), 0),
            f"{a}.v_proj.weight": Spec((qkv, d), 0),
            f"{a}.conv1d.weight": Spec((3 * qkv, 1, w), 0, parts=3, init="conv"),
            f"{a}.forget_gate.f_a_proj.weight": Spec((kd, d)),
            f"{a}.forget_gate.f_b_proj.weight": Spec((qkv, kd), 0),
            f"{a}.forget_gate.dt_bias": Spec((qkv,), 0, init="dt_bias"),
            f"{a}.forget_gate.A_log": Spec((hk,), 0, init="normal", std=0.3),
            f"{a}.b_proj.weight": Spec((hk, d), 0),
            f"{a}.g_a_proj.weight": Spec((kd, d)),
            f"{a}.g_b_proj.weight": Spec((qkv, kd), 0),
            f"{a}.o_norm.weight": Spec((kd,), init="norm"),
            f"{a}.o_proj.weight": Spec((d, qkv), 1),
        }
    m = f"{p}.mlp"
    if not mtp and g.mlp_layer_types[layer] == "dense":
        return s | _mlp(m, d, g.intermediate_size)
    e, i = g.n_routed_experts, g.moe_intermediate_size
    return s | {
        f"{m}.gate.weight": Spec((e, d)),
        f"{m}.gate.e_score_correction_bias": Spec((e,), init="normal", std=0.05),
        f"{m}.experts.gate_up_proj": Spec((e, 2 * i, d), 1, parts=2, fp8=True),
        f"{m}.experts.down_proj": Spec((e, d, i), 2, fp8=True),
        **_mlp(f"{m}.shared_experts", d, i * g.n_shared_experts),
    }


def model_specs(g: Geometry) -> dict[str, Spec]:
    """Every tensor of the model and its MTP layers, HF names."""
    specs = {
        "embed_tokens.weight": Spec((g.vocab_size, g.hidden_size), 0, init="normal"),
        "norm.weight": Spec((g.hidden_size,), init="norm"),
        "lm_head.weight": Spec((g.vocab_size, g.hidden_size), 0),
    }
    for layer in range(g.num_hidden_layers):
        specs |= layer_specs(g, layer)
    for k in range(g.num_nextn_predict_layers):
        specs |= layer_specs(g, g.num_hidden_layers + k, mtp=True)
    return specs


def shard(full: torch.Tensor, spec: Spec, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice of `full` (contiguous): each fused part split in tp pieces."""
    if spec.axis is None or tp == 1:
        return full
    parts = full.chunk(spec.parts, dim=spec.axis)
    return torch.cat([q.chunk(tp, dim=spec.axis)[rank] for q in parts], dim=spec.axis)


def shard_shape(spec: Spec, tp: int) -> tuple[int, ...]:
    if spec.axis is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.axis] //= tp
    return tuple(shape)


def _random(name: str, spec: Spec, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Init with the statistics of a trained checkpoint's scale (unit activations)."""
    if spec.init == "linear":
        fan_in = spec.shape[-1]
        return torch.randn(shape, generator=gen, device=gen.device) / math.sqrt(fan_in)
    if spec.init == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=gen.device)
    if spec.init == "normal":
        return spec.std * torch.randn(shape, generator=gen, device=gen.device)
    if spec.init == "hc_scale":
        return 0.5 + torch.rand(shape, generator=gen, device=gen.device)
    if spec.init == "conv":
        return torch.randn(shape, generator=gen, device=gen.device) / math.sqrt(shape[-1])
    if spec.init == "dt_bias":
        # Inverse softplus of dt ~ logU(1e-3, 1e-1), as FLA initializes it.
        dt = torch.exp(
            torch.empty(shape, device=gen.device).uniform_(
                math.log(1e-3), math.log(1e-1), generator=gen
            )
        )
        return dt + torch.log(-torch.expm1(-dt))
    raise ValueError(f"{name}: unknown init {spec.init!r}")


def _generator(seed: int, name: str, rank: int, device="cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(
        seed * 1_000_003 + zlib.crc32(f"{name}@{rank}".encode())
    )


def _dtype(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_NAMES) else dtype


def random_state_dict(g: Geometry, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF-named weights with realistic statistics, as a checkpoint holds
    them: MLP and expert weights FP8 e4m3 with `<name>_scale_inv` block scales."""
    out = {}
    for name, spec in model_specs(g).items():
        w = _random(name, spec, spec.shape, _generator(seed, name, -1))
        if spec.fp8:
            out[name], out[name + "_scale_inv"] = quantize_fp8_block_ref(w)
        else:
            out[name] = w.to(_dtype(name))
    return out


def dequantized(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP32 copies of every tensor, FP8 ones dequantized (what a float model loads)."""
    out = {}
    for name, w in state_dict.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            w = dequantize_fp8_block_ref(w, state_dict[name + "_scale_inv"])
        out[name] = w.float()
    return out


def load_rank(
    g: Geometry,
    rank: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    ue8m0: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of an HF state dict: FP8 tensors quantized per shard (or taken
    with their `_scale_inv` when the dict already holds FP8), the rest in BF16 / FP32."""
    specs, out, problems = model_specs(g), {}, []
    for name in sorted(set(specs) - set(state_dict)):
        problems.append(f"{name}: missing")
    for name in sorted(
        set(state_dict) - set(specs) - {n for n in state_dict if n.endswith("_scale_inv")}
    ):
        problems.append(f"{name}: unexpected tensor")
    for name, spec in specs.items():
        w = state_dict.get(name)
        if w is not None and tuple(w.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(w.shape)} (expects {spec.shape})")
        if (
            w is not None
            and w.dtype == torch.float8_e4m3fn
            and name + "_scale_inv" not in state_dict
        ):
            problems.append(f"{name}_scale_inv: missing (an FP8 weight needs its block scales)")
    for name in sorted(n for n in state_dict if n.endswith("_scale_inv")):
        if name.removesuffix("_scale_inv") not in specs:
            problems.append(f"{name}: unexpected tensor")
    if problems:
        raise ValueError(
            "state dict does not fit the geometry:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    for name, spec in specs.items():
        w = state_dict[name]
        if w.dtype == torch.float8_e4m3fn:
            w = dequantize_fp8_block_ref(w, state_dict[name + "_scale_inv"])
        local = shard(w.to(device), spec, rank, g.tp_size)
        out.update(_store(name, spec, local, device, ue8m0, dtype))
    return out


def _store(name, spec, local, device, ue8m0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    if spec.fp8:
        q, scale = quantize_fp8_block_ref(local.float(), ue8m0=ue8m0)
        return {name: q.to(device), name + "_scale_inv": scale.to(device)}
    return {name: local.to(device=device, dtype=_dtype(name, dtype)).contiguous()}


def random_rank(
    g: Geometry,
    rank: int,
    seed: int = 0,
    *,
    device="cpu",
    ue8m0: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank `rank`'s shard drawn directly at shard size (the full flash model never exists
    in memory); yields tensor by tensor so a GPU build streams."""
    for name, spec in model_specs(g).items():
        shape = shard_shape(spec, g.tp_size)
        w = _random(
            name, spec, shape, _generator(seed, name, rank if spec.axis is not None else -1, device)
        )
        yield from _store(name, spec, w, device, ue8m0, dtype).items()
