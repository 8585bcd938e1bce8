"""The step section's workloads: the matrices of a 4-layer Llama-3-8B slice (28 matrices, 0.87 B
params) and of a GPT-125M (72 matrices), fp32 params and grads, and the Llama slice again in bf16
(what FSDP's mixed precision with bf16 parameters hands over); small runs divide the matrix
dims and take fewer layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.config import Config, scale_shape
from bench.measure import ns_flops

Shapes = list[tuple[str, tuple[int, int]]]
"""(parameter name, matrix shape) of every matrix of a model."""


def llama_shapes(layers: int, div: int) -> Shapes:
    per_layer = [
        ("wq", (4096, 4096)),
        ("wk", (1024, 4096)),
        ("wv", (1024, 4096)),
        ("wo", (4096, 4096)),
        ("w1", (14336, 4096)),
        ("w3", (14336, 4096)),
        ("w2", (4096, 14336)),
    ]
    return [(f"layers.{i}.{n}", scale_shape(s, div)) for i in range(layers) for n, s in per_layer]


def gpt_shapes(layers: int, div: int) -> Shapes:
    d = 768
    per_layer = [
        ("q", (d, d)),
        ("k", (d, d)),
        ("v", (d, d)),
        ("o", (d, d)),
        ("fc", (4 * d, d)),
        ("proj", (d, 4 * d)),
    ]
    return [(f"h.{i}.{n}", scale_shape(s, div)) for i in range(layers) for n, s in per_layer]


@dataclass
class Workload:
    name: str
    params: list[torch.nn.Parameter]
    iters: int

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def flops(self) -> float:
        return sum(ns_flops(tuple(p.shape)) for p in self.params)


def make_workload(
    name: str, shapes, device: torch.device, iters: int, dtype: torch.dtype = torch.float32
) -> Workload:
    gen = torch.Generator(device=device).manual_seed(2)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, device=device, generator=gen) * 0.02).to(dtype))
        p.grad = torch.randn(shape, device=device, generator=gen).to(dtype)
        params.append(p)
    return Workload(name, params, iters)


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload of a run, before its tensors are made."""

    key: str  # as --workloads names it
    name: str  # as the tables name it
    shapes: Shapes
    iters: int  # timed steps
    dtype: torch.dtype


def workload_specs(cfg: Config) -> list[WorkloadSpec]:
    """Every workload at this run's sizes, in the order they run."""
    llama = "llama3-8b-4L" if cfg.full else f"llama3-8b-{cfg.llama_layers}L/{cfg.div}"
    llama_mats = llama_shapes(cfg.llama_layers, cfg.div)
    gpt = "gpt-125m" if cfg.full else f"gpt-125m-{cfg.gpt_layers}L/{cfg.div}"
    return [
        WorkloadSpec("llama", llama, llama_mats, cfg.step_iters_large, torch.float32),
        WorkloadSpec(
            "gpt", gpt, gpt_shapes(cfg.gpt_layers, cfg.div), cfg.step_iters_small, torch.float32
        ),
        WorkloadSpec(
            "llama-bf16", f"{llama} bf16", llama_mats, cfg.step_iters_large, torch.bfloat16
        ),
    ]
