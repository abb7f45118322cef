"""GPT-2 in plain PyTorch, shaped exactly like Strata's model (scripts/make_gpt2_fixture.py and the PyTorch side
of scripts/bench_step_vs_torch.sh use it). Tied head, tanh GELU, pre-norm blocks, causal attention."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    # Fused causal attention (F.scaled_dot_product_attention, PyTorch >= 2.0): the GPU benchmark's peer uses it,
    # since it is PyTorch's fastest path; the fixture generator keeps the explicit softmax below.
    use_sdpa = False

    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        C = n_embd
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj2 = nn.Linear(4 * C, C)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def attn(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if Block.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.c_proj2(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, vocab_size, block_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()  # tied head
        loss = F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1))
        return logits, loss

    def canonical(self):
        """Parameters in Strata's canonical order (the order of its units' flat buffers)."""
        ps = [self.wte.weight, self.wpe.weight]
        for b in self.h:
            ps += [b.ln_1.weight, b.ln_1.bias, b.c_attn.weight, b.c_attn.bias, b.c_proj.weight, b.c_proj.bias,
                   b.ln_2.weight, b.ln_2.bias, b.c_fc.weight, b.c_fc.bias, b.c_proj2.weight, b.c_proj2.bias]
        ps += [self.ln_f.weight, self.ln_f.bias]
        return ps

    def init_gpt2(self, n_layer):
        with torch.no_grad():
            for p in self.canonical():
                if p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)
            for b in self.h:
                nn.init.normal_(b.c_proj.weight, 0.0, 0.02 / math.sqrt(2 * n_layer))
                nn.init.normal_(b.c_proj2.weight, 0.0, 0.02 / math.sqrt(2 * n_layer))
