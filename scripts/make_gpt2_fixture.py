#!/usr/bin/env python3
"""Writes tests/fixtures/gpt2_tiny.bin: a tiny GPT-2 built in PyTorch, one batch, and everything the C++ golden
test (tests/engine/model/gpt2_golden_test.cpp) checks against: logits, loss, every gradient, and the losses of 10
AdamW steps with global-norm clipping.

Run with Debian's PyTorch:  OMP_NUM_THREADS=2 /usr/bin/python3 scripts/make_gpt2_fixture.py

Layout (all little-endian):
  int32[256] header: [0] magic 20261101, [1] version 1, [2] n_layer, [3] n_head, [4] n_embd, [5] vocab_size,
                     [6] block_size, [7] B, [8] T, [9] n_steps, [10] num_params
  float32[64] hyper: [0] lr, [1] beta1, [2] beta2, [3] eps, [4] weight_decay, [5] grad_clip
  float32[num_params] initial parameters, in Strata's canonical order (below)
  int32[B*T] inputs, int32[B*T] targets
  float32[B*T*V] logits, float32 loss, float32[num_params] gradients (canonical order), float32[n_steps] losses

Canonical order: wte (V,C), wpe (block_size,C); per layer: ln_1.weight, ln_1.bias, attn.c_attn.weight (3C,C),
attn.c_attn.bias, attn.c_proj.weight (C,C), attn.c_proj.bias, ln_2.weight, ln_2.bias, mlp.c_fc.weight (4C,C),
mlp.c_fc.bias, mlp.c_proj.weight (C,4C), mlp.c_proj.bias; then ln_f.weight, ln_f.bias. The head is tied to wte.
Weight decay applies to the 2-D tensors only.
"""
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn

from fixture_adamw import adamw_losses
from gpt2_torch import GPT

MAGIC, VERSION = 20261101, 1
N_LAYER, N_HEAD, N_EMBD, VOCAB, BLOCK = 2, 4, 64, 331, 32
B, T, N_STEPS = 3, 29, 10  # T < block_size on purpose: the unused wpe rows must get zero gradient
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0


def flat(tensors):
    return np.concatenate([t.detach().reshape(-1).numpy().astype(np.float32) for t in tensors])


def main():
    torch.manual_seed(1234)
    model = GPT(N_LAYER, N_HEAD, N_EMBD, VOCAB, BLOCK)
    model.init_gpt2(N_LAYER)
    with torch.no_grad():
        # Noise on every norm and bias (norm weights around 1) so that each parameter matters to the test.
        for p in model.canonical():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
        for ln in [m for b in model.h for m in (b.ln_1, b.ln_2)] + [model.ln_f]:
            ln.weight.add_(1.0)
    params = model.canonical()
    init = flat(params)

    x = torch.randint(0, VOCAB, (B, T), dtype=torch.int64)
    y = torch.randint(0, VOCAB, (B, T), dtype=torch.int64)

    logits, loss = model(x, y)
    loss.backward()
    grads = flat([p.grad for p in params])
    logits_np = logits.detach().numpy().astype(np.float32).reshape(-1)
    loss0 = float(loss.item())

    losses = adamw_losses(model, params, x, y, N_STEPS, LR, (BETA1, BETA2), EPS, WD, CLIP)

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gpt2_tiny.bin")
    header = np.zeros(256, dtype=np.int32)
    header[:11] = [MAGIC, VERSION, N_LAYER, N_HEAD, N_EMBD, VOCAB, BLOCK, B, T, N_STEPS, init.size]
    hyper = np.zeros(64, dtype=np.float32)
    hyper[:6] = [LR, BETA1, BETA2, EPS, WD, CLIP]
    with open(out, "wb") as f:
        f.write(header.tobytes())
        f.write(hyper.tobytes())
        f.write(init.tobytes())
        f.write(x.numpy().astype(np.int32).tobytes())
        f.write(y.numpy().astype(np.int32).tobytes())
        f.write(logits_np.tobytes())
        f.write(struct.pack("<f", loss0))
        f.write(grads.tobytes())
        f.write(np.array(losses, dtype=np.float32).tobytes())
    print(f"wrote {os.path.relpath(out)}: {init.size} params, loss {loss0:.6f}, "
          f"losses {', '.join(f'{v:.4f}' for v in losses)}", file=sys.stderr)


if __name__ == "__main__":
    main()
