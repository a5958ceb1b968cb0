"""The specialized decode of the MTP draft layer: the main model's stages on the draft's
FULL-graph steps. The MTP layer has no mHC streams: eh_proj over [enorm(embedding),
hnorm(hidden)], then one MLA + MoE block with residual adds, then the shared head norm.

Draft decodes run one token per request; draft prefills run q, and only the sampled rows
(each request's last token) go on past the attention, which writes every token's KV.

Where the backbone's TP ranks live in other processes (seam 6: `Backbone.mailbox`), the
`boundary` stage sums the layer's partials in glm5-comm's fused exchanges instead of the
backbone's all-reduces: the embedding's partial into enorm | hnorm (`EmbedNorm`), the
attention's and the MoE's partials into the residual add and the next norm
(`AllReduceNorm`, twice) — three launches, no stock all-reduce in a draft step."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from glm5_comm import AllReduceNorm, EmbedNorm, MailboxWatch
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
        # Per MTP layer: (the input's EmbedNorm, the post-attention and the final
        # AllReduceNorm), all on one mailbox, where the TP ranks are other processes.
        self.exchange: dict[int, tuple[EmbedNorm, AllReduceNorm, AllReduceNorm]] = {}
        self.exchange_tokens: frozenset[int] = frozenset()
        self._build("boundary", self._boundaries)
        self.watch = MailboxWatch([])
        self._exchanging = False  # inside `_exchanged`: sublayers leave partial outputs

    def partial(self, tokens: int) -> bool:
        return self._exchanging

    def _boundaries(self, tokens: list[int]) -> None:
        b = self.backbone
        mailbox = self._mailbox(b.hidden_size, max(tokens))
        if mailbox is None:
            return  # one process holds every shard: the backbone's sums
        problems = []
        if b.mhc is None:
            problems.append("no norm eps (Backbone.mhc)")
        names = ("enorm", "hnorm", "post_attention_layernorm", "shared_head.norm")
        weights = {(k, n): b.weight(b.shards[0], f"layers.{layer.index}.{n}.weight")
                   for k, layer in enumerate(self.layers) for n in names}  # fmt: skip
        problems += [f"no layers.{self.layers[k].index}.{n}.weight"
                     for (k, n), w in weights.items() if w is None]  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
        eps = b.mhc.norm_eps
        for k in range(len(self.layers)):
            w = {n: weights[k, n] for n in names}
            ops = (EmbedNorm(mailbox, w["enorm"], w["hnorm"], eps),
                   AllReduceNorm(mailbox, w["post_attention_layernorm"], eps),
                   AllReduceNorm(mailbox, w["shared_head.norm"], eps))  # fmt: skip
            for op in ops:
                self._add(op, tokens, None, None)  # not a route: `run` calls them
            self.exchange[k] = ops
        self.exchange_tokens = frozenset(tokens)

    def prepare(self) -> set[str]:
        failed = super().prepare()
        if "boundary" in failed:
            self.exchange, self.exchange_tokens = {}, frozenset()
        mailboxes = [ops[0].mailbox for ops in self.exchange.values()]
        self.watch = MailboxWatch(mailboxes[:1])  # the layers share one
        return failed

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
        if step.tokens in self.exchange_tokens and embeds is None:
            self.watch.check()
            self._exchanging = True
            try:
                with b.unreduced():
                    out = self._exchanged(step, k, tokens, hidden, placement, sampled_only)
            finally:
                self._exchanging = False
            self.watch.record()
            return out
        with self.installed(step.tokens):
            if embeds is None and tokens is not None:  # the `embed` stage's, where it serves
                embeds = self._embed(tokens, step)
            x = b.draft_input(k, tokens, hidden, placement, embeds)
            x = b.linear(b.shards[0], f"{p}.eh_proj.weight", x)  # replicated: one shard's
            a = self.attention(layer, b.norm(f"{p}.input_layernorm.weight", x), placement)
        if step.q > 1 and sampled_only:  # only the sampled rows go on
            x = x.reshape(-1, step.q, x.shape[-1])[:, -1:]
            a = a.reshape(-1, step.q, a.shape[-1])[:, -1:]
        x = x + a
        # The MLP's rows are fewer than the step's tokens where only the sampled rows go on:
        # the stage ops serving that count, else stock.
        with self.installed(x.numel() // x.shape[-1]):
            x = x + self.mlp(layer, b.norm(f"{p}.post_attention_layernorm.weight", x))
            return b.norm(f"{p}.shared_head.norm.weight", x)

    def _exchanged(self, step: Step, k: int, tokens: Tensor, hidden: Tensor, placement: Any,
                   sampled_only: bool) -> Tensor:  # fmt: skip
        """`run` with the backbone unreduced: each sum in a fused exchange (EmbedNorm, then
        AllReduceNorm after the attention and after the MoE)."""
        b = self.backbone
        layer = self.layers[k]
        p = f"layers.{layer.index}"
        embed_norm, attn_norm, final_norm = self.exchange[k]
        shape, d = hidden.shape, hidden.shape[-1]
        positions = b.positions(placement).reshape(-1)
        with self.installed(step.tokens):
            x = embed_norm(
                self._embed(tokens, step).reshape(-1, d), positions, hidden.reshape(-1, d)
            )  # this process's partial, summed inside
            x = b.linear(b.shards[0], f"{p}.eh_proj.weight", x)  # replicated: one shard's
            x_in = b.norm(f"{p}.input_layernorm.weight", x).view(shape)
            a = self.attention(layer, x_in, placement).reshape(-1, d)
        if step.q > 1 and sampled_only:  # only the sampled rows go on
            x, a = (t.reshape(-1, step.q, d)[:, -1] for t in (x, a))
            shape = (x.shape[0], 1, d)  # [R, 1, D], as the stock path's
        x, h = attn_norm(a.contiguous(), x.contiguous())
        with self.installed(x.shape[0]):  # the MLP's rows (a draft prefill: the sampled ones)
            m = self.mlp(layer, h.view(shape)).reshape(-1, d)
        return final_norm(m.contiguous(), x)[1].view(shape)
