"""The backbone protocol (seam 1): what the specialized decode needs from a GLM-5.3-Flash
backbone. Two implementations: the reference backbone (`glm5_runtime.reference.backbone`)
and glm5-vllm's adapter over vLLM's modules.

Tensor parallelism: a process computes one or more TP `shards` (vLLM: its own rank; the
reference simulates several). A stage's sublayer outputs are per shard and TP-partial;
`all_reduce` sums them. The backbone's own `attention` / `mlp` outputs go through `reduce`
(the same sum where they are partial; the identity where its modules all-reduce inside, as
vLLM's do). A backbone's own step object (`placement`: cache slots, block tables, metadata)
passes through the runtime untouched; `rows(placement)` gives the neutral row counts the
routing decision reads.

TP ranks in other processes (seam 6): where `mailbox` gives one, the fused boundaries
all-reduce the sublayers' outputs themselves, through it: the runtime runs `embed`,
`attention` and `mlp` inside `unreduced()` (this process's one shard's TP-partial output, no
all-reduce) and hands the partial to glm5-comm's `AllReduceBoundary`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from glm5_kernels.mhc import MhcConfig

from .plan import Rows

if TYPE_CHECKING:
    from glm5_comm import Mailbox

__all__ = [
    "Backbone",
    "Indexer",
    "Kda",
    "KdaPlacement",
    "Layer",
    "Mla",
    "MlaCaches",
    "MlaPlacement",
    "Route",
    "Routing",
]


@dataclass(frozen=True)
class Layer:
    """A decoder layer: its index, attention kind ("kda" | "mla") and MLP kind
    ("dense" | "moe")."""

    index: int
    attention: str
    mlp: str


@dataclass(frozen=True)
class Routing:
    """The MoE routing GLM-5.3-Flash uses, which the MoE stage implements: sigmoid scores, a
    correction bias that only steers the choice, top_k of the routed experts in one group,
    the chosen scores renormalized and × routed_scaling."""

    top_k: int
    routed_scaling: float


@dataclass(frozen=True)
class Kda:
    """What the fused KDA sublayer needs besides weights, caches and placement: the forget
    gate's lower bound (None: the softplus gate) and the output gated RMSNorm's eps."""

    lower_bound: float | None
    eps: float


@dataclass(frozen=True)
class Mla:
    """What the MLA sublayer stage needs besides weights, caches and placement: the per-head
    split of kv_b_proj's rows (nope key dims, then value dims), the softmax scale and the
    q_a / kv_a RMSNorms' eps (None: norms the stage's latent write cannot take; MLA then
    stays stock)."""

    nope_dim: int
    v_dim: int
    scale: float
    norm_eps: float | None = None


@dataclass(frozen=True)
class Indexer:
    """What the indexer's pool write and selection stages need: its heads and head dim,
    tokens a pool, tokens selected, whether the incomplete last pool is always selected (its
    kpool - 1 tokens follow), the most pools a request's block table holds, and the cache's
    tokens a block; `key_norm_eps`: the key LayerNorm's eps (the pool write norms the key
    from one FP32 projection of wk | compress gate | weights_proj), None where the indexers'
    weights are not in that form (MLA then stays stock)."""

    heads: int
    head_dim: int
    kpool: int
    topk: int
    tail: bool
    max_pools: int
    block_size: int
    key_norm_eps: float | None = None


@dataclass(frozen=True)
class KdaPlacement:
    """A step's KDA cache placement in neutral tensors (seam 5), R requests x T tokens:
    conv_slots [R] (the request's conv-state row) and conv_offset [R] (its W-1 window's first
    column: accepted - 1 after a verify); read_slots [R] (the recurrent state it starts from)
    and write_slots [R, T] (where the state after each token goes, -1: not stored); `keep`:
    every token's state (a verify), else the last only."""

    conv_slots: Tensor
    conv_offset: Tensor
    read_slots: Tensor
    write_slots: Tensor
    keep: bool

    def kwargs(self) -> dict:
        """The fused KDA stage's placement keywords."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass(frozen=True)
class MlaPlacement:
    """A step's MLA cache placement in neutral tensors (seam 5), R requests x T tokens, N =
    R * T rows: slots [N] (each row's latent cache slot, block * block_size + offset),
    block_table [R, B] (the latent pages of each request), request [N] (each row's request),
    positions [R, T]; the indexer's: pool_table [R, B'] (its pool pages' blocks) and
    tail_rows [R] (each request's ring row, -1: a padding request, which writes nothing).
    `selection` [N, W]: token positions the step's layers attend without running their
    indexers (vLLM's MTP drafter after its step 0 reuses that step's), else None."""

    slots: Tensor
    block_table: Tensor
    request: Tensor
    positions: Tensor
    pool_table: Tensor
    tail_rows: Tensor
    selection: Tensor | None = None


@dataclass(frozen=True)
class MlaCaches:
    """An MLA layer's caches as the MLA sublayer stage writes and reads them: latent pages
    [blocks, block_size, L] BF16; the indexer's pool pages [blocks, S, hd + 4] uint8 (FP8 keys
    and their scales, vLLM's layout) and tail ring [rows, 2, ring, hd] BF16 (None for a
    shared-indexer layer, which keeps none); `selected`: where the backbone's own paths read
    the last selection from ([rows, >= W] int32, vLLM's model-wide top-k buffer: its MTP
    drafter's later steps reuse it), the step's rows written there too; None: nowhere."""

    latent: Tensor
    pools: Tensor | None
    ring: Tensor | None
    selected: Tensor | None = None


class Route(Protocol):
    """A specialized op standing in for a stock one: [M, K] -> [M, N], for M it supports."""

    def supports(self, m: int) -> bool: ...

    def __call__(self, x: Tensor) -> Tensor: ...


@runtime_checkable
class Backbone(Protocol):
    layers: Sequence[Layer]
    shards: Sequence[int]
    hidden_size: int
    vocab_size: int  # the logits' columns (a shard's head may hold padding past them)
    swiglu_limit: float
    ue8m0: bool  # FP8 activation scales rounded to powers of two (DeepGEMM's E8M0 mode)
    # The MoE layers' routing where it is GLM's (`Routing`), None where the backbone routes
    # otherwise (another scoring, grouped top-k, expert parallelism): then the MoE stage
    # leaves every MoE layer stock. An MoE layer's weights: its router `mlp.gate.weight`
    # [E, D] BF16 and `mlp.gate.e_score_correction_bias` [E]; `mlp.experts.gate_up_proj`
    # [E, 2I, D] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
    # [E, D, I], block-FP8 with `<name>_scale_inv` beside; the shared expert as an MLP.
    routing: Routing | None
    # The mHC constants where the backbone's sublayer boundaries are GLM's (post; pre with
    # Sinkhorn; the input RMSNorm; the final collapse is the streams' mean, then `norm.weight`),
    # with one norm eps throughout; None keeps every boundary stock. A boundary's weights:
    # `layers.{i}.{attn,ffn}_hc.{fn,scale,base}` and `layers.{i}.{input,post_attention}_
    # layernorm.weight` (replicated: any shard's).
    mhc: MhcConfig | None
    # Where the backbone's KDA layers take the fused KDA sublayer (seam 5: the layer loop
    # runs it whole, its state through `kda_caches` and `kda_placement`): its weights under
    # `layers.{i}.self_attn.`: `in_proj_qkvbfg_a.weight` (q | k | v | b | f_a | g_a rows,
    # BF16: the projection's), `forget_gate.f_b_proj.weight`, `g_b_proj.weight`,
    # `o_proj.weight`, `conv1d.weight`, `forget_gate.dt_bias`, `forget_gate.A_log`,
    # `o_norm.weight`. None: KDA stays stock.
    kda: Kda | None
    # Where the backbone's MLA layers take the MLA sublayer stage (seam 5: the layer loop runs
    # it whole, `sublayers.mla_attention`, on `mla_caches` at `mla_placement`): with
    # `Mla.norm_eps` given, its weights under `layers.{i}.self_attn.`: the fused
    # `fused_qkv_a_proj.weight` (q_a | kv_a rows, BF16), `q_a_layernorm.weight`,
    # `kv_a_layernorm.weight`, `q_b_proj.weight`, `kv_b_proj.weight` (per head: nope key rows,
    # then value rows; BF16 or block-FP8), `o_proj.weight`. None: MLA stays stock.
    mla: Mla | None
    # The indexer's constants for the MLA sublayer's pool write and selection; a full
    # indexer layer's weights under `layers.{i}.self_attn.indexer.`: `wq_b.weight`,
    # `wk.weight`, `index_kpool_compress_gate`, `weights_proj.weight` (BF16 [N, hidden]: one
    # FP32 projection of the three), `k_norm.weight` / `.bias`, `index_kpool_compress_ape`; a
    # shared-indexer layer has none and takes the last full layer's selection. None (or no
    # `Indexer.key_norm_eps`): MLA stays stock.
    indexer: Indexer | None
    aux_layers: tuple[int, ...]  # layers whose hidden states a drafter collects
    # Attention weights holding several HF projections in one tensor, as the backbone runs
    # them: fused name (under a layer's `self_attn.`) -> the projections in it a stage may
    # serve. A stage serving all of those serves the fused weight whole, with one op
    # (`weight` / `route` of `layers.{i}.self_attn.<fused>.weight`; the op computes every
    # part, as the backbone's module does). Empty where the projections are kept apart.
    fused_projections: Mapping[str, tuple[str, ...]]

    def weight(self, shard: int, name: str) -> Tensor | None:
        """Shard `shard`'s tensor of HF name `name` (FP8 weights: `<name>_scale_inv`
        beside), None when the checkpoint has none."""

    def tokens(self, placement: Any) -> int:
        """The step's token rows (requests x tokens per request)."""

    def positions(self, placement: Any) -> Tensor:
        """The step's token positions, one a token row (any shape of `tokens` elements)."""

    def rows(self, placement: Any) -> Mapping[str, Rows]:
        """Each layer's step metadata as row counts."""

    def embedding(self, shard: int) -> tuple[Tensor, int] | None:
        """Shard `shard`'s vocab-parallel embedding rows [V, D] BF16 and the first token id
        they hold (ids outside them: zero rows, summed over the shards by the all-reduce),
        as the `embed` stage reads them; None where the embedding is not such a table."""

    # Stock operations.
    def embed(self, tokens: Tensor) -> Tensor:
        """[R, T] token ids -> [R, T, D] reduced embeddings."""

    def expand(self, x: Tensor) -> Tensor:
        """[N, D] -> mHC residual streams [N, hc, D]."""

    def pre(self, layer: int, site: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """mHC pre of sublayer `site` ("attn" | "ffn") and its input norm:
        (normed input [N, D], post, comb)."""

    def post(self, x: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """mHC post of a reduced sublayer output x [N, D] into the streams."""

    def final_norm(self, streams: Tensor) -> Tensor:
        """The streams' head and the final norm: [N, D]."""

    def attention(self, shard: int, layer: int, x: Tensor, placement: Any) -> Tensor:
        """Shard's TP-partial attention output, x [R, T, D]."""

    def mlp(self, shard: int, layer: int, x: Tensor) -> Tensor:
        """Shard's TP-partial MLP output (dense or MoE), x [R, T, D]."""

    def kda_caches(self, shard: int, layer: int) -> tuple[Tensor, Tensor]:
        """KDA layer `layer`'s conv state [slots, >= W-2+q, 3C'] BF16 (channels last) and
        recurrent state [slots, H, V, K] FP32 of shard `shard`, updated in place."""

    def kda_placement(self, placement: Any, layer: int) -> KdaPlacement | None:
        """The step's neutral KDA placement for `layer` (seam 5), derived once a step; None
        where the step is not a plain decode or a uniform verify (the sublayer runs stock)."""

    def mla_caches(self, shard: int, layer: int) -> MlaCaches | None:
        """MLA layer `layer`'s caches of shard `shard` (written in place), None where they
        are in a layout the MLA sublayer stage does not read (an FP8 latent cache, BF16
        pool keys): the sublayer then runs stock."""

    def mla_placement(self, placement: Any, layer: int) -> MlaPlacement | None:
        """The step's neutral MLA placement for `layer`, derived once a step; None where the
        step is not a plain decode or a uniform verify (the sublayer runs stock)."""

    def reduce(self, partials: Sequence[Tensor]) -> Tensor:
        """The reduced output of the shards' `attention` / `mlp` outputs: their TP
        all-reduce where they are partial, the identity where the backbone's modules
        all-reduce inside (vLLM's)."""

    def all_reduce(self, partials: Sequence[Tensor]) -> Tensor:
        """The TP all-reduce of a stage's per-shard partial outputs (a whole sublayer the
        layer loop ran itself)."""

    def unreduced(self) -> AbstractContextManager[None]:
        """Inside it, `embed`, `attention` and `mlp` return this process's TP-partial
        output, never all-reduced across processes (`embed`: its vocab shard's rows, zeros
        for tokens outside it; vLLM: its vocab-parallel embedding's, row-parallel layers'
        and MoE blocks' all-reduce off); the runtime enters it only where `mailbox` gave a
        mailbox."""

    def mailbox(
        self, hidden: int, max_tokens: int, dtype: torch.dtype = torch.int16
    ) -> Mailbox | None:
        """This process's mailbox over the processes holding the TP ranks (glm5-comm's: rows
        of `hidden` values, their bits as `dtype`, int16 for BF16 rows by default, int32 for
        FP32; every process asks alike, before CUDA-graph capture): the fused boundaries
        all-reduce and the logits gather through such. None where this process holds every
        shard (nothing to exchange)."""

    def head(self, shard: int, x: Tensor) -> Tensor:
        """Shard's vocab slice of the logits, FP32."""

    def gather(self, slices: Sequence[Tensor]) -> Tensor:
        """The logits all-gather."""

    # The MTP draft layer(s): MLA + MoE blocks without mHC.
    draft_layers: Sequence[Layer]

    def draft_rows(self, placement: Any) -> Mapping[str, Rows]:
        """The draft step's metadata as row counts (a draft prefill of q tokens per request
        is filed like a uniform verify, as vLLM's FULL-graph drafter builds it)."""

    def draft_input(
        self, k: int, tokens: Tensor | None, hidden: Tensor, placement: Any, embeds=None
    ) -> Tensor:
        """MTP layer k's eh_proj input [R, T, 2D]: enorm(embedding, zeroed at position 0)
        beside hnorm(previous hidden states); `embeds`, when given, are the embedding."""

    def linear(self, shard: int, name: str, x: Tensor) -> Tensor:
        """Shard's stock linear of weight `name` (routes apply)."""

    def norm(self, name: str, x: Tensor) -> Tensor:
        """RMSNorm with weight `name` and the model's eps."""

    def route(self, shard: int, name: str, op: Route | Callable | None) -> None:
        """Run `op` for the stock op `name` of shard `shard` (None: stock again): one stock
        GEMM (or the shared expert's MLP) substituted inside a sublayer no whole-sublayer
        stage serves. Names are the HF weight of a linear, an MLP's prefix, or a router's
        weight."""
