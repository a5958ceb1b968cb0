"""The specialized decode of the MTP draft layer: the main model's stages on the draft's
FULL-graph steps. The MTP layer has no mHC streams: eh_proj over [enorm(embedding),
hnorm(hidden)], then one MLA + MoE block with residual adds, then the shared head norm.

Draft decodes run one token per request; draft prefills run q, and only the sampled rows
(each request's last token) go on past the attention, which writes every token's KV."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from glm5_kernels.gemm import Projection
from glm5_policy import DecodeConfig
from glm5_policy.stages import MAX_TOKENS

from .decode import LayerStages
from .plan import Plan, Step, StepContext, plan_draft
from .protocol import Backbone

__all__ = ["SpecializedDraft"]


class SpecializedDraft(LayerStages):
    """Built over a backbone's MTP layers; reads them, never modifies them."""

    def __init__(self, backbone: Backbone, config: DecodeConfig):
        self.q = config.q
        # Draft decodes hold one token per request, draft prefills q: any count up to the cap.
        batches = sorted(b for b in config.capture_sizes if b <= MAX_TOKENS)
        super().__init__(backbone, config.policy, batches, backbone.draft_layers)
        # The draft's BF16 eh_proj takes the skinny GEMM where the DSA projections do.
        self._build("dsa_proj", self._eh_proj)

    def _eh_proj(self, tokens: list[int]) -> None:
        for layer in self.layers:
            name = f"layers.{layer.index}.eh_proj.weight"
            shard = self.backbone.shards[0]  # replicated: the loop reads one shard's
            self._add(Projection(self.backbone.weight(shard, name), tokens), tokens, shard, name)

    def plan(self, placement: Any, capturing: bool, graph: str = "FULL") -> Plan:
        b = self.backbone
        context = StepContext(b.tokens(placement), capturing, graph, rows=b.draft_rows(placement))
        return plan_draft(context, self.batches, self.q)

    def run(
        self,
        step: Step,
        k: int,
        tokens: Tensor | None,
        hidden: Tensor,
        placement: Any,
        embeds: Tensor | None = None,
        sampled_only: bool = True,
    ) -> Tensor:
        """MTP layer k (the drafter picks it round-robin by step) on (token, previous hidden)
        pairs ([R, T] / [R, T, D], or flat [N] / [N, D]; `embeds` may stand in for the
        tokens): the draft hidden states after the shared head norm. A draft prefill (q > 1)
        with `sampled_only` carries only each request's last row past the attention and
        returns [R, 1, D] — the row the drafter samples when every request's rows are kept;
        otherwise every row goes on (a caller that samples other rows, as vLLM's proposer
        after rejections does)."""
        b = self.backbone
        layer = self.layers[k]
        p = f"layers.{layer.index}"
        with self.installed(step.tokens):
            x = b.draft_input(k, tokens, hidden, placement, embeds)
            x = b.linear(b.shards[0], f"{p}.eh_proj.weight", x)  # replicated: one shard's
            a = self.attention(layer, b.norm(f"{p}.input_layernorm.weight", x), placement)
            if step.q > 1 and sampled_only:  # only the sampled rows go on
                x = x.reshape(-1, step.q, x.shape[-1])[:, -1:]
                a = a.reshape(-1, step.q, a.shape[-1])[:, -1:]
            x = x + a
            x = x + self.mlp(layer, b.norm(f"{p}.post_attention_layernorm.weight", x))
            return b.norm(f"{p}.shared_head.norm.weight", x)
