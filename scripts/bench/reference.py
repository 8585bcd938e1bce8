"""The naive reference: Newton-Schulz and Muon the way Muon's reference code writes them, eager
and per parameter (the ``ortho`` section's reference variant, the step section's reference
row)."""

from __future__ import annotations

import torch

from bench.config import LR, WD

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (a, b, c)


def naive_newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Eager bf16 quintic Newton-Schulz, the way Muon's reference code writes it."""
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


class NaiveMuon(torch.optim.Optimizer):
    """Per-parameter reference Muon: momentum + Nesterov, eager NS, decoupled weight decay."""

    def __init__(self, params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, ns_steps=5):
        super().__init__(
            params,
            dict(
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
            ),
        )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                direction = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = naive_newton_schulz(direction, group["ns_steps"])
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)
