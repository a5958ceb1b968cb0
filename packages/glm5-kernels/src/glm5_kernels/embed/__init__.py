"""The token embedding of a vocab-parallel shard in one launch (`Embedding`), and its torch
reference (`embed_ref`)."""

from glm5_kernels.embed.embedding import Embedding, embed_ref

__all__ = ["Embedding", "embed_ref"]
