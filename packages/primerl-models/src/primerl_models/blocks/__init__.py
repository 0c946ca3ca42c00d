"""The blocks a decoder layer is made of, one module per kind; model.py assembles them from a
layer's specs (args.py), whose fields are the only settings they read.

    mixer.py           Mixer: what a token mixer is to the layer (its call, positions, prepare)
    attention.py       SelfAttention and the causal attention back-ends (sdpa, varlen, flex)
    mla.py             Multi-head Latent Attention and DSA's top-k indexer (GLM-5)
    gated_deltanet.py  Gated DeltaNet (Qwen3.5) and its exact chunked delta rule
    mamba2.py          Mamba2 (Nemotron-H) and its chunked state space scan
    recurrent.py       what the recurrent mixers share: chunk layout, causal conv, head split
    mlp.py             dense MLPs (SwiGLU, relu^2)
    moe.py             router, grouped experts, the MoE block
    norms.py, rope.py  RMSNorms; rotary embeddings (1-D and multi-axis)
    vision.py          the vision tower of a vision-language model and where its tokens go

What every block shares, the document boundaries of packed rows (PackedSeqs), is ../packing.py;
kernels (Triton, custom ops) live in ../kernels, each naming the torch form here it replaces.
"""
