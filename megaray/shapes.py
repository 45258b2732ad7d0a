"""Registry of model shapes, each a Hugging Face style config dict built by one helper.

``debug`` is the tiny shape the tests use; ``demo`` is what the shipped demo trains on a
laptop CPU; the llama* shapes are the benchmark shapes of BENCHMARKS.md.
"""
from __future__ import annotations


def llama_shape(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                vocab: int = 128256, tied: bool = True, rope_theta: float = 500000.0,
                max_pos: int = 131072, llama3_rope: bool = True) -> dict:
    shape = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        rope_theta=rope_theta, max_position_embeddings=max_pos, tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
    )
    if llama3_rope:
        shape["rope_scaling"] = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)
    return shape


SHAPES: dict[str, dict] = {
    "debug": llama_shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=256,
                         rope_theta=10000.0, max_pos=1024, llama3_rope=False),
    "demo": llama_shape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=352, vocab=256,
                        rope_theta=10000.0, max_pos=1024, llama3_rope=False),
    "llama1b": llama_shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "llama3b": llama_shape(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "llama8b": llama_shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, tied=False),
    # Qwen2.5-14B's dimensions without its q/k/v biases: 14.77B parameters
    "qwen14b": llama_shape(hidden=5120, layers=48, heads=40, kv_heads=8, intermediate=13824, vocab=152064,
                           tied=False, rope_theta=1000000.0, llama3_rope=False),
    # Llama-3-70B: 70.55B parameters
    "llama70b": llama_shape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, tied=False),
    # a dense Llama-style 120B-class model (the paper's largest scale on one H200): width 12288,
    # 76 blocks, 96 query and 8 kv heads of 128, SwiGLU 32768, Llama-3 vocabulary: 119.8B parameters
    "dense120b": llama_shape(hidden=12288, layers=76, heads=96, kv_heads=8, intermediate=32768, tied=False),
}
