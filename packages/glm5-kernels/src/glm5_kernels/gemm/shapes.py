"""The skinny GEMMs of one GLM-5.3-Flash rank at tensor-parallel degree `tp`: what tests and
benchmarks run at. (kind, N, K): kind "bf16" (Projection), "router" (BF16 -> FP32), "fp8"
(Fp8Linear), "mlp" (DenseMlp: N = 2 x intermediate per rank, K = hidden)."""

HIDDEN, VOCAB, EXPERTS = 4096, 154880, 288
MLA_HEADS, NOPE, V_HEAD, Q_LORA, KV_LORA = 64, 256, 256, 1536, 512
INDEX_HEADS, INDEX_DIM = 32, 128
KDA_HEADS, KDA_HEAD_DIM = 64, 128  # linear_num_heads, linear_head_dim
KDA_WIDTH = KDA_HEADS * KDA_HEAD_DIM
DENSE_I, MOE_I = 12288, 2048


def flash_shapes(tp: int) -> dict[str, tuple[str, int, int]]:
    """name -> (kind, N, K) for one rank of a TP-`tp` deployment (replicated weights whole)."""
    return {
        # MLA + DSA (BF16). q_a and kv_a are replicated; vLLM fuses them (fused_qkv_a_proj,
        # which the dsa_proj stage serves whole), the reference keeps them apart.
        "mla.fused_qkv_a": ("bf16", Q_LORA + KV_LORA, HIDDEN),
        "mla.q_a": ("bf16", Q_LORA, HIDDEN),
        "mla.kv_a": ("bf16", KV_LORA, HIDDEN),
        "mla.q_b": ("bf16", MLA_HEADS * NOPE // tp, Q_LORA),
        "mla.o_proj": ("bf16", HIDDEN, MLA_HEADS * V_HEAD // tp),
        "indexer.wq_b": ("bf16", INDEX_HEADS * INDEX_DIM, Q_LORA),
        # KDA (BF16): vLLM's fused input projection q | k | v | b (per head) | f_a | g_a
        # (f_a, g_a replicated; the kda_proj stage serves it whole there), one of q / k / v
        # (it serves each where they are apart), output projection.
        "kda.in_proj": ("bf16", (3 * KDA_WIDTH + KDA_HEADS) // tp + 2 * KDA_HEAD_DIM, HIDDEN),
        "kda.q": ("bf16", KDA_WIDTH // tp, HIDDEN),
        "kda.o_proj": ("bf16", HIDDEN, KDA_WIDTH // tp),
        "mtp.eh_proj": ("bf16", HIDDEN, 2 * HIDDEN),
        "lm_head": ("bf16", VOCAB // tp, HIDDEN),
        "moe.router": ("router", EXPERTS, HIDDEN),
        # FP8 128x128 block-scaled MLPs.
        "dense.gate_up": ("fp8", 2 * DENSE_I // tp, HIDDEN),
        "dense.down": ("fp8", HIDDEN, DENSE_I // tp),
        "shared.gate_up": ("fp8", 2 * MOE_I // tp, HIDDEN),
        "shared.down": ("fp8", HIDDEN, MOE_I // tp),
        "dense.mlp": ("mlp", 2 * DENSE_I // tp, HIDDEN),
        "shared.mlp": ("mlp", 2 * MOE_I // tp, HIDDEN),
    }
