"""The model section of a run's configuration: a Llama-family decoder in Hugging Face
``config.json`` terms (its shape, attention and RoPE variants, its experts if it is a mixture
of experts, and the parameter count), apart from the run's other sections
(``megaray.config``), which only say how to train it."""
from __future__ import annotations

from dataclasses import dataclass

from megaray.errors import ConfigError
from megaray.shapes import SHAPES


def windowed_square(length, window: int):
    """A document's attention work under a window, in squared-length units: length^2 less the
    (length - window)^2 pairs the window drops. ``length`` an int, or an integer array of
    lengths (each its own: ``step.square_document_lengths`` sums them)."""
    over = (length - window) * (length > window)
    return length * length - over * over


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-family decoder (Gemma 3, Phi-3 and OLMo 2 its variants), in Hugging Face config.json terms.

    In YAML, ``shape`` names a registered shape (``megaray.shapes``) whose values are the
    defaults; any key given beside it overrides that value (``ModelConfig.from_shape`` in code).
    """

    shape: str | None = None
    """Registered shape name (debug, demo, llama1b, llama3b, llama8b) or null."""
    from_path: str | None = None
    """YAML key ``from``: a Hugging Face model directory (config.json + safetensors). Its
    config.json sets every shape key, and training starts from its weights (upcast to fp32)."""
    vocab_size: int = 0
    """Vocabulary size."""
    hidden_size: int = 0
    """Model width."""
    intermediate_size: int = 0
    """SwiGLU MLP width."""
    num_hidden_layers: int = 0
    """Number of decoder blocks."""
    num_attention_heads: int = 0
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); null means as many as query heads."""
    head_dim: int | None = None
    """Per-head width; null means hidden_size / num_attention_heads."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling: dict | None = None
    """Rotary scaling, HF style: rope_type 'linear' (positions divided by its factor: Gemma 3's
    global blocks), 'llama3' (its factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings), 'longrope' (Phi-3.5, Phi-4-mini: a
    short_factor and a long_factor of rotary_dim / 2 values each, original_max_position_embeddings,
    optionally factor and attention_factor; the long factors serve rows longer than the
    original length), or null."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dimensions that rotary turns (the first ``rotary_dim`` of them;
    Phi-4-mini: 0.75); the rest pass through."""
    max_position_embeddings: int = 2048
    """Longest position the rotary tables are built for."""
    tie_word_embeddings: bool = False
    """Output head shares the input embedding matrix."""
    attention_bias: bool = False
    """Biases on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys before rotary (Qwen3, Qwen3-MoE, OLMoE)."""
    qk_norm_scope: str = "head"
    """What a q/k norm normalises: 'head' (each head's head_dim values: Qwen3, Qwen3-MoE) or
    'projection' (the whole q and k projections, with weights of their widths: OLMoE)."""
    norm_placement: str = "pre"
    """Where a block's RMSNorms stand: 'pre' (Llama: before attention, ``input_layernorm``,
    and before the MLP, ``post_attention_layernorm``), 'post' (OLMo 2: on attention's output,
    ``post_attention_layernorm``, and on the MLP's, ``post_feedforward_layernorm``, each
    before its residual add; nothing normalises a block's input) or 'sandwich' (Gemma 3: four,
    before and after attention and before and after the MLP: ``input_layernorm``,
    ``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``)."""
    norm_offset: float = 0.0
    """Added to every RMSNorm's weight before it scales: 1.0 for Gemma 3 (its norms scale by
    1 + weight, computed in fp32 before the cast; the weights start at 0), 0 for the others."""
    hidden_act: str = "silu"
    """The MLP's gate activation: 'silu' (SwiGLU) or 'gelu_pytorch_tanh' (Gemma 3's GELU with
    the tanh approximation)."""
    scale_embeddings: bool = False
    """Gemma 3: the embedding's output times sqrt(hidden_size), the factor rounded to the
    weights' dtype as transformers rounds it."""
    query_pre_attn_scalar: float | None = None
    """Attention's scores are scaled by this to the power -1/2 (Gemma 3); null: head_dim's."""
    layer_types: list | None = None
    """Per block, 'sliding_attention' (a window of ``sliding_window`` tokens: a token sees itself
    and the window - 1 before it) or 'full_attention' (Gemma 3's 5 local : 1 global); null:
    every block full attention."""
    rope_local_theta: float | None = None
    """The rotary base of the sliding-window blocks (Gemma 3's rope_local_base_freq, no
    scaling); the full-attention blocks use rope_theta and rope_scaling."""
    num_experts: int = 0
    """Experts of every block's mixture-of-experts MLP; 0: a dense SwiGLU MLP (config.json's
    num_experts, or num_local_experts for Mixtral)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k). Routing is dropless: every token reaches its k."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width (Qwen3-MoE's moe_intermediate_size; intermediate_size for
    Mixtral and OLMoE, whose blocks have no dense MLP)."""
    norm_topk_prob: bool = False
    """The router: softmax over the experts, the top k of it, and with this the k weights
    renormalised to sum to 1 (Qwen3-MoE sets it; Mixtral's softmax over its top-k logits is
    the same weights, so Mixtral sets it too; OLMoE does not)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the objective (config.json's)."""
    output_router_logits: bool = False
    """Whether the load-balancing loss is trained (config.json's switch, as transformers adds it
    to the loss only then); override it in the YAML to turn the loss on or off."""
    pad_token_id: int | None = None
    """The padding token (config.json's): transformers' embedding never trains its row
    (nn.Embedding's padding_idx), and neither does megaray's lookup."""
    initializer_range: float = 0.02
    """Standard deviation of the normal initialization of matrices."""
    sliding_window: int | None = None
    """The attention window. With ``layer_types`` the window of the sliding blocks; without,
    Mistral's (and Phi-3's) window over every block, where megaray computes full causal
    attention, so sequences may not be longer than it."""
    architecture: str | None = None
    """Hugging Face architecture name (set from model.from; used by megaray export)."""

    def __post_init__(self):
        if self.shape is not None and self.shape not in SHAPES:
            raise ConfigError("model.shape", f"unknown shape {self.shape!r}; known: {sorted(SHAPES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}", f"must be a positive integer (got {getattr(self, key)})")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "model.num_key_value_heads",
                f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError("model.num_attention_heads", "must divide hidden_size when head_dim is not set")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ConfigError("model.head_dim", f"must be even for rotary embeddings (got {self.head_dim})")
        if self.rms_norm_eps <= 0:
            raise ConfigError("model.rms_norm_eps", "must be > 0")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError("model.pad_token_id", f"must be a token id below vocab_size={self.vocab_size} "
                                                    f"(got {self.pad_token_id})")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ConfigError("model.qk_norm_scope", f"must be head or projection (got {self.qk_norm_scope!r})")
        if self.norm_placement not in ("pre", "post", "sandwich"):
            raise ConfigError("model.norm_placement", f"must be pre, post or sandwich (got {self.norm_placement!r})")
        if self.norm_placement == "post" and (self.num_experts or not self.qk_norm
                                              or self.qk_norm_scope != "projection" or self.attention_bias):
            raise ConfigError("model.norm_placement", "post norms are OLMo 2's, a dense family with q/k norms over "
                                                      "the whole projections (qk_norm: true, qk_norm_scope: "
                                                      "projection) and no biases")
        if self.num_experts < 0:
            raise ConfigError("model.num_experts", f"must be >= 0 (got {self.num_experts})")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError("model.num_experts_per_tok", f"must be 1..num_experts={self.num_experts} "
                                                               f"(got {self.num_experts_per_tok})")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("model.moe_intermediate_size", "must be a positive integer for a mixture of "
                                                                 f"experts (got {self.moe_intermediate_size})")
        if self.moe:
            self._check_moe_family()
        if self.router_aux_loss_coef < 0:
            raise ConfigError("model.router_aux_loss_coef", f"must be >= 0 (got {self.router_aux_loss_coef})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ConfigError("model.partial_rotary_factor", f"{self.partial_rotary_factor} x head_dim={self.head_dim} "
                                                             "must be a positive even number of dimensions")
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        self._check_gemma_keys()

    def _check_gemma_keys(self) -> None:
        """Gemma 3's keys: per-block windows, the four norms, the activation."""
        if self.norm_placement == "sandwich" and (self.moe or self.attention_bias):
            raise ConfigError("model.norm_placement", "sandwich norms are Gemma 3's, a dense family without "
                                                      "attention biases")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError("model.hidden_act", f"must be silu or gelu_pytorch_tanh (got {self.hidden_act!r})")
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ConfigError("model.query_pre_attn_scalar", f"must be > 0 (got {self.query_pre_attn_scalar})")
        if self.layer_types is None:
            return
        kinds = ("sliding_attention", "full_attention")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in kinds for t in self.layer_types):
            raise ConfigError("model.layer_types", f"must list {self.num_hidden_layers} of {kinds}, one a block "
                                                   f"(got {self.layer_types!r})")
        if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                            and self.sliding_window > 0):
            raise ConfigError("model.sliding_window", "a positive window is needed where layer_types has "
                                                      f"sliding_attention (got {self.sliding_window!r})")

    def window(self, layer: int) -> int | None:
        """Block ``layer``'s attention window (tokens a query sees, itself included), or None
        for full causal attention."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def local_blocks(self) -> int:
        """How many blocks attend through a sliding window."""
        return sum(1 for t in self.layer_types or () if t == "sliding_attention")

    @property
    def local_window(self) -> int | None:
        """The sliding-window blocks' window, or None where every block attends fully."""
        windowed = self.layer_types is not None and "sliding_attention" in self.layer_types
        return self.sliding_window if windowed else None

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head that rotary turns (HF: int(head_dim x partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        kind = rs.get("rope_type", rs.get("type"))
        need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
                "linear": ("factor",)}
        if kind not in need:
            raise ConfigError("model.rope_scaling", f"rope_type {kind!r} is not supported (llama3, longrope or "
                                                    "linear)")
        for k in need[kind]:
            if k not in rs:
                raise ConfigError(f"model.rope_scaling.{k}", f"is required for rope_type {kind!r}")
        if kind == "longrope":
            for k in ("short_factor", "long_factor"):
                if not isinstance(rs[k], list) or len(rs[k]) != self.rotary_dim // 2:
                    raise ConfigError(f"model.rope_scaling.{k}", f"must be a list of rotary_dim / 2 = "
                                                                 f"{self.rotary_dim // 2} numbers")

    @classmethod
    def from_shape(cls, shape: str, **overrides) -> ModelConfig:
        """A registered shape with some keys overridden."""
        if shape not in SHAPES:
            raise ConfigError("model.shape", f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
        return cls(**{**SHAPES[shape], "shape": shape, **overrides})

    def _check_moe_family(self) -> None:
        """A mixture of experts is one of three Hugging Face families, each a fixed set of
        differences (its names, its router, its q/k norms): the family is ``architecture``, or,
        unset, the one its keys describe, so that the layout's names and ``megaray export``
        agree."""
        families = {   # architecture: (q/k norm scope or None, norm_topk_prob required or None)
            "Qwen3MoeForCausalLM": ("head", None), "OlmoeForCausalLM": ("projection", None),
            "MixtralForCausalLM": (None, True)}
        scope = self.qk_norm_scope if self.qk_norm else None
        if self.architecture is None:
            self.architecture = next(a for a, (s, _) in families.items() if s == scope)
        if self.architecture not in families:
            raise ConfigError("model.num_experts", f"{self.architecture} is not a mixture of experts; "
                                                   f"those are {sorted(families)}")
        want_scope, want_norm = families[self.architecture]
        if scope != want_scope:
            raise ConfigError("model.qk_norm", f"{self.architecture} has {want_scope or 'no'} q/k norms "
                                               f"(got {scope or 'none'})")
        if want_norm is not None and self.norm_topk_prob != want_norm:
            raise ConfigError("model.norm_topk_prob", f"{self.architecture}'s router renormalises its top-k "
                                                      "weights (true)")

    @property
    def moe(self) -> bool:
        """A mixture of experts (every block's MLP is experts and their router)."""
        return self.num_experts > 0

    def num_params(self) -> int:
        """Every parameter: what the host holds and the optimizer updates."""
        return self._params(self.num_experts)

    def active_params(self) -> int:
        """The parameters a token's compute reads: a dense model's all; a mixture of experts'
        with k of its experts (and the whole router): what TFLOP/s counts."""
        return self._params(self.num_experts_per_tok) if self.moe else self.num_params()

    def _params(self, experts: int) -> int:
        """The count with ``experts`` experts' matrices a block (and the whole router)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        block = (4 if self.norm_placement == "sandwich" else 2) * h + h * q + 2 * h * kv + q * h
        block += (experts * 3 * h * self.moe_intermediate_size + self.num_experts * h) if self.moe else 3 * h * i
        if self.attention_bias:
            block += q + 2 * kv
        if self.qk_norm:
            block += 2 * self.head_dim if self.qk_norm_scope == "head" else q + kv
        head = h + (0 if self.tie_word_embeddings else self.vocab_size * h)
        return self.vocab_size * h + L * block + head
