#!/usr/bin/env python3
"""Writes the Llama family's golden fixtures, tests/fixtures/llama/<name>/, from the plain-PyTorch model of
scripts/llama_torch.py: two tiny models, one batch each, and what the C++ golden test checks against.

  llama_tied_gqa   Llama 3-style: a tied head, 4 query heads over 2 key/value heads, rope_type "llama3" (its
                   original context set small, so the three frequency bands — kept, smoothed, divided — all occur)
  qwen3_untied     Qwen3-style: an untied lm_head, attention_bias (q, k, v and o biases), QK-norm, head_dim 24 with
                   hidden_size 48 (head_dim x heads is not the hidden size)

Each folder holds
  config.json, model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, model.safetensors.index.json
      the weights as a Hugging Face checkpoint of that model_type: transformers' config keys and tensor names,
      fp32, sharded;
  golden.safetensors
      inputs, targets ((B,T) token ids, as fp32: exact below 2^24, and the dtypes Strata's safetensors reader
      takes are float ones); logits (fp32 (B,T,V)) and loss (fp32 (1)) of the forward; "grad.<name>", the
      gradient of every tensor; losses (fp32 (n_steps)) of n_steps AdamW steps from the same weights with
      global-norm clipping (torch.optim.AdamW; weight decay on the 2-D tensors only, the embedding and head
      included); the hyperparameters in the metadata.

Run with Debian's PyTorch (scripts/install_deps.sh --torch):
  OMP_NUM_THREADS=2 /usr/bin/python3 scripts/make_llama_fixture.py
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_adamw import adamw_losses  # noqa: E402
from llama_torch import LlamaConfig, LlamaForCausalLM  # noqa: E402

B, T, N_STEPS = 3, 29, 10
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0

FIXTURES = {
    "llama_tied_gqa": dict(
        model_type="llama", architectures=["LlamaForCausalLM"],
        config=LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=331, max_position_embeddings=64, rms_norm_eps=1e-5,
                           rope_theta=500000.0, tie_word_embeddings=True,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
        hf={"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}),
    "qwen3_untied": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"],
        config=LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=24, vocab_size=331, max_position_embeddings=64,
                           rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, qkv_bias=True,
                           o_bias=True, qk_norm=True),
        hf={"attention_bias": True, "hidden_act": "silu"}),
}


def hf_config(spec):
    c = spec["config"]
    j = {"architectures": spec["architectures"], "model_type": spec["model_type"], "hidden_size": c.hidden_size,
         "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
         "head_dim": c.head_size(), "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
         "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
         "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    j["rope_scaling"] = dict(c.rope_scaling) if c.rope_scaling else None
    j.update(spec["hf"])
    return j


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> float32 numpy array, written in the order given."""
    header, offset, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dtype = {np.dtype(np.float32): "F32"}[a.dtype]
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for blob in blobs:
            f.write(blob)


def make(name, spec, out_root):
    c = spec["config"]
    torch.manual_seed(1234)
    model = LlamaForCausalLM(c)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # norm weights around 1, each one mattering
            else:
                p.copy_(0.1 * torch.randn_like(p))  # biases
    named = dict(model.named_parameters())  # transformers' names; a tied head has no lm_head.weight
    params = list(named.values())

    x = torch.randint(0, c.vocab_size, (B, T), dtype=torch.int64)
    y = torch.randint(0, c.vocab_size, (B, T), dtype=torch.int64)
    logits, loss = model(x, y)
    loss.backward()
    golden = {"inputs": x.numpy().astype(np.float32), "targets": y.numpy().astype(np.float32),
              "logits": logits.detach().numpy().astype(np.float32),
              "loss": np.array([loss.item()], dtype=np.float32)}
    for n, p in named.items():
        golden["grad." + n] = p.grad.detach().numpy().astype(np.float32)
    weights = {n: p.detach().numpy().astype(np.float32).copy() for n, p in named.items()}

    losses = adamw_losses(model, params, x, y, N_STEPS, LR, (BETA1, BETA2), EPS, WD, CLIP)
    golden["losses"] = np.array(losses, dtype=np.float32)

    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(spec), f, indent=2)
        f.write("\n")
    # Two shards: the embedding and the first layer in one, the rest in the other, as transformers splits.
    names = list(weights)
    first = [n for n in names if n.startswith("model.embed_tokens.") or n.startswith("model.layers.0.")]
    shards = [first, [n for n in names if n not in first]]
    index = {"metadata": {"total_size": int(sum(w.nbytes for w in weights.values()))}, "weight_map": {}}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(out, fname), {n: weights[n] for n in shard}, {"format": "pt"})
        for n in shard:
            index["weight_map"][n] = fname
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    write_safetensors(os.path.join(out, "golden.safetensors"), golden,
                      {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD, "grad_clip": CLIP,
                       "n_steps": N_STEPS, "weight_decay_on": "2-D tensors", "torch": torch.__version__})
    n_params = sum(p.numel() for p in params)
    print(f"{out}: {n_params} parameters, loss {loss.item():.6f}, after {N_STEPS} steps {losses[-1]:.6f}")


def main():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    out_root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "llama")
    for name, spec in FIXTURES.items():
        make(name, spec, os.path.normpath(out_root))


if __name__ == "__main__":
    main()
