"""The reference GLM-5.3-Flash decoder and MTP draft layer over vLLM-layout caches, with a
scheduler-free batch API: `add` requests, `forward` a uniform step (a prefill of one
request, a decode of 1 token or a verify of q tokens per request), `accept` a verify.

    model = ReferenceModel.random(geometry("tiny"), max_requests=4, max_context=256)
    a = model.add();  h = model.forward([a], prompt[None])          # prefill
    h = model.forward([a], next_token[None, None])                  # decode
    h = model.forward([a], tokens[None], verify=True); model.accept(a, n)   # MTP verify

Tensor parallelism: a model holds the shards of `g.ranks` and sums their TP-partial outputs
(`reduce`). With `group` (a torch.distributed group of `g.tp_size` processes), each process
holds one rank, its group rank, and the sums run across the processes (glm5-comm's
references: every rank's partial summed in FP32 in rank order, rounded once, so every process
holds what one process holding every shard computes, bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from glm5_comm.reference import all_reduce_ref, logits_gather_ref
from glm5_kernels.mhc import hc_expand_ref, hc_head_ref, hc_post_ref, hc_pre_ref
from glm5_kernels.norm import rms_norm_ref

from .caches import allocate
from .config import Geometry
from .memory import fit_problem
from .stages import Placement, RankStages, reduce
from .weights import load_rank, random_rank, random_state_dict


class ReferenceModel:
    def __init__(
        self,
        g: Geometry,
        weights: Sequence[Mapping[str, Tensor]],
        *,
        max_requests: int,
        max_context: int,
        q: int = 1,
        block_size: int = 64,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        indexer_numerics: str = "vllm",
        ue8m0: bool = False,
        fp8_activations: bool = False,
        group=None,
    ):
        if len(weights) != len(g.ranks):
            raise ValueError(f"weights: {len(weights)} shards for ranks {g.ranks}")
        if group is not None:
            _check_group(g, group)
        self.group = group
        self.g, self.q, self.device, self.block_size = g, q, torch.device(device), block_size
        self.max_requests, self.max_context = max_requests, max_context
        blocks = math.ceil(max_context / block_size)
        self.mtp_layers = [g.num_hidden_layers + k for k in range(g.num_nextn_predict_layers)]
        layers = list(range(g.num_hidden_layers)) + self.mtp_layers
        mla = set(g.mla_layers) | set(self.mtp_layers)
        # Each request owns q KDA state slots (vLLM's spec_state_indices row) and a fixed
        # run of blocks; slot 0 of the cache stays a scratch row for padding.
        self.ranks = [
            RankStages(
                g,
                rank,
                dict(w),
                allocate(
                    g,
                    num_slots=1 + max_requests * q,
                    num_blocks=max_requests * blocks,
                    num_requests=max_requests,
                    block_size=block_size,
                    device=self.device,
                    layers=layers,
                    mla_layers=mla,
                    dtype=dtype,
                    q=q,
                    indexer_numerics=indexer_numerics,
                ),
                fp8_activations=fp8_activations,
                ue8m0=ue8m0,
            )
            for rank, w in zip(g.ranks, weights, strict=True)
        ]
        # Block 0 is the null block (vLLM's): it takes the writes vLLM skips.
        self.block_table = 1 + torch.arange(max_requests * blocks, device=self.device).view(
            max_requests, blocks
        )
        self.state_slots = 1 + torch.arange(max_requests * q, device=self.device).view(
            max_requests, q
        )
        self.lengths = [0] * max_requests
        self.current = [0] * max_requests  # which of its q slots holds the request's state
        self.pending: dict[int, int] = {}  # request -> length before an unaccepted verify
        self.free = list(range(max_requests))

    @classmethod
    def random(
        cls, g: Geometry, seed: int = 0, *, device="cpu", ue8m0=False, dtype=torch.bfloat16, **kw
    ) -> ReferenceModel:
        """Random weights: with every rank held, the full model drawn and sharded (so a TP
        simulation equals TP 1); a subset of ranks draws each shard at its own size,
        streamed to the device (one rank of the flash model fits one GPU)."""
        keys = ("max_requests", "max_context", "q", "block_size", "indexer_numerics")
        sizes = {k: v for k, v in kw.items() if k in keys}
        problem = fit_problem(
            g, device, **{"max_requests": 1, "max_context": 1, **sizes}, dtype=dtype
        )
        if problem:
            raise ValueError(problem)
        if g.full_tp:
            sd = random_state_dict(g, seed)
            return cls.from_state_dict(g, sd, device=device, ue8m0=ue8m0, dtype=dtype, **kw)
        shards = [
            dict(random_rank(g, r, seed, device=device, ue8m0=ue8m0, dtype=dtype)) for r in g.ranks
        ]
        return cls(g, shards, device=device, dtype=dtype, ue8m0=ue8m0, **kw)

    @classmethod
    def from_state_dict(
        cls, g: Geometry, state_dict, *, device="cpu", ue8m0=False, dtype=torch.bfloat16, **kw
    ) -> ReferenceModel:
        shards = [
            load_rank(g, r, state_dict, device=device, ue8m0=ue8m0, dtype=dtype) for r in g.ranks
        ]
        return cls(g, shards, device=device, dtype=dtype, ue8m0=ue8m0, **kw)

    # Requests.
    def add(self) -> int:
        if not self.free:
            raise ValueError(f"max_requests={self.max_requests}: no free request")
        r = self.free.pop(0)
        self.lengths[r], self.current[r] = 0, 0
        slots = self.state_slots[r]
        for rank in self.ranks:
            for cache in (*rank.c.conv.values(), *rank.c.recurrent.values()):
                cache[slots] = 0
        return r

    def release(self, r: int) -> None:
        if r in self.free or not 0 <= r < self.max_requests:
            raise ValueError(f"request {r}: not added")
        self.pending.pop(r, None)
        self.free.append(r)

    def accept(self, r: int, n: int) -> None:
        """Keep the first n tokens of request r's last verify step (vLLM's
        num_accepted_tokens): KDA resumes from the state after token n."""
        if r not in self.pending:
            raise ValueError(f"request {r}: no verify step to accept")
        start = self.pending[r]
        if not 1 <= n <= self.lengths[r] - start:
            raise ValueError(f"accept: n={n} outside 1..{self.lengths[r] - start}")
        self.lengths[r], self.current[r] = start + n, n - 1
        del self.pending[r]

    # Steps.
    def step(self, requests: Sequence[int], tokens: int, verify: bool = False) -> Placement:
        """The cache placement of `tokens` new tokens for each request."""
        problems = [f"request {r}: not added" for r in requests if r in self.free]
        problems += [
            f"request {r}: a verify step awaits accept()" for r in requests if r in self.pending
        ]
        problems += [
            f"request {r}: {self.lengths[r]} + {tokens} tokens exceed "
            f"max_context={self.max_context}"
            for r in requests
            if r not in self.free and self.lengths[r] + tokens > self.max_context
        ]
        if verify and tokens > self.q:
            problems.append(f"verify: {tokens} tokens per request exceed q={self.q}")
        if problems:
            raise ValueError("bad step:\n" + "\n".join(f"  - {p}" for p in problems))
        dev, bs = self.device, self.block_size
        rows = torch.tensor(list(requests), device=dev)
        start = torch.tensor([self.lengths[r] for r in requests], device=dev)
        positions = start[:, None] + torch.arange(tokens, device=dev)
        table = self.block_table[rows]
        slots = table.gather(1, positions // bs) * bs + positions % bs
        current = torch.tensor([self.current[r] for r in requests], device=dev)
        read = self.state_slots[rows, current]
        if verify:
            write = self.state_slots[rows, :tokens]
        else:
            write = torch.full((len(requests), tokens), -1, device=dev)
            write[:, -1] = read
        conv = self.state_slots[rows, 0]
        return Placement(
            positions, slots, table, read, write, conv, current, rows + 1, bs, keep_states=verify
        )

    def place(self, requests: Sequence[int], positions: Tensor) -> Placement:
        """A Placement at explicit positions [R, T] that writes no KDA state (the MTP layer's
        steps, and benchmarks that pin a context length)."""
        rows = torch.tensor(list(requests), device=self.device)
        table = self.block_table[rows]
        bs = self.block_size
        slots = table.gather(1, positions // bs) * bs + positions % bs
        read = self.state_slots[rows, 0]
        write = read[:, None].expand(-1, positions.shape[1]).contiguous()
        return Placement(
            positions, slots, table, read, write, read, torch.zeros_like(read), rows + 1, bs
        )

    def forward(
        self,
        requests: Sequence[int],
        tokens: Tensor,
        *,
        verify: bool = False,
        step: Placement | None = None,
        run=None,
    ) -> Tensor:
        """Final normalized hidden states [R, T, D] of T new tokens per request. `run(tokens,
        step)` computes them (default: the stock `backbone`; a specialized decode's forward)."""
        self._check_tokens(tokens, len(requests))
        T = tokens.shape[1]
        step = step or self.step(requests, T, verify)
        h = (run or self.backbone)(tokens, step)
        for r in requests:
            if verify:
                self.pending[r] = self.lengths[r]
            self.lengths[r] += T
        return h

    def backbone(self, tokens: Tensor, step: Placement) -> Tensor:
        """The decoder over a placed step; writes the caches, keeps no Python state."""
        g = self.g
        x = self.reduce([rank.embed(tokens) for rank in self.ranks])
        streams = hc_expand_ref(x.reshape(-1, g.hidden_size), g.hc_mult)
        shape = x.shape
        topk = None
        for layer in range(g.num_hidden_layers):
            p = f"layers.{layer}"
            h = self._pre(streams, f"{p}.attn_hc", f"{p}.input_layernorm.weight")
            if g.is_mla(layer):
                shared = topk if g.indexer_types[layer] == "shared" else None
                outs = [rank.mla(layer, h[0].view(shape), step, shared) for rank in self.ranks]
                topk = outs[0][1]
                a = self.reduce([o for o, _ in outs])
            else:
                a = self.reduce([rank.kda(layer, h[0].view(shape), step) for rank in self.ranks])
            streams = hc_post_ref(a.reshape(-1, g.hidden_size), streams, h[1], h[2])
            h = self._pre(streams, f"{p}.ffn_hc", f"{p}.post_attention_layernorm.weight")
            dense = g.mlp_layer_types[layer] == "dense"
            m = self.reduce(
                [
                    (rank.dense_mlp if dense else rank.moe)(layer, h[0].view(shape))
                    for rank in self.ranks
                ]
            )
            streams = hc_post_ref(m.reshape(-1, g.hidden_size), streams, h[1], h[2])
        out = rms_norm_ref(hc_head_ref(streams), self._w("norm.weight"), g.rms_norm_eps)
        return out.view(shape)

    def _pre(self, streams: Tensor, hc: str, norm: str) -> tuple[Tensor, Tensor, Tensor]:
        g = self.g
        post, comb, x = hc_pre_ref(
            streams,
            self._w(f"{hc}.fn"),
            self._w(f"{hc}.scale"),
            self._w(f"{hc}.base"),
            rms_eps=g.rms_norm_eps,
            hc_eps=g.hc_eps,
            sinkhorn_iters=g.hc_sinkhorn_iters,
        )
        return rms_norm_ref(x, self._w(norm), g.rms_norm_eps), post, comb

    def _w(self, name: str) -> Tensor:
        """A replicated weight (every rank holds the same tensor)."""
        return self.ranks[0].w[name]

    def reduce(self, partials: Sequence[Tensor]) -> Tensor:
        """The TP all-reduce of the held shards' partial outputs (and, with a group, the
        other processes')."""
        if self.group is None:
            return reduce(list(partials))
        (partial,) = partials
        return all_reduce_ref(partial, self.group)

    def gather(self, slices: Sequence[Tensor]) -> Tensor:
        """The logits all-gather of the held shards' vocab slices (with a group, every
        process's, in rank order)."""
        if self.group is None:  # one slice: itself (a copy would be one more launch)
            return slices[0] if len(slices) == 1 else torch.cat(list(slices), dim=-1)
        (shard,) = slices
        return logits_gather_ref(shard, self.group)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., vocab] FP32: the all-gather of each rank's vocab slice."""
        return self.gather([rank.head(hidden) for rank in self.ranks])

    # The MTP draft layer (no mHC): enorm/hnorm -> eh_proj -> MLA+MoE block -> head norm.
    def draft_hidden(
        self,
        tokens: Tensor,
        hidden: Tensor,
        step: Placement,
        k: int = 0,
        topk: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """MTP layer k at `step`'s positions on (token, hidden) pairs [R, T] / [R, T, D]:
        the draft hidden states [R, T, D] (post head norm: they feed the LM head and the
        next draft step) and the indices its attention used. The embedding is zeroed at
        position 0, where no earlier hidden state exists (vLLM's fused_eh_norm)."""
        g = self.g
        p = f"layers.{self.mtp_layers[k]}"
        embedded = self.reduce([rank.embed(tokens) for rank in self.ranks])
        embedded = embedded * (step.positions != 0)[..., None].to(embedded.dtype)
        e = rms_norm_ref(embedded, self._w(f"{p}.enorm.weight"), g.rms_norm_eps)
        h = rms_norm_ref(hidden, self._w(f"{p}.hnorm.weight"), g.rms_norm_eps)
        x = self.ranks[0].linear(torch.cat([e, h], dim=-1), f"{p}.eh_proj.weight")
        a_in = rms_norm_ref(x, self._w(f"{p}.input_layernorm.weight"), g.rms_norm_eps)
        outs = [rank.mla(self.mtp_layers[k], a_in, step, topk) for rank in self.ranks]
        x = x + self.reduce([o for o, _ in outs])
        m_in = rms_norm_ref(x, self._w(f"{p}.post_attention_layernorm.weight"), g.rms_norm_eps)
        x = x + self.reduce([rank.moe(self.mtp_layers[k], m_in) for rank in self.ranks])
        return rms_norm_ref(x, self._w(f"{p}.shared_head.norm.weight"), g.rms_norm_eps), outs[0][1]

    def draft(
        self,
        requests: Sequence[int],
        tokens: Tensor,
        hidden: Tensor,
        start: int,
        k: int,
        *,
        share_index: bool = False,
    ) -> Tensor:
        """Greedy MTP drafts [R, k]. Step 0 runs the MTP layer over (token_{i+1}, h_i) at
        target positions start..start+T-1 (writing its caches, like the target's prefill or
        verify); steps 1..k-1 feed back their own draft token and hidden state one position
        later. MTP layers are used round-robin (vLLM's spec_step_idx % layers).
        `share_index`: steps 1+ reuse step 0's last-token selection and skip the indexer
        (vLLM's index_share_for_mtp_iteration)."""
        T = tokens.shape[1]
        positions = start + torch.arange(T, device=self.device).expand(len(requests), T)
        h, topk = self.draft_hidden(tokens, hidden, self.place(requests, positions))
        h, topk = h[:, -1:], topk[:, -1:]
        drafts = [self.logits(h).argmax(-1)]
        for j in range(1, k):
            step = self.place(requests, positions[:, -1:] + j)
            layer = j % len(self.mtp_layers)
            h, used = self.draft_hidden(drafts[-1], h, step, layer, topk if share_index else None)
            topk = topk if share_index else used
            drafts.append(self.logits(h).argmax(-1))
        return torch.cat(drafts, dim=1)

    def _check_tokens(self, tokens: Tensor, requests: int) -> None:
        problems = []
        if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int32, torch.int64):
            got = getattr(tokens, "dtype", type(tokens).__name__)
            problems.append(f"tokens: expects an int32/int64 tensor, got {got}")
        elif tokens.dim() != 2 or tokens.shape[0] != requests or tokens.shape[1] < 1:
            problems.append(f"tokens: expects shape [{requests}, T>=1], got {tuple(tokens.shape)}")
        elif tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.g.vocab_size):
            problems.append(f"tokens: ids outside the vocabulary 0..{self.g.vocab_size - 1}")
        if problems:
            raise ValueError("bad tokens:\n" + "\n".join(f"  - {p}" for p in problems))


def _check_group(g: Geometry, group) -> None:
    """A model across processes: `group` spans g.tp_size processes, this one holding the
    rank it is in the group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialized")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    problems = []
    if world != g.tp_size:
        problems.append(f"a group of {world} processes for tp_size={g.tp_size}")
    if tuple(g.ranks) != (rank,):
        problems.append(f"ranks={tuple(g.ranks)} in the process of group rank {rank}: each "
                        f"process holds its own rank, ranks=({rank},)")  # fmt: skip
    if problems:
        raise ValueError("ReferenceModel: " + "; ".join(problems))
