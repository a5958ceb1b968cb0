"""The reference backbone's geometry: the fields of transformers' `Glm5NextTextConfig` it
reads, the TP degree it simulates, and the named geometries (`tiny`, `flash`,
`flash-tp{1,2,4,8}-rank`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FP8_BLOCK = 128

# Fields read from a Glm5NextTextConfig (same names, same defaults = GLM-5.3-Flash).
_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_shared_experts",
    "n_routed_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "norm_topk_prob",
    "hidden_act",
    "rms_norm_eps",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "swiglu_limit",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
    "linear_lower_bound",
    "hc_mult",
    "hc_eps",
    "hc_sinkhorn_iters",
    "index_kpool",
    "index_kpool_always_select_tail",
    "layer_types",
    "mlp_layer_types",
    "indexer_types",
)


@dataclass(frozen=True)
class Geometry:
    """One GLM-5.3-Flash-family model, and the TP shard(s) of it this process holds.

    `tp_size` ranks split heads and intermediate sizes; `ranks` are the shards built here
    (all of them to simulate TP on one device, or one: what a single rank holds)."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    # Not in Glm5NextTextConfig: the MTP draft layers a checkpoint carries (vLLM's
    # num_nextn_predict_layers), the TP degree and the shards held.
    num_nextn_predict_layers: int = 1
    tp_size: int = 1
    ranks: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        defaults = {
            "layer_types": tuple(
                "deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)
            ),
            "mlp_layer_types": tuple("dense" if i < min(3, n) else "sparse" for i in range(n)),
            "indexer_types": tuple("full" for _ in range(n)),
            "ranks": tuple(range(self.tp_size)) if isinstance(self.tp_size, int) else (),
        }
        for name, value in defaults.items():
            current = getattr(self, name)
            object.__setattr__(self, name, tuple(current) if current else value)
        problems = self.problems()
        if problems:
            raise ValueError(
                "unsupported GLM-5.3-Flash geometry:\n" + "\n".join(f"  - {p}" for p in problems)
            )

    def problems(self) -> list[str]:
        """Every reason the reference backbone cannot run this geometry, by field name."""
        p = []
        n = self.num_hidden_layers
        if self.qk_rope_head_dim != 0:
            p.append(f"qk_rope_head_dim={self.qk_rope_head_dim}: MLA is NoPE (expects 0)")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            p.append(
                f"index_topk={self.index_topk}: must be a multiple of "
                f"index_kpool={self.index_kpool}"
            )
        if self.n_group != 1 or self.topk_group != 1:
            p.append(f"n_group={self.n_group}, topk_group={self.topk_group}: expects 1")
        if not self.norm_topk_prob:
            p.append("norm_topk_prob=False: routing renormalizes top-k weights")
        if self.hidden_act != "silu":
            p.append(f"hidden_act={self.hidden_act!r}: expects 'silu'")
        if self.num_key_value_heads != self.num_attention_heads:
            p.append("num_key_value_heads: must equal num_attention_heads (MLA)")
        if self.vocab_size % max(self.tp_size, 1) if isinstance(self.tp_size, int) else False:
            p.append(f"vocab_size={self.vocab_size}: not divisible by tp_size={self.tp_size}")
        if self.hc_mult < 1:
            p.append(f"hc_mult={self.hc_mult}: expects at least 1 stream")
        for name, allowed in (
            ("layer_types", {"linear_attention", "deepseek_sparse_attention"}),
            ("mlp_layer_types", {"dense", "sparse"}),
            ("indexer_types", {"full", "shared"}),
        ):
            values = getattr(self, name)
            if len(values) != n:
                p.append(f"{name}: {len(values)} entries for {n} layers")
            bad = sorted(set(values) - allowed)
            if bad:
                p.append(f"{name}: unknown values {bad} (expects {sorted(allowed)})")
        mla = [i for i, t in enumerate(self.layer_types) if t == "deepseek_sparse_attention"]
        if mla and len(self.indexer_types) == n and self.indexer_types[mla[0]] != "full":
            p.append(f"indexer_types[{mla[0]}]: the first MLA layer must run its indexer ('full')")
        tp = self.tp_size
        if not isinstance(tp, int) or tp < 1:
            p.append(f"tp_size={tp!r}: expects a positive integer")
            return p
        for name in (
            "num_attention_heads",
            "linear_num_heads",
            "intermediate_size",
            "moe_intermediate_size",
        ):
            if getattr(self, name) % tp:
                p.append(f"{name}={getattr(self, name)}: not divisible by tp_size={tp}")
        for name in ("intermediate_size", "moe_intermediate_size"):
            # FP8 128x128 block scales must not straddle two ranks' rows.
            if tp > 1 and (getattr(self, name) // tp) % FP8_BLOCK:
                p.append(
                    f"{name}={getattr(self, name)}: each of tp_size={tp} shards must be a "
                    f"multiple of the {FP8_BLOCK}-wide FP8 block"
                )
        if not self.ranks or any(r not in range(tp) for r in self.ranks):
            p.append(f"ranks={self.ranks}: expects distinct ranks in 0..{tp - 1}")
        elif len(set(self.ranks)) != len(self.ranks):
            p.append(f"ranks={self.ranks}: repeated rank")
        return p

    @property
    def full_tp(self) -> bool:
        """Whether every shard is held, so reduced outputs are the full model's."""
        return len(self.ranks) == self.tp_size

    def is_mla(self, layer: int) -> bool:
        return self.layer_types[layer] == "deepseek_sparse_attention"

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla(i)]

    @classmethod
    def from_hf(cls, config: Any, **extra: Any) -> Geometry:
        """From a transformers `Glm5NextTextConfig` / `Glm5NextConfig`, or any object or
        mapping with their fields (a config.json read without transformers). What the
        transformers config derives in `__post_init__` is derived the same way here, so a
        plain config gives the same geometry: indexer_types from index_topk_pattern ("FSSF..."
        or a list) or else index_topk_freq / index_skip_topk_offset, linear_* from
        linear_attn_config."""
        from collections.abc import Mapping

        missing = object()

        def read(obj: Any, name: str, default: Any = missing) -> Any:
            if isinstance(obj, Mapping):
                return obj.get(name, default)
            return getattr(obj, name, default)

        text = read(config, "text_config", None) or config
        values = {name: read(text, name) for name in _HF_FIELDS}
        values = {name: value for name, value in values.items() if value is not missing}
        if not values.get("indexer_types"):
            n = values.get("num_hidden_layers", cls.num_hidden_layers)
            pattern = read(text, "index_topk_pattern", None)
            if isinstance(pattern, str):
                # Unknown letters pass through for __post_init__ to name.
                values["indexer_types"] = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            elif pattern is not None:
                values["indexer_types"] = pattern
            else:  # a full layer every `freq`, from layer `offset - 1` on (freq 1: all full)
                freq = max(read(text, "index_topk_freq", None) or 1, 1)
                offset = read(text, "index_skip_topk_offset", None)
                offset = 2 if offset is None else offset
                values["indexer_types"] = [
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
                ]
        linear = read(text, "linear_attn_config", None)
        if linear is not None:  # overrides the linear_* fields, as in transformers
            for name, key in (
                ("linear_head_dim", "head_dim"),
                ("linear_num_heads", "num_heads"),
                ("linear_conv_kernel_dim", "short_conv_kernel_size"),
                ("linear_lower_bound", "gate_lower_bound"),
            ):
                values[name] = read(linear, key, values.get(name, getattr(cls, name)))
            if read(linear, "safe_gate", True) and values["linear_lower_bound"] is None:
                values["linear_lower_bound"] = -5.0
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        # transformers 5.17 still reads full_attention; 5.20 (vLLM 0.33's) indexed_attention.
        if values.get("layer_types"):
            values["layer_types"] = tuple(
                "deepseek_sparse_attention" if t in ("full_attention", "indexed_attention") else t
                for t in values["layer_types"]
            )
        return cls(**values, **extra)

    def to_hf(self) -> Any:
        """The transformers `Glm5NextTextConfig` of this geometry (the oracle's config)."""
        from transformers import Glm5NextTextConfig

        values = {name: getattr(self, name) for name in _HF_FIELDS}
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            values[name] = list(values[name])
        # The pad id only marks an embedding row; tiny vocabularies lack the real one.
        pad = 154820 if self.vocab_size > 154820 else None
        return Glm5NextTextConfig(**values, pad_token_id=pad)


def geometry(name: str, **overrides: Any) -> Geometry:
    """A named geometry: 'tiny', 'flash', or 'flash-tp{1,2,4,8}-rank' (rank 0's shard)."""
    if name == "flash":
        return Geometry(**overrides)
    if name.startswith("flash-tp") and name.endswith("-rank"):
        tp = name[len("flash-tp") : -len("-rank")]
        if tp in ("1", "2", "4", "8"):
            return Geometry(**{"tp_size": int(tp), "ranks": (0,), **overrides})
    if name == "tiny":
        return Geometry(**{**TINY, **overrides})
    raise ValueError(
        f"geometry: unknown name {name!r} (expects tiny, flash, flash-tp{{1,2,4,8}}-rank)"
    )


# Every feature of the full model at CPU-test size: KDA and MLA+DSA layers (one shared
# indexer layer), dense and MoE MLPs, 4 mHC streams, pools of 4 with a tail, top-k 8.
TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    # 256: two FP8 blocks, so TP 2 shards keep whole blocks.
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=8,
    index_kpool=4,
    linear_head_dim=16,
    linear_num_heads=4,
    # transformers hands a full layer's top-k only to the layer right after it, so the
    # shared indexer layer follows an MLA layer directly.
    layer_types=("linear_attention",) * 3
    + ("deepseek_sparse_attention",) * 2
    + ("linear_attention",) * 2
    + ("deepseek_sparse_attention",),
    mlp_layer_types=("dense", "dense", "sparse", "sparse", "sparse", "sparse", "sparse", "sparse"),
    indexer_types=("full",) * 4 + ("shared",) + ("full",) * 3,
)
