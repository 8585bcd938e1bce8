"""The step of an Adam/AdamW param group: ``torch.optim``'s own functional Adam on its lists.

``"adam"`` groups decay coupled (L2, into the gradient); ``"adamw"`` groups decoupled, unless
``is_adamw`` is False. Complex parameters are updated as real ``(..., 2)`` views, as
``torch.optim.Adam``/``AdamW`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as adam_functional

from muon_plugin.group_settings import scalar


def adam_step(
    group: Mapping[str, Any], state: Mapping[Tensor, dict[str, Any]], *, foreach: bool
) -> None:
    """One Adam step on the group's parameters with gradients (state created if missing).

    ``foreach`` picks torch's foreach implementation over its per-tensor loop; a group with
    ``fused_adam`` uses the fused kernel instead.
    """
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    fused = group["fused_adam"]
    for p in group["params"]:
        if p.grad is None:
            continue
        p_state = adam_state(state[p], p, fused)
        tensors = (p, p.grad, p_state["exp_avg"], p_state["exp_avg_sq"])
        if torch.is_complex(p):
            tensors = tuple(torch.view_as_real(t) for t in tensors)
        for out, t in zip((params, grads, exp_avgs, exp_avg_sqs), tensors, strict=True):
            out.append(t)
        steps.append(p_state["step"])
    if not params:
        return
    beta1, beta2 = group["adam_betas"]
    adam_functional(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=None if fused else foreach,
        fused=fused or None,
        decoupled_weight_decay=group["algorithm"] == "adamw" and group["is_adamw"],
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=scalar(group["lr"]),
        weight_decay=group["wd"],
        eps=group["adam_eps"],
        maximize=False,
    )


def adam_state(state: dict[str, Any], p: Tensor, fused: bool) -> dict[str, Any]:
    """``state`` (the state of ``p``), given zero Adam state first if it is empty.

    The step count lives on ``p``'s device for the fused kernel, on the CPU otherwise (as
    torch.optim.Adam keeps it).
    """
    if not state:
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=p.device)
            if fused
            else torch.tensor(0.0, dtype=torch.float32)
        )
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state
