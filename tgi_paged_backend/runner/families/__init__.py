"""Attention modules of the families whose own attention code stands between them and the pool: ALiBi
(Bloom, MPT; ``alibi``), Falcon in every variant (``falcon``), multi-head latent attention (DeepSeek; ``mla``).
Each replaces transformers' attention module at load with one that calls the paged kernels."""
