"""vLLM's per-layer attention metadata as the runtime's neutral row counts (`Rows`), a
step's `StepContext`, metadata and slot mappings from vLLM's forward context, and the KDA
layers' neutral placement from their metadata."""

from __future__ import annotations

from typing import Any

from glm5_runtime.plan import Rows, StepContext
from glm5_runtime.protocol import KdaPlacement

__all__ = ["attention_metadata", "kda_placement", "rows_of", "slot_mappings", "step_context"]


def rows_of(md: Any) -> Rows:
    """One layer's metadata: GDN / KDA (speculative fields), MLA, or the DSA indexer's."""
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata

    spec = hasattr(md, "num_spec_decodes")
    state = getattr(md, "spec_state_indices_tensor", None)
    return Rows(
        prefills=md.num_prefills,
        prefill_tokens=getattr(md, "num_prefill_tokens", 0),
        decodes=md.num_decodes,
        decode_tokens=md.num_decode_tokens,
        spec_decodes=md.num_spec_decodes if spec else None,
        spec_decode_tokens=md.num_spec_decode_tokens if spec else None,
        spec_state_rows=None if state is None else state.shape[0],
        indexer=isinstance(md, DeepseekV32IndexerMetadata),
    )


def step_context(
    tokens: int, pipeline_input: bool = False, aux_layers: tuple[int, ...] = ()
) -> StepContext:
    """The current step as the routing decision sees it (vLLM's forward context)."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if not is_forward_context_available():
        return StepContext(tokens, capturing, "NONE", pipeline_input, aux_layers)
    context = get_forward_context()
    mode = context.cudagraph_runtime_mode
    graph = {CUDAGraphMode.FULL: "FULL", CUDAGraphMode.PIECEWISE: "PIECEWISE"}.get(mode, "NONE")
    by_layer = context.attn_metadata
    rows = {n: rows_of(md) for n, md in by_layer.items()} if isinstance(by_layer, dict) else {}
    return StepContext(tokens, capturing, graph, pipeline_input, aux_layers, rows)


def attention_metadata() -> dict[str, Any]:
    """vLLM's per-layer attention metadata of the current forward (by layer prefix); empty
    outside a forward context or where it is not per layer."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return {}
    by_layer = get_forward_context().attn_metadata
    return dict(by_layer) if isinstance(by_layer, dict) else {}


def slot_mappings() -> dict[str, Any]:
    """The current forward's cache slot mapping per layer name (where vLLM's own attention
    writes each token's KV); empty outside a forward context."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return {}
    slots = get_forward_context().slot_mapping
    return dict(slots) if isinstance(slots, dict) else {}


def kda_placement(md: Any) -> KdaPlacement | None:
    """A KDA layer's `GDNAttentionMetadata` as the neutral placement the fused KDA stage reads,
    for the steps it serves: a uniform verify (every request a spec decode of T tokens: state
    after token t to spec_state_indices[r, t], start from column accepted - 1, the conv
    window there) or a plain decode (every request one token, state read and written in
    place at non_spec_state_indices[r], window at column 0). None for anything else
    (prefills, mixed batches): those steps run vLLM's own path. Tensor ops only (no host
    sync: capturable)."""
    import torch

    if md.num_prefills:
        return None
    if md.num_spec_decodes and not md.num_decodes:
        slots, accepted = md.spec_state_indices_tensor, md.num_accepted_tokens
        if slots is None or accepted is None:
            return None
        r = md.num_spec_decodes
        slots, start = slots[:r], accepted[:r].long() - 1
        read = slots.gather(1, start[:, None])[:, 0]
        # Contiguous columns: the kernel reads them as given, with no copy per layer.
        conv = slots[:, 0].contiguous()
        return KdaPlacement(conv, start, read, slots, keep=slots.shape[1] > 1)
    if md.num_decodes and not md.num_spec_decodes:
        slots = md.non_spec_state_indices_tensor
        if slots is None:
            return None
        slots = slots[: md.num_decodes]
        return KdaPlacement(slots, torch.zeros_like(slots), slots, slots[:, None], keep=False)
    return None
