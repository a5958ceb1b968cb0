"""vLLM's GLM-5.3-Flash modules through glm5-runtime's backbone protocol (seam 1).

The stock operations are vLLM's own modules, called as its decoder layer calls them (mHC pre
with the fused input norm, attention, mHC post, MLP / MoE). vLLM's row-parallel modules
all-reduce inside (o_proj, down_proj, the fused MoE), so a sublayer output is already
reduced and `reduce` is the identity; inside `unreduced()` (where the fused boundaries
all-reduce through `mailbox`, TP > 1) those all-reduces are off: every decoder layer's
o_proj and down_proj `reduce_results` False and its MoE's `skip_final_all_reduce` True (the
flags vLLM's modules read at each call), restored on exit.

Weights are read by their HF names, as views of vLLM's parameters (never copies, never
modified): the fused projections (`fused_qkv_a_proj` = q_a | kv_a, `in_proj_qkvbfg_a` =
q | k | v | b | f_a | g_a, `gate_up_proj` = gate | up) are sliced at this rank's partition
sizes, FP8 block scales by whole 128-row blocks. A linear's weights are read only in a layout
`layouts.linear_layout` identifies as served; any other is None (the stage leaves that
module to vLLM) and is recorded in `refused` for one warning per layout.

A KDA or MLA layer whose stages serve a step takes no route: the runtime runs its attention
whole over its weights, its caches (`kda_caches`, `mla_caches`) and the step's neutral
placement (`kda_placement`, `mla_placement`), derived from vLLM's metadata once a step. A
route makes a module's forward run one stage op where no whole-sublayer stage serves (an
instance attribute that shadows the class's forward; removing it restores vLLM's): a whole
linear (all-reduced when the module is row-parallel and reduces), one part of a fused linear
(the other parts keep vLLM's weights), the MoE gate (cast to the gate's output dtype), or
the shared expert's MLP block.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glm5_kernels.mhc import MhcConfig
from glm5_runtime.plan import Rows, StepContext
from glm5_runtime.protocol import Layer, MlaCaches, Routing

from .indexer import indexer_constants
from .kda import KDA_CONV, KDA_MODULES, KDA_WEIGHTS, kda_constants
from .layouts import Layout, expert_layout, linear_layout
from .metadata import kda_placement
from .mla import mla_constants, mla_placement

__all__ = ["VllmBackbone", "VllmDraftBackbone", "VllmStep"]

# HF projection name -> (vLLM's fused module, its part).
FUSED = {
    "q_a_proj": ("fused_qkv_a_proj", 0),
    "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
    "q_proj": ("in_proj_qkvbfg_a", 0),
    "k_proj": ("in_proj_qkvbfg_a", 1),
    "v_proj": ("in_proj_qkvbfg_a", 2),
    "wk": ("wk_weights_proj", 0),  # the indexer's
    "weights_proj": ("wk_weights_proj", 1),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
BLOCK = 128  # FP8 block-scale granularity
FUSED_ALL_REDUCE = "GLM5_FUSED_ALL_REDUCE"  # "1": the boundaries all-reduce (TP > 1)
# The MoE stage's names for a FusedMoE's stacked expert tensors (w13 = [gate; up] per expert).
EXPERT_TENSORS = {
    "gate_up_proj": "w13_weight",
    "gate_up_proj_scale_inv": "w13_weight_scale_inv",
    "down_proj": "w2_weight",
    "down_proj_scale_inv": "w2_weight_scale_inv",
}
# The attention's fused modules and the HF projections they hold (the protocol's
# `fused_projections`): one GEMM over q_a | kv_a and over q | k | v | b | f_a | g_a is what
# vLLM runs, and what a stage serving all of them runs too (H200, one token, TP 4: one
# Projection over q_a | kv_a 7.3 us, vLLM's GEMM 9.0, a Projection per part + cat 13.3).
FUSED_ATTENTION = {
    fused: tuple(p for p, (f, _) in FUSED.items() if f == fused)
    for fused in ("fused_qkv_a_proj", "in_proj_qkvbfg_a")
}


@dataclass
class VllmStep:
    """One vLLM forward's placement, built once a step (glm5_vllm.models) and handed to every
    layer: its positions, the routing decision's view of vLLM's forward context (token
    count, per-layer metadata as row counts), vLLM's per-layer attention metadata and the
    forward context's cache slot mappings (both by layer name; empty outside a forward
    context). The stages' neutral placements are derived from them once a step (`once`): a
    step's KDA layers share one metadata object, and so do its MLA layers and indexers."""

    positions: Tensor
    context: StepContext
    metadata: Mapping[str, Any] = field(default_factory=dict)
    slot_mapping: Mapping[str, Tensor] = field(default_factory=dict)
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    def once(self, kind: str, sources: tuple, derive: Callable[[], Any]) -> Any:
        """derive(), computed once a step for each kind and identity of `sources` (the
        metadata objects it reads: held here, so no other takes one's identity while the
        step lives)."""
        key = (kind, *map(id, sources))
        if key not in self._derived:
            self._derived[key] = (sources, derive())
        return self._derived[key][1]


class VllmBackbone:
    """A loaded vLLM Glm5NextForCausalLM (this process's TP rank) as a backbone."""

    fused_projections = FUSED_ATTENTION

    def __init__(self, model: nn.Module):
        from vllm.distributed import get_tensor_model_parallel_rank

        self.model, self.decoder = model, model.model
        config = model.config
        self.config = config
        self.shards = (get_tensor_model_parallel_rank(),)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.swiglu_limit = float(config.swiglu_limit)
        self.ue8m0 = _ue8m0_activations()
        self.aux_layers, self.layers, self.draft_layers = self._layer_lists()
        blocks = [l.index for l in (*self.layers, *self.draft_layers) if l.mlp == "moe"]
        self.routing = _routing(config, [self._module(f"layers.{i}.mlp") for i in blocks])
        self._hc = config.hc_mult
        self.kda = kda_constants([self.decoder.layers[x.index].self_attn for x in self.layers
                         if x.attention == "kda"])  # fmt: skip
        # The MLA sublayer stage over vLLM's MLA layers (mla.py) and their indexers (indexer.py).
        mla = [x.index for x in (*self.layers, *self.draft_layers) if x.attention == "mla"]
        self.mla = mla_constants([self._module(f"layers.{i}.self_attn") for i in mla])
        self.indexer = indexer_constants([self._module(f"layers.{i}.self_attn.indexer")
                                          for i in mla])  # fmt: skip
        self.mhc = _mhc(config, [self.decoder.layers[x.index] for x in self.layers],
                        getattr(self.decoder, "norm", None))  # fmt: skip
        self._routes: dict[nn.Module, dict[int | None, Any]] = {}
        # Layouts no stage reads -> the modules (vLLM names) whose weights were asked for.
        self.refused: dict[Layout, list[str]] = {}

    def _layer_lists(self) -> tuple[tuple[int, ...], tuple[Layer, ...], tuple[Layer, ...]]:
        """(aux hidden-state layers, decoder layers, draft layers): the target model's
        (vLLM's drafter is a model of its own: VllmDraftBackbone)."""
        layers = tuple(
            Layer(i, layer.layer_kind, "moe" if layer._mlp_is_moe else "dense")
            for i, layer in enumerate(self.decoder.layers)
        )
        return tuple(getattr(self.decoder, "aux_hidden_state_layers", ()) or ()), layers, ()

    # Weights.
    def _module(self, path: str) -> nn.Module | None:
        root = self.model if path.startswith("lm_head") else self.decoder
        try:
            return root.get_submodule(path)
        except AttributeError:
            return None

    def _locate(self, name: str) -> tuple[nn.Module, int | None, str] | None:
        """(module, fused part or None, parameter name) of an HF weight name."""
        base, _, leaf = name.rpartition(".")
        parent, _, proj = base.rpartition(".")
        if proj in FUSED:
            fused, part = FUSED[proj]
            module = self._module(f"{parent}.{fused}")
            if module is None:
                return None
            return module, part, leaf
        module = self._module(base)
        return None if module is None else (module, None, leaf)

    def weight(self, shard: int, name: str) -> Tensor | None:
        for hf, held in KDA_MODULES.items():
            name = name.replace(hf, held)
        base, _, leaf = name.rpartition(".")
        if base.endswith(".mlp.experts") and leaf in EXPERT_TENSORS:
            return self._expert_tensor(base, EXPERT_TENSORS[leaf])
        kda = self._kda_weight(name)
        if kda is not None:
            return kda
        layer, _, site = base.rpartition(".")
        if site in ("attn_hc", "ffn_hc"):  # vLLM keeps them on the layer: hc_attn_fn, ...
            module = self._module(layer)
            tensor = getattr(module, f"hc_{site[:-3]}_{leaf}", None)
            return tensor.data if isinstance(tensor, Tensor) else None
        found = self._locate(name)
        if found is None:
            return None
        module, part, leaf = found
        tensor = getattr(module, leaf, None)
        if not isinstance(tensor, Tensor):
            return None
        if leaf in ("weight", "weight_scale_inv") and _is_linear(module):
            layout = linear_layout(module)
            if not layout.served:
                self._refuse(layout, module)
                return None
        tensor = tensor.data
        if part is None:
            return tensor
        start, end = _bounds(module, part)
        if leaf != "weight":  # a block scale: whole 128-row blocks only
            if start % BLOCK or (end % BLOCK and end != _rows(module)):
                return None
            return tensor[start // BLOCK : -(-end // BLOCK)]
        return tensor[start:end]

    def _kda_weight(self, name: str) -> Tensor | None:
        """A KDA layer's small weights: dt_bias and A_log [H] held by the layer, the conv weight
        [3C', 1, W] as q | k | v (a concatenation of vLLM's three conv modules, as vLLM's
        own `_merged_conv_weight`: the one weight read as a copy)."""
        attn, _, leaf = name.partition(".self_attn.")
        module = self._module(f"{attn}.self_attn") if leaf else None
        if module is None or not all(hasattr(module, c) for c in KDA_CONV):
            return None
        if leaf in KDA_WEIGHTS:  # A_log may be vLLM's older [1, 1, H, 1]: a flat view
            return getattr(module, KDA_WEIGHTS[leaf]).data.reshape(-1)
        if leaf == "conv1d.weight":
            return torch.cat([getattr(module, c).weight.data for c in KDA_CONV])
        return None

    def _expert_tensor(self, path: str, attr: str) -> Tensor | None:
        """A FusedMoE's stacked expert tensor, in a layout the MoE stage reads or None."""
        module = self._module(path)
        if module is None:
            return None
        layout = expert_layout(module)
        if not layout.served:
            self._refuse(layout, module)
            return None
        tensor = getattr(getattr(module, "routed_experts", module), attr, None)
        return tensor.data if isinstance(tensor, Tensor) else None

    def _refuse(self, layout: Layout, module: nn.Module) -> None:
        names = self.refused.setdefault(layout, [])
        name = next((n for n, m in self.model.named_modules() if m is module), repr(module))
        if name not in names:
            names.append(name)

    def warn_refused(self, logger) -> None:
        """One warning per refused layout, naming its backend and modules."""
        for layout, names in self.refused.items():
            logger.warning(
                "GLM-5.3-Flash specialized decode: %s is a layout no stage reads; vLLM's own "
                "op runs for %s", layout, ", ".join(names),
            )  # fmt: skip

    # The step.
    def tokens(self, placement: VllmStep) -> int:
        return placement.context.tokens

    def positions(self, placement: VllmStep) -> Tensor:
        return placement.positions

    def rows(self, placement: VllmStep) -> Mapping[str, Rows]:
        return placement.context.rows

    def draft_rows(self, placement: VllmStep) -> Mapping[str, Rows]:
        return placement.context.rows

    def embedding(self, shard: int) -> tuple[Tensor, int] | None:
        """The vocab-parallel embedding's rows of this rank's original-vocabulary shard (a view
        of vLLM's weight) and their first token id, where the embedding is unquantized BF16
        with no added vocabulary (LoRA tokens)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        module = self.decoder.embed_tokens
        weight = getattr(module, "weight", None)
        idx = getattr(module, "shard_indices", None)
        if (not isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
                or not isinstance(weight, Tensor) or weight.dtype != torch.bfloat16
                or weight.dim() != 2 or idx is None
                or idx.added_vocab_end_index != idx.added_vocab_start_index):  # fmt: skip
            return None
        rows = idx.org_vocab_end_index - idx.org_vocab_start_index
        return weight.data[:rows], int(idx.org_vocab_start_index)

    # Stock operations (vLLM's modules).
    def embed(self, tokens: Tensor) -> Tensor:
        return self.decoder.embed_tokens(tokens)

    def expand(self, x: Tensor) -> Tensor:
        from vllm.model_executor.layers.mhc import hc_expand

        return hc_expand(x, self._hc)

    def pre(self, layer: int, site: str, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        m = self.decoder.layers[layer]
        norm = m.input_layernorm if site == "attn" else m.post_attention_layernorm
        fn, scale, base = (getattr(m, f"hc_{site}_{p}") for p in ("fn", "scale", "base"))
        post, comb, x = m.hc_pre(
            streams, fn, scale, base, norm_weight=norm.weight.data,
            norm_eps=norm.variance_epsilon,
        )  # fmt: skip
        return x, post, comb

    def post(self, x: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        return self.decoder.layers[0].hc_post(x, streams, post, comb)

    def final_norm(self, streams: Tensor) -> Tensor:
        from vllm.model_executor.layers.mhc import hc_contract

        return self.decoder.norm(hc_contract(streams, self._hc))

    def attention(self, shard: int, layer: int, x: Tensor, placement: VllmStep) -> Tensor:
        module = self.decoder.layers[layer].self_attn
        return module(hidden_states=x, positions=placement.positions)

    def kda_caches(self, shard: int, layer: int) -> tuple[Tensor, Tensor]:
        conv, recurrent = self.decoder.layers[layer].self_attn.kv_cache
        return conv, recurrent

    def kda_placement(self, placement: VllmStep, layer: int):
        """From the step's GDN metadata for the layer (one object for every KDA layer of a
        step: placed once)."""
        md = placement.metadata.get(self.decoder.layers[layer].self_attn.prefix)
        return None if md is None else placement.once("kda", (md,), lambda: kda_placement(md))

    def mla_caches(self, shard: int, layer: int) -> MlaCaches | None:
        """The latent pages vLLM's MLA attention holds [blocks, block_size, L] BF16, its
        indexer's pool pages and ring, and the model-wide top-k buffer the selection is also
        written to (vLLM's MTP drafter reuses its step 0's from there: `set_skip_topk`);
        None where they are not bound in the stage's layouts."""
        attn = self._module(f"layers.{layer}.self_attn")
        latent = getattr(attn.mla_attn.mla_attn, "kv_cache", None)
        ix = attn.indexer
        pools = getattr(ix.k_cache, "kv_cache", None)
        ring = getattr(ix.tail_cache, "kv_cache", None)
        tensors = isinstance(latent, Tensor) and isinstance(pools, Tensor)
        if not (tensors and isinstance(ring, Tensor)) or self.indexer is None:
            return None
        if (latent.dtype != torch.bfloat16 or latent.dim() != 3 or pools.dim() != 3
                or pools.shape[1] * ix.index_kpool != self.indexer.block_size
                or ring.dim() != 4):  # fmt: skip
            return None
        buffer = getattr(ix, "topk_indices_buffer", None)  # the drafter's later steps read it
        return MlaCaches(latent, pools, ring, buffer if isinstance(buffer, Tensor) else None)

    def mla_placement(self, placement: VllmStep, layer: int):
        """From the step's metadata for the layer's MLA attention and its indexer's pools and
        ring, and the latent slot mapping (one set of objects for every MLA layer of a step:
        placed once)."""
        attn = self._module(f"layers.{layer}.self_attn")
        # vLLM skips this indexer now (its MTP drafter after step 0): the step attends the
        # selection step 0 left in the top-k buffer, compacted to these rows.
        reuse = bool(getattr(attn.mla_attn, "skip_topk", False))
        core, ix = attn.mla_attn.mla_attn, attn.indexer
        md = placement.metadata.get(core.layer_name)
        latent, ring = getattr(core, "kv_cache", None), getattr(ix.tail_cache, "kv_cache", None)
        if not (isinstance(latent, Tensor) and isinstance(ring, Tensor) and latent.dim() == 3
                and ring.dim() == 4):  # fmt: skip
            return None  # not bound in the stage's layouts (`mla_caches`)
        if md is not None and latent.shape[1] != getattr(md, "block_size", None):
            return None  # the block table's blocks are not the cache tensor's
        sources = (md, placement.metadata.get(ix.k_cache.prefix),
                   placement.metadata.get(ix.tail_cache.prefix),
                   placement.slot_mapping.get(core.layer_name), placement.positions)  # fmt: skip

        buffer, ixc = getattr(ix, "topk_indices_buffer", None), self.indexer
        if not isinstance(buffer, Tensor) or ixc is None:
            return None
        width = ixc.topk + (ixc.kpool - 1 if ixc.tail and ixc.kpool > 1 else 0)

        def derive():
            place = mla_placement(*sources, ring.shape[2])
            if place is None:
                return None
            n = place.request.shape[0]
            if reuse:
                return replace(place, selection=buffer[:n, :width])
            # vLLM's rows hold -1 past the selection's columns (its backend and the MTP
            # drafter's compaction read whole rows): once a step, as its indexer op does.
            buffer[:n, width:] = -1
            return place

        kind = f"mla ring {ring.shape[2]}" + (" reused" if reuse else "")
        return placement.once(kind, sources, derive)

    def mlp(self, shard: int, layer: int, x: Tensor) -> Tensor:
        return self.decoder.layers[layer].mlp(x)

    def reduce(self, partials: Sequence[Tensor]) -> Tensor:
        (out,) = partials  # one rank per process; vLLM's modules reduced it already
        return out

    def all_reduce(self, partials: Sequence[Tensor]) -> Tensor:
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.distributed import tensor_model_parallel_all_reduce as all_reduce

        (out,) = partials  # one rank per process: a stage's partial output
        return all_reduce(out) if get_tensor_model_parallel_world_size() > 1 else out

    def _reduce_flags(self) -> list[tuple[Any, str, bool]]:
        """(holder, flag, its value that leaves the output TP-partial) of every all-reduce
        inside the decoder's embedding and its layers' sublayers."""
        flags = [(self.decoder.embed_tokens, "reduce_results", False)]
        for layer in self.decoder.layers:
            flags.append((layer.self_attn.o_proj, "reduce_results", False))
            if layer._mlp_is_moe:
                flags.append((layer.mlp.experts.moe_config, "skip_final_all_reduce", True))
            else:
                flags.append((layer.mlp.down_proj, "reduce_results", False))
        return flags

    @contextmanager
    def unreduced(self) -> Iterator[None]:
        flags = self._reduce_flags()
        saved = [getattr(holder, name) for holder, name, _ in flags]
        try:
            for holder, name, value in flags:
                setattr(holder, name, value)
            yield
        finally:
            for (holder, name, _), value in zip(flags, saved, strict=True):
                setattr(holder, name, value)

    def mailbox(self, hidden: int, max_tokens: int, dtype=torch.int16):
        """A mailbox on torch symmetric memory over vLLM's TP group; None at TP 1, and unless
        GLM5_FUSED_ALL_REDUCE=1: the fused all-reduce has not run on GPUs yet, so vLLM's
        all-reduce stays the default until it has. Refused (an error: the boundary stage
        then runs stock) where a sublayer's all-reduce cannot be left to it: an MoE kernel
        that reduces inside, sequence-parallel MoE."""
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        if get_tensor_model_parallel_world_size() == 1:
            return None
        if os.environ.get(FUSED_ALL_REDUCE) != "1":
            return None
        problems = []
        for i, layer in enumerate(self.decoder.layers):
            if not layer._mlp_is_moe:
                continue
            runner = layer.mlp.experts
            if getattr(runner, "_fused_output_is_reduced", False):
                problems.append(f"layer {i}: its MoE kernel all-reduces inside")
            if getattr(runner.moe_config, "is_sequence_parallel", False):
                problems.append(f"layer {i}: sequence-parallel MoE")
        if problems:
            raise ValueError("no fused all-reduce: " + "; ".join(problems))
        from glm5_comm import Mailbox

        group = get_tp_group().device_group
        return Mailbox.symmetric(hidden, max_tokens, group=group, dtype=dtype)

    def head(self, shard: int, x: Tensor) -> Tensor:
        head = self.model.lm_head
        return head.quant_method.apply(head, x).float()

    def gather(self, slices: Sequence[Tensor]) -> Tensor:
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.distributed import tensor_model_parallel_all_gather as all_gather

        (logits,) = slices
        if get_tensor_model_parallel_world_size() > 1:
            logits = all_gather(logits)
        return logits[..., : self.vocab_size]  # vocab padding off

    def draft_input(self, k, tokens, hidden, placement, embeds=None) -> Tensor:
        raise RuntimeError("glm5-vllm: the target model has no MTP layers (VllmDraftBackbone)")

    def linear(self, shard: int, name: str, x: Tensor) -> Tensor:
        module = self._module(name.removesuffix(".weight"))
        out = module(x)
        return out[0] if isinstance(out, tuple) else out

    def norm(self, name: str, x: Tensor) -> Tensor:
        return self._module(name.removesuffix(".weight"))(x)

    # Routes.
    def route(self, shard: int, name: str, op: Any) -> None:
        if name.endswith(".weight"):
            found = self._locate(name)
            if found is None:
                raise KeyError(f"glm5-vllm: no vLLM module holds {name}")
            module, part, _ = found
        else:
            module, part = self._module(name), None
            if module is None:
                raise KeyError(f"glm5-vllm: no vLLM module {name}")
        ops = self._routes.setdefault(module, {})
        if op is None:
            ops.pop(part, None)
        else:
            ops[part] = op
        if ops:
            module.forward = _routed_forward(module, dict(ops))
        else:
            module.__dict__.pop("forward", None)  # vLLM's own forward again
            del self._routes[module]


class VllmDraftBackbone(VllmBackbone):
    """A loaded vLLM Glm5NextMTP (its MTP layers: eh_proj over [enorm(embedding),
    hnorm(hidden)], then an MLA + MoE block, then the shared head norm) as a backbone whose
    `draft_layers` are those layers, named as in the checkpoint (`layers.{45 + k}.*`)."""

    def __init__(self, model: nn.Module):
        predictor = model.model
        start = predictor.mtp_start_layer_idx
        self._mtp = {start + k: layer for k, layer in enumerate(predictor._mtp_layers)}
        super().__init__(model)

    def _layer_lists(self):
        draft = tuple(
            Layer(i, "mla", "moe" if m.mtp_block._mlp_is_moe else "dense")
            for i, m in self._mtp.items()
        )
        return (), (), draft

    def _module(self, path: str) -> nn.Module | None:
        head, _, rest = path.partition(".")
        index, _, rest = rest.partition(".")
        if head != "layers" or not index.isdigit() or int(index) not in self._mtp:
            return super()._module(path)  # embed_tokens
        layer = self._mtp[int(index)]
        own = rest.split(".")[0] in ("eh_proj", "enorm", "hnorm", "shared_head")
        try:
            return (layer if own else layer.mtp_block).get_submodule(rest)
        except AttributeError:
            return None

    def draft_input(self, k, tokens, hidden, placement, embeds=None) -> Tensor:
        """cat([enorm(embedding zeroed at position 0), hnorm(hidden)]): on the GPU vLLM's
        own fused kernel (as its MTP layer calls it); elsewhere the layer's two RMSNorm
        modules (the kernel is Triton-on-GPU only)."""
        layer = self.decoder._mtp_layers[k]
        if embeds is None:
            embeds = self.decoder.embed_tokens(tokens)
        if embeds.is_cuda:
            from vllm.models.glm5next.nvidia.ops.fused_eh_norm import fused_eh_norm

            return fused_eh_norm(
                placement.positions, embeds, hidden, layer.enorm.weight, layer.hnorm.weight,
                layer.enorm.variance_epsilon,
            )  # fmt: skip
        keep = (placement.positions != 0)[..., None].to(embeds.dtype)
        return torch.cat([layer.enorm(embeds * keep), layer.hnorm(hidden)], dim=-1)

    def mailbox(self, hidden: int, max_tokens: int, dtype=torch.int16):
        # The runtime's draft could sum in fused exchanges (EmbedNorm, AllReduceNorm), but
        # `unreduced()` does not yet switch off the MTP modules' all-reduces: vLLM's stay.
        return None

    def attention(self, shard: int, layer: int, x: Tensor, placement: VllmStep) -> Tensor:
        block = self._mtp[layer].mtp_block
        return block.self_attn(hidden_states=x, positions=placement.positions)

    def mlp(self, shard: int, layer: int, x: Tensor) -> Tensor:
        return self._mtp[layer].mtp_block.mlp(x)


def _routed_forward(module: nn.Module, ops: dict[int | None, Any]):
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.distributed import tensor_model_parallel_all_reduce as all_reduce
    from vllm.model_executor.layers.linear import LinearBase

    tp = get_tensor_model_parallel_world_size()
    linear = isinstance(module, (LinearBase, nn.Linear))  # nn.Linear: the MTP eh_proj
    returns_bias = isinstance(module, LinearBase) and getattr(module, "return_bias", True)
    out_dtype = getattr(module, "out_dtype", None)

    def reduce() -> bool:
        """Whether vLLM's module would all-reduce its output now (`unreduced` turns the
        flags it reads off while a planned step runs)."""
        if tp == 1:
            return False
        if linear:
            return getattr(module, "reduce_results", False)
        return getattr(module.down_proj, "reduce_results", False)  # an MLP block

    def finish(y: Tensor):
        if reduce():
            y = all_reduce(y)
        if out_dtype is not None:
            y = y.to(out_dtype)
        return (y, None) if returns_bias else y

    if None in ops:
        op = ops[None]
        return lambda x: finish(op(x))
    sizes = list(module.output_partition_sizes)

    def fused(x: Tensor):
        parts, start = [], 0
        for part, size in enumerate(sizes):
            op = ops.get(part)
            w = module.weight[start : start + size]
            parts.append(op(x) if op is not None else F.linear(x, w))
            start += size
        return finish(torch.cat(parts, dim=-1))

    return fused


def _routing(config, blocks: list[nn.Module | None]) -> Routing | None:
    """GLM's routing where vLLM runs it as the MoE stage does (sigmoid scores with the
    correction bias, one expert group, renormalized, the shared expert its own module, no
    expert or sequence parallelism, no redundant experts (EPLB: ids would not index the
    weights)); None otherwise: the MoE stage then stays off."""
    glm = (
        getattr(config, "scoring_func", "sigmoid") == "sigmoid"
        and getattr(config, "topk_method", "noaux_tc") == "noaux_tc"
        and getattr(config, "n_group", 1) in (1, None)
        and getattr(config, "norm_topk_prob", True)
    )

    def served(block) -> bool:
        return (
            block is not None
            and not getattr(block, "is_sequence_parallel", False)
            and getattr(block, "ep_size", 1) == 1
            and not getattr(block, "enable_eplb", False)
            and block.shared_experts is not None
            and getattr(block.gate, "e_score_correction_bias", None) is not None
        )

    if not (glm and all(served(b) for b in blocks)):
        return None
    return Routing(int(config.num_experts_per_tok), float(config.routed_scaling_factor))


def _mhc(config, layers: list[nn.Module], norm: nn.Module | None) -> MhcConfig | None:
    """The mHC constants where vLLM's decoder layers run GLM's boundaries with one norm eps
    (input, post-attention and final norms) and its post multiplier; None otherwise (then
    the boundaries stay vLLM's)."""
    first = layers[0] if layers else None
    if first is None or getattr(first, "hc_attn_fn", None) is None or norm is None:
        return None
    eps = {n.variance_epsilon for x in layers for n in (x.input_layernorm,
                                                          x.post_attention_layernorm)}  # fmt: skip
    eps.add(norm.variance_epsilon)
    if len(eps) != 1:
        return None
    return MhcConfig(
        hc=int(first.n), hidden=int(config.hidden_size), rms_eps=float(first.rms_norm_eps),
        hc_eps=float(first.hc_eps), sinkhorn_iters=int(first.mhc_sinkhorn_iterations),
        norm_eps=float(eps.pop()), post_mult=float(first.mhc_post_mult_value),
    )  # fmt: skip


def _is_linear(module: nn.Module) -> bool:
    """A linear (vLLM's, the MTP's nn.Linear) or the LM head: weights a stage reads as GEMM
    operands, so only in an identified layout."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return isinstance(module, (LinearBase, nn.Linear, VocabParallelEmbedding))


def _bounds(module: nn.Module, part: int) -> tuple[int, int]:
    sizes = list(module.output_partition_sizes)
    start = sum(sizes[:part])
    return start, start + sizes[part]


def _rows(module: nn.Module) -> int:
    return sum(module.output_partition_sizes)


def _ue8m0_activations() -> bool:
    """Whether vLLM rounds FP8 activation scales to powers of two (DeepGEMM's E8M0)."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

        return bool(is_deep_gemm_e8m0_used())
    except Exception:  # no DeepGEMM on this host: vLLM uses FP32 scales
        return False
