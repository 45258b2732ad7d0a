"""An independent plain-PyTorch Llama: ordinary nn.Modules, explicit attention math.

Written separately from megaray.model (no imports from it) so that parity tests compare
megaray against something that could disagree with it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn


class RefRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x.float() / torch.sqrt(var + self.eps)).to(x.dtype)


def ref_rope(x, pos, theta):
    """Rotary embedding on the half-split convention: pairs (i, i + d/2)."""
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) * 2 / d)
    ang = pos[:, None].float() * freqs[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class RefAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        hd = c["hidden_size"] // c["num_attention_heads"]
        self.hd = hd
        bias = c.get("attention_bias", False)
        self.q_proj = nn.Linear(c["hidden_size"], c["num_attention_heads"] * hd, bias=bias)
        self.k_proj = nn.Linear(c["hidden_size"], c["num_key_value_heads"] * hd, bias=bias)
        self.v_proj = nn.Linear(c["hidden_size"], c["num_key_value_heads"] * hd, bias=bias)
        self.o_proj = nn.Linear(c["num_attention_heads"] * hd, c["hidden_size"], bias=False)
        if c.get("qk_norm", False):
            self.q_norm = RefRMSNorm(hd, c["rms_norm_eps"])
            self.k_norm = RefRMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x):
        c, hd = self.c, self.hd
        B, S, _ = x.shape
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        q = self.q_proj(x).view(B, S, nh, hd)
        k = self.k_proj(x).view(B, S, nkv, hd)
        v = self.v_proj(x).view(B, S, nkv, hd)
        if c.get("qk_norm", False):
            q, k = self.q_norm(q), self.k_norm(k)
        pos = torch.arange(S)
        q = ref_rope(q.transpose(1, 2), pos, c["rope_theta"])
        k = ref_rope(k.transpose(1, 2), pos, c["rope_theta"])
        v = v.transpose(1, 2)
        outs = []
        for h in range(nh):
            kh, vh = k[:, h // (nh // nkv)], v[:, h // (nh // nkv)]
            scores = q[:, h] @ kh.transpose(-1, -2) / math.sqrt(hd)
            mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
            outs.append(torch.softmax(scores, dim=-1) @ vh)
        a = torch.stack(outs, dim=2).reshape(B, S, nh * hd)
        return self.o_proj(a)


class RefMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))


class RefBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = RefAttention(c)
        self.post_attention_layernorm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = RefMLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class RefInner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(RefBlock(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RefRMSNorm(c["hidden_size"], c["rms_norm_eps"])


class RefLlama(nn.Module):
    """Parameter names match Hugging Face's LlamaForCausalLM."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = RefInner(c)
        if not c["tie_word_embeddings"]:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.c["tie_word_embeddings"] else self.lm_head.weight
        return x @ w.t()
