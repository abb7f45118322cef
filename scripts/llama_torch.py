"""The Llama family in plain PyTorch (no transformers: it is not installable here), written from transformers'
modeling_llama.py, modeling_qwen2.py and modeling_qwen3.py and named as their checkpoints name the tensors, so that
its state_dict() is a Hugging Face checkpoint's. scripts/make_llama_fixture.py uses it.

What it follows, op for op:
  - RMSNorm (LlamaRMSNorm): the statistics in fp32, x * rsqrt(mean(x²) + eps), then weight * x;
  - RoPE (LlamaRotaryEmbedding, apply_rotary_pos_emb): inv_freq = 1 / theta^(arange(0, d, 2) / d) in fp32, with
    rope_type "llama3"'s frequency scaling (_compute_llama3_parameters) when given; freqs = positions x inv_freq,
    cos and sin of cat(freqs, freqs); q·cos + rotate_half(q)·sin, rotate_half(x) = cat(-x2, x1);
  - attention: q, k, v projections, with biases where qkv_bias (Qwen2's always; Llama's and Qwen3's with
    attention_bias, which biases o_proj too: o_bias), per-head RMSNorm of q and k before RoPE with qk_norm
    (Qwen3's q_norm, k_norm), key/value heads shared by groups of query heads (repeat_kv: repeat_interleave over
    heads), causal softmax at scale head_dim^-0.5;
  - MLP (LlamaMLP): down(silu(gate(x)) * up(x)), no biases;
  - pre-norm blocks: x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x));
  - the head: lm_head, or the embedding's matrix when tie_word_embeddings.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", "factor", ...} or empty
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def head_size(self):
        return self.head_dim or self.hidden_size // self.num_attention_heads


def rope_inv_freq(c: LlamaConfig):
    d = c.head_size()
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = c.rope_scaling
    if not s:
        return inv_freq
    assert s["rope_type"] == "llama3", s
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(c: LlamaConfig, T: int):
    """cos, sin (T, head_dim) as LlamaRotaryEmbedding.forward makes them for positions 0..T-1, in fp32."""
    inv_freq = rope_inv_freq(c)
    positions = torch.arange(T, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hs, C = c.head_size(), c.hidden_size
        self.q_proj = nn.Linear(C, c.num_attention_heads * hs, bias=c.qkv_bias)
        self.k_proj = nn.Linear(C, c.num_key_value_heads * hs, bias=c.qkv_bias)
        self.v_proj = nn.Linear(C, c.num_key_value_heads * hs, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * hs, C, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(hs, c.rms_norm_eps)
            self.k_norm = RMSNorm(hs, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        hs, NH, NKV = c.head_size(), c.num_attention_heads, c.num_key_value_heads
        q = self.q_proj(x).view(B, T, NH, hs)
        k = self.k_proj(x).view(B, T, NKV, hs)
        v = self.v_proj(x).view(B, T, NKV, hs).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = NH // NKV
        k = k.repeat_interleave(group, dim=1)  # repeat_kv
        v = v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-2, -1)) * (hs ** -0.5)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, NH * hs)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):  # transformers' LlamaModel: what sits under "model." in a checkpoint
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.model = Body(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.c.tie_word_embeddings else self.lm_head.weight

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        cos, sin = rope_cos_sin(self.c, T)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.model.norm(x), self.head_weight())
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
