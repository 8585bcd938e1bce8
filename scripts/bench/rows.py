"""The step section's rows, in the order they run: ours (MuonForeach per strategy and with
NorMuon, Muon, MuonLP int8 and int4, the ablations, compiled), torch's Muon, the naive
reference, fused AdamW, the elementwise part of our step alone, then the peers."""

from __future__ import annotations

import torch

from bench.ablations import cublas_below_m, identity_orthogonalization, torch_matrix_scaling
from bench.config import LR, WD, Config
from bench.peers import peer_rows
from bench.reference import NaiveMuon
from bench.row import Row
from muon_plugin import Muon, MuonForeach

BF16_ROWS = (
    "MuonForeach (polar_express)",
    "MuonForeach (NorMuon)",
    "MuonLP (int8)",
    "torch.optim.Muon",
    "AdamW(fused=True)",
    "MuonForeach elementwise only",
)
"""The rows timed on the bf16 workload (bf16 params and grads, as FSDP's mixed precision with
bf16 parameters hands them over)."""


def lp_rows() -> list[Row]:
    """MuonLP at its default settings per momentum format (skipped without torchao)."""
    try:
        from muon_plugin.lp import MuonLP, require_torchao

        require_torchao("int8")
    except Exception as e:
        why = f"MuonLP not importable ({type(e).__name__})"
        return [Row(f"MuonLP ({d})", "ours", None, skip=why) for d in ("int8", "int4")]
    return [
        Row(f"MuonLP ({d})", "ours", lambda ps, d=d: MuonLP(ps, lr=LR, wd=WD, state_dtype=d))
        for d in ("int8", "int4")
    ]


def optimizer_rows(cfg: Config) -> list[Row]:
    compile_skip = "--no-compile" if cfg.full else "skipped on small runs (use --compile)"
    rows = [
        Row(
            "MuonForeach (polar_express)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            required=True,
        ),
        Row(
            "MuonForeach (newton_schulz)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, orthogonalization_strategy="newton_schulz"),
            required=True,
        ),
        Row(  # NorMuon: the same step plus the per-row normalization (its speed budget: +3%)
            "MuonForeach (NorMuon)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, normalization="normuon"),
            required=True,
        ),
        Row(
            "MuonForeach (turbo_muon x4)",
            "ours",
            lambda ps: MuonForeach(
                ps, lr=LR, wd=WD, orthogonalization_strategy="turbo_muon", ns_steps=4
            ),
        ),
        Row("Muon (per-parameter)", "ours", lambda ps: Muon(ps, lr=LR, wd=WD), required=True),
        *lp_rows(),
        Row(
            "MuonForeach, no Gram space",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, backend="auto:no-gram"),
        ),
        Row(  # the "eager" backend: what a run short of memory chooses
            "MuonForeach, no CUDA graphs",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, backend="eager"),
            skip=None if torch.cuda.is_available() else "CUDA graphs need a GPU",
        ),
        Row(
            "MuonForeach, cuBLAS below m = 1024",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=lambda: cublas_below_m(1024),
            skip=None if torch.cuda.is_available() else "the Triton kernel needs a GPU",
        ),
        Row(
            "MuonForeach, torch per-matrix scaling",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=torch_matrix_scaling,
            skip=None if torch.cuda.is_available() else "the Triton kernel needs a GPU",
        ),
        Row(
            "MuonForeach(compile=True)",
            "ours",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD, compile=True),
            skip=None if cfg.compile_row else compile_skip,
        ),
    ]
    if hasattr(torch.optim, "Muon"):
        rows.append(
            Row(
                "torch.optim.Muon", "torch", lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=WD)
            )
        )
    else:
        rows.append(Row("torch.optim.Muon", "torch", None, skip="not in this torch"))
    rows.append(Row("naive reference Muon", "reference", lambda ps: NaiveMuon(ps)))

    def adamw(ps):
        try:
            return torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True)
        except (RuntimeError, ValueError):
            return torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True)

    rows.append(Row("AdamW(fused=True)", "torch", adamw))
    rows.append(
        Row(
            "MuonForeach elementwise only",
            "elementwise",
            lambda ps: MuonForeach(ps, lr=LR, wd=WD),
            context=identity_orthogonalization,
            required=True,
        )
    )
    rows += peer_rows()
    return rows
