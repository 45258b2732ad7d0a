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


def moe_shape(*, hidden: int, layers: int, heads: int, kv_heads: int, experts: int, top_k: int, expert_width: int,
              vocab: int, head_dim: int | None = None, rope_theta: float = 1000000.0, max_pos: int = 32768,
              norm_topk: bool = False, qk_norm: str | None = None, aux_coef: float = 0.001,
              eps: float = 1e-6, arch: str = "Qwen3MoeForCausalLM") -> dict:
    """A mixture of experts: every block's MLP is ``experts`` SwiGLU experts of ``expert_width``
    and a router sending each token to ``top_k`` of them; untied, no attention biases."""
    shape = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=rope_theta,
        max_position_embeddings=max_pos, tie_word_embeddings=False, rms_norm_eps=eps, num_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=expert_width, norm_topk_prob=norm_topk,
        router_aux_loss_coef=aux_coef, output_router_logits=True, architecture=arch,
    )
    if head_dim is not None:
        shape["head_dim"] = head_dim
    if qk_norm is not None:
        shape.update(qk_norm=True, qk_norm_scope=qk_norm)
    return shape


def gemma3_shape(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, head_dim: int = 256,
                 vocab: int = 262208, window: int = 1024, pattern: int = 6, scalar: float = 256.0,
                 rope_factor: float | None = 8.0, max_pos: int = 131072) -> dict:
    """Gemma 3's text model: a window of ``window`` tokens on five blocks of every ``pattern``,
    full attention on the sixth (its rotary base 1e6, linearly scaled by ``rope_factor``; the
    local blocks' 1e4), four (1 + w) norms a block, q/k norms, GELU-tanh, the embedding scaled
    by sqrt(hidden), tied."""
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None if rope_factor is None else {"rope_type": "linear",
                                                                            "factor": rope_factor},
        rope_local_theta=10000.0, max_position_embeddings=max_pos, tie_word_embeddings=True, qk_norm=True,
        norm_placement="sandwich", norm_offset=1.0, hidden_act="gelu_pytorch_tanh", scale_embeddings=True,
        query_pre_attn_scalar=scalar, sliding_window=window, pad_token_id=0,
        layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        architecture="Gemma3ForCausalLM",
    )


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
    # the tests' mixture of experts: 4 experts, top-2, Qwen3-MoE's router and q/k norms
    "debug_moe": moe_shape(hidden=32, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_width=16,
                           vocab=256, rope_theta=10000.0, max_pos=1024, norm_topk=True, qk_norm="head"),
    # OLMoE-1B-7B: 6.92B parameters, 1.28B active
    "olmoe7b": moe_shape(hidden=2048, layers=16, heads=16, kv_heads=16, experts=64, top_k=8, expert_width=1024,
                         vocab=50304, rope_theta=10000.0, max_pos=4096, qk_norm="projection", aux_coef=0.01,
                         eps=1e-5, arch="OlmoeForCausalLM"),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
    "qwen3moe30b": moe_shape(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                             expert_width=768, vocab=151936, max_pos=40960, norm_topk=True, qk_norm="head"),
    # OLMo-2-1124-13B: 13.7B parameters; norms on attention's and the MLP's outputs, q/k norms
    # over the whole projections
    "olmo2_13b": {**llama_shape(hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824, vocab=100352,
                                tied=False, max_pos=4096, llama3_rope=False),
                  "rms_norm_eps": 1e-6, "qk_norm": True, "qk_norm_scope": "projection", "norm_placement": "post",
                  "architecture": "Olmo2ForCausalLM"},
    # Phi-4: 14.7B parameters, Phi-3's layout (q/k/v and gate/up fused in the Hub's files)
    "phi4": {**llama_shape(hidden=5120, layers=40, heads=40, kv_heads=10, intermediate=17920, vocab=100352,
                           tied=False, rope_theta=250000.0, max_pos=16384, llama3_rope=False),
             "architecture": "Phi3ForCausalLM"},
    # Gemma 3 12B's text model: 11.77B parameters (the 262k vocabulary's embedding is 1.01B of them)
    "gemma3_12b": gemma3_shape(hidden=3840, layers=48, heads=16, kv_heads=8, intermediate=15360),
    # the tests' Gemma 3: a window of 4 on blocks 0 and 2, full attention on block 1
    "debug_gemma3": gemma3_shape(hidden=32, layers=3, heads=4, kv_heads=2, intermediate=64, head_dim=8, vocab=256,
                                 window=4, pattern=2, scalar=12.0, rope_factor=2.0, max_pos=1024),
    # Mixtral-8x7B: 46.7B parameters, 12.9B active
    "mixtral8x7b": moe_shape(hidden=4096, layers=32, heads=32, kv_heads=8, experts=8, top_k=2, expert_width=14336,
                             vocab=32000, norm_topk=True, eps=1e-5, arch="MixtralForCausalLM"),
}
