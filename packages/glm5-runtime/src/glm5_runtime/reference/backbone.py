"""The reference backbone through the backbone protocol: `ReferenceBackbone(model)` presents
a ReferenceModel's layers, weights and stock stages to the specialized decode. Its
`placement` is the model's `Placement`; the stock forward is `model.backbone`. A model across
processes (`ReferenceModel(group=...)`) presents its one rank, its sums across the processes
and their mailboxes (`mailbox`) for the fused boundaries' exchange."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType

import torch
from torch import Tensor

from glm5_comm import Mailbox
from glm5_kernels.mhc import MhcConfig, hc_expand_ref, hc_head_ref, hc_post_ref
from glm5_kernels.norm import rms_norm_ref

from ..plan import Rows
from ..protocol import Indexer, Kda, KdaPlacement, Layer, Mla, MlaCaches, MlaPlacement, Routing
from .model import ReferenceModel
from .stages import FUSED_PARTS, KEY_EPS, Placement

__all__ = ["ReferenceBackbone"]


class ReferenceBackbone:
    """Implements `glm5_runtime.protocol.Backbone` over a ReferenceModel (its held ranks are
    the shards)."""

    aux_layers: tuple[int, ...] = ()
    # vLLM's fused attention weights, built from the HF parts on first use (`weight`): a
    # stage serves each with one op, as vLLM runs it.
    fused_projections: Mapping[str, tuple[str, ...]] = MappingProxyType({
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
        "in_proj_qkvbfg_a": ("q_proj", "k_proj", "v_proj"),
    })  # fmt: skip

    def __init__(self, model: ReferenceModel, mailbox: Callable[..., Mailbox] | None = None):
        """`mailbox(hidden, max_tokens, dtype)`: this process's mailbox over the model's
        group (default: torch symmetric memory, on GPUs)."""
        g = model.g
        self._mailbox = mailbox
        self._unreduced = False  # inside `unreduced()`: `embed` gives this shard's partial
        self.model, self.g = model, g
        self.layers = [
            Layer(i, "mla" if g.is_mla(i) else "kda", "dense" if t == "dense" else "moe")
            for i, t in enumerate(g.mlp_layer_types)
        ]
        self.shards = list(range(len(model.ranks)))
        self.hidden_size, self.swiglu_limit = g.hidden_size, g.swiglu_limit
        self.vocab_size = g.vocab_size
        self.ue8m0 = model.ranks[0].ue8m0
        self.routing = Routing(g.num_experts_per_tok, g.routed_scaling_factor)
        self.kda = Kda(g.linear_lower_bound, g.rms_norm_eps)  # `kda_caches`, `kda_placement`
        scale = (g.qk_nope_head_dim + g.qk_rope_head_dim) ** -0.5
        # The MLA sublayer stage (`mla_caches`, `mla_placement`).
        self.mla = Mla(g.qk_nope_head_dim, g.v_head_dim, scale, norm_eps=g.rms_norm_eps)
        pools = -(-model.max_context // model.block_size) * model.block_size // g.index_kpool
        self.indexer = Indexer(  # the MLA sublayer's (over vLLM's FP8 pages: `mla_caches`)
            g.index_n_heads, g.index_head_dim, g.index_kpool, g.index_topk,
            bool(g.index_kpool_always_select_tail and g.index_kpool > 1), pools,
            model.block_size, key_norm_eps=KEY_EPS,
        )  # fmt: skip
        # hc_mix_ref's post multiplier is GLM-5.3-Flash's 2.0; every norm uses rms_norm_eps.
        self.mhc = MhcConfig(
            hc=g.hc_mult, hidden=g.hidden_size, rms_eps=g.rms_norm_eps, hc_eps=g.hc_eps,
            sinkhorn_iters=g.hc_sinkhorn_iters, norm_eps=g.rms_norm_eps, post_mult=2.0,
        )  # fmt: skip
        self.draft_layers = [Layer(i, "mla", "moe") for i in model.mtp_layers]
        self._topk: Tensor | None = None  # the last full indexer layer's selection this step

    def weight(self, shard: int, name: str) -> Tensor | None:
        rank = self.model.ranks[shard]
        prefix, _, fused = name.removesuffix(".weight").rpartition(".")
        if fused in FUSED_PARTS and name.endswith(".weight") and name not in rank.w:
            return rank.fuse(prefix, fused)
        return rank.w.get(name)

    def tokens(self, placement: Placement) -> int:
        return placement.positions.numel()

    def positions(self, placement: Placement) -> Tensor:
        return placement.positions

    def rows(self, placement: Placement) -> Mapping[str, Rows]:
        """vLLM's metadata for this step, as row counts: a decode (T = 1) or, with
        keep_states, a uniform verify of T tokens per request; T > 1 without it is a prefill."""
        requests, tokens = placement.positions.shape
        n = requests * tokens
        if tokens == 1:
            kda = Rows(decodes=n, decode_tokens=n, spec_decodes=0, spec_decode_tokens=0)
            mla = Rows(decodes=n, decode_tokens=n)
        elif placement.keep_states:
            kda = Rows(spec_decodes=requests, spec_decode_tokens=n, spec_state_rows=requests)
            mla = Rows(decodes=requests, decode_tokens=n)
        else:
            kda = Rows(prefills=requests, prefill_tokens=n, spec_decodes=0, spec_decode_tokens=0)
            mla = Rows(prefills=requests, prefill_tokens=n)
        out: dict[str, Rows] = {}
        for layer in self.layers:
            p = f"layers.{layer.index}.self_attn"
            if layer.attention == "kda":
                out[p] = kda
            else:
                out[p] = mla
                out[f"{p}.indexer"] = Rows(**{**vars(mla), "indexer": True})
        return out

    def draft_rows(self, placement: Placement) -> Mapping[str, Rows]:
        requests, tokens = placement.positions.shape
        n = requests * tokens
        out: dict[str, Rows] = {}
        for layer in self.draft_layers:
            p = f"layers.{layer.index}.self_attn"
            out[p] = Rows(decodes=requests, decode_tokens=n)
            out[f"{p}.indexer"] = Rows(decodes=requests, decode_tokens=n, indexer=True)
        return out

    def draft_input(
        self, k: int, tokens: Tensor | None, hidden: Tensor, placement: Placement, embeds=None
    ) -> Tensor:
        p = f"layers.{self.model.mtp_layers[k]}"
        embedded = self.embed(tokens) if embeds is None else embeds
        embedded = embedded * (placement.positions != 0)[..., None].to(hidden.dtype)
        e = self.norm(f"{p}.enorm.weight", embedded)
        return torch.cat([e, self.norm(f"{p}.hnorm.weight", hidden)], dim=-1)

    def linear(self, shard: int, name: str, x: Tensor) -> Tensor:
        return self.model.ranks[shard].linear(x, name)

    def norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm_ref(x, self.model._w(name), self.g.rms_norm_eps)

    def embedding(self, shard: int) -> tuple[Tensor, int] | None:
        rank = self.model.ranks[shard]  # its TP rank's shard of the vocabulary, as `embed`'s
        table = rank.w["embed_tokens.weight"]
        return table, rank.rank * table.shape[0]

    # Stock operations.
    def embed(self, tokens: Tensor) -> Tensor:
        partials = [rank.embed(tokens) for rank in self.model.ranks]
        if self._unreduced:
            (partial,) = partials  # one shard a process (seam 6)
            return partial
        return self.model.reduce(partials)

    def expand(self, x: Tensor) -> Tensor:
        return hc_expand_ref(x, self.g.hc_mult)

    def pre(self, layer: int, site: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        p = f"layers.{layer}"
        norm = "input_layernorm" if site == "attn" else "post_attention_layernorm"
        return self.model._pre(streams, f"{p}.{site}_hc", f"{p}.{norm}.weight")

    def post(self, x: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        return hc_post_ref(x, streams, post, comb)

    def final_norm(self, streams: Tensor) -> Tensor:
        return rms_norm_ref(hc_head_ref(streams), self.model._w("norm.weight"), self.g.rms_norm_eps)

    def attention(self, shard: int, layer: int, x: Tensor, placement: Placement) -> Tensor:
        rank = self.model.ranks[shard]
        if layer >= self.g.num_hidden_layers:  # an MTP layer: its own indexer
            return rank.mla(layer, x, placement, None)[0]
        if not self.g.is_mla(layer):
            return rank.kda(layer, x, placement)
        shared = self._topk if self.g.indexer_types[layer] == "shared" else None
        out, topk = rank.mla(layer, x, placement, shared)
        if shard == self.shards[0]:
            self._topk = topk
        return out

    def mlp(self, shard: int, layer: int, x: Tensor) -> Tensor:
        rank = self.model.ranks[shard]
        dense = layer < self.g.num_hidden_layers and self.g.mlp_layer_types[layer] == "dense"
        return (rank.dense_mlp if dense else rank.moe)(layer, x)

    def kda_caches(self, shard: int, layer: int) -> tuple[Tensor, Tensor]:
        caches = self.model.ranks[shard].c
        return caches.conv[layer], caches.recurrent[layer]

    def kda_placement(self, placement: Placement, layer: int) -> KdaPlacement | None:
        tokens = placement.positions.shape[1]
        if tokens > 1 and not placement.keep_states:  # a prefill
            return None
        return KdaPlacement(placement.conv_slots, placement.conv_offset, placement.read_slots,
                            placement.write_slots, keep=tokens > 1)  # fmt: skip

    def mla_caches(self, shard: int, layer: int) -> MlaCaches | None:
        """The layer's latent pages and, for a full indexer layer, its pool pages and ring;
        None where the pools hold transformers' BF16 keys (vLLM's FP8 pages are the stage's)."""
        c = self.model.ranks[shard].c
        latent = c.latent[layer]
        if latent.dtype != torch.bfloat16:
            return None
        full = f"layers.{layer}.self_attn.indexer.wk.weight" in self.model.ranks[shard].w
        if not full:
            return MlaCaches(latent, None, None)
        pools = c.kpool[layer]
        return None if pools.dtype != torch.uint8 else MlaCaches(latent, pools, c.tail[layer])

    def mla_placement(self, placement: Placement, layer: int) -> MlaPlacement | None:
        """Any uniform step (a draft prefill of q tokens a request too: MLA keeps no state
        per token that a verify and a prefill would place apart)."""
        return MlaPlacement(  # a draft step's positions and slots are columns of its verify's
            placement.slots.reshape(-1), placement.block_table, placement.row_request,
            placement.positions.contiguous(), placement.block_table, placement.tail_rows,
        )  # fmt: skip

    def reduce(self, partials: Sequence[Tensor]) -> Tensor:
        return self.model.reduce(partials)

    def all_reduce(self, partials: Sequence[Tensor]) -> Tensor:
        return self.model.reduce(partials)  # its own sublayers' outputs are partial too

    @contextmanager
    def unreduced(self) -> Iterator[None]:
        # `attention` / `mlp` return a shard's partial output anyway; `embed` sums unless in.
        self._unreduced = True
        try:
            yield
        finally:
            self._unreduced = False

    def mailbox(self, hidden: int, max_tokens: int, dtype=torch.int16) -> Mailbox | None:
        group = self.model.group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return None
        if self._mailbox is not None:
            return self._mailbox(hidden, max_tokens, dtype)
        if self.model.device.type != "cuda":
            raise ValueError("a model across processes off GPUs exchanges through mailboxes "
                             "it is given (ReferenceBackbone(model, mailbox=...))")  # fmt: skip
        return Mailbox.symmetric(hidden, max_tokens, group, self.model.device, dtype)

    def head(self, shard: int, x: Tensor) -> Tensor:
        return self.model.ranks[shard].head(x)

    def gather(self, slices: Sequence[Tensor]) -> Tensor:
        return self.model.gather(slices)

    def route(self, shard: int, name: str, op) -> None:
        routes = self.model.ranks[shard].routes
        if op is None:
            routes.pop(name, None)
        else:
            routes[name] = op
