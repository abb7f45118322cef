"""The AdamW steps the golden fixtures record (scripts/make_gpt2_fixture.py, scripts/make_llama_fixture.py)."""
import torch


def adamw_losses(model, params, x, y, n_steps, lr, betas, eps, weight_decay, clip):
    """Trains `model` on the one batch (x, y) for n_steps with torch.optim.AdamW (weight decay on the 2-D tensors
    only) and global-norm clipping at `clip`, from its current weights and fresh gradients; step i's loss is
    measured before update i. Returns the losses."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
    model.zero_grad(set_to_none=True)
    losses = []
    for _ in range(n_steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(float(loss.item()))
    return losses
