#!/usr/bin/env python3
"""The PyTorch side of `strata bench step`: times training steps (forward, backward, AdamW) of the same GPT-2, or
(--family llama) the same tied Llama of scripts/llama_torch.py, on random tokens, on the CPU or (--device cuda) a
GPU, and prints one JSON line with tokens_per_s, step_ms and gflop_per_s (FLOPs counted as Strata counts them:
flops_per_step in engine/model/gpt2/gpt2.cpp and engine/model/llama/llama.cpp)."""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_torch import GPT, Block  # noqa: E402
from llama_torch import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=2, help="llama: key/value heads")
    ap.add_argument("--intermediate", type=int, default=1024, help="llama: the SwiGLU MLP's width")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch >= 2.0)")
    ap.add_argument("--sdpa", action="store_true", help="fused causal attention (PyTorch >= 2.0)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    Block.use_sdpa = a.sdpa
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    if a.family == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=a.width, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
            num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
            max_position_embeddings=a.context, rope_theta=500000.0, tie_word_embeddings=True))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
    else:
        model = GPT(a.layers, a.heads, a.width, a.vocab, a.context)
        model.init_gpt2(a.layers)
    model.to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if a.device == "cuda" else {}))
    step_model = torch.compile(model) if a.compile else model
    x = torch.randint(0, a.vocab, (a.batch, a.context), device=dev)
    y = torch.randint(0, a.vocab, (a.batch, a.context), device=dev)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    times = []
    for s in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if a.precision == "bf16":
            with torch.autocast(a.device, dtype=torch.bfloat16):
                _, loss = step_model(x, y)
        else:
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        dt = time.perf_counter() - t0
        if s >= a.warmup:
            times.append(dt)
        print(f"  torch step {s + 1}/{a.warmup + a.steps}: {dt * 1e3:.1f} ms", file=sys.stderr)
    med = statistics.median(times)
    C, V, L, T = a.width, a.vocab, a.layers, a.context
    tokens = a.batch * T
    if a.family == "llama":  # Llama::flops_per_step: q, k, v, o, gate, up, down and the head; causal attention
        hs = C // a.heads
        A, Q = a.heads * hs, (a.heads + 2 * a.kv_heads) * hs
        flops = 3.0 * tokens * (L * 2.0 * (C * Q + A * C + 3.0 * C * a.intermediate) + 2.0 * C * V
                                + L * 2.0 * A * (T + 1.0))
    else:
        flops = 3.0 * tokens * (L * 2.0 * 12.0 * C * C + 2.0 * C * V + L * 2.0 * C * (T + 1.0))
    impl = f"pytorch {torch.__version__}" + (" compile" if a.compile else "") + (" sdpa" if a.sdpa else "")
    print(json.dumps({"bench": "step", "family": a.family, "impl": impl, "device": a.device, "batch": a.batch, "context": T,
                      "threads": a.threads,
                      "precision": a.precision, "step_ms": med * 1e3, "tokens_per_s": tokens / med,
                      "gflop_per_s": flops / 1e9 / med, "loss": float(loss.item())}))


if __name__ == "__main__":
    main()
