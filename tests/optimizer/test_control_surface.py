"""The backend name is the one way to choose a path: modifiers take features away, the
environment's switches are overrides read once (when the optimizer is built), shown in the plan
report, and no environment variable is read while a step runs."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

from muon_plugin import MuonForeach
from muon_plugin.orthogonalize import (
    canonical_backend,
    get_backend,
    validate_backend,
    with_overrides,
)

PACKAGE = str(Path(__file__).resolve().parents[2] / "muon_plugin")


def test_modifiers_take_features_away_and_name_the_backend():
    auto = get_backend("auto")
    reduced = get_backend("auto:no-gram,no-tma")
    assert auto.features.gram and auto.features.tma
    assert not reduced.features.gram and not reduced.features.tma and reduced.features.triton
    assert canonical_backend("auto:no-tma,no-gram") == "auto:no-gram,no-tma"
    assert get_backend("eager:no-triton").features.graphs is False
    assert not get_backend("auto:no-triton").elementwise_kernels()
    assert with_overrides("auto", frozenset({"graphs"})) == "auto:no-graphs"
    assert with_overrides("auto:no-gram", frozenset({"tma"})) == "auto:no-gram,no-tma"
    assert with_overrides("plain", frozenset()) == "plain"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("auto:gram", r"'gram' is no modifier; expected 'no-<feature>'"),
        ("auto:no-speed", r"'no-speed' is no modifier"),
        ("fast", r"unknown backend 'fast'; expected one of \('auto', 'eager'"),
        ("auto:", r"no modifier after ':'"),
    ],
)
def test_a_bad_name_says_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        validate_backend(name)


def test_the_environment_is_read_once_when_the_optimizer_is_built(monkeypatch):
    p = torch.nn.Parameter(torch.randn(8, 16))
    monkeypatch.setenv("MUON_PLUGIN_DISABLE_GRAM", "1")
    monkeypatch.setenv("MUON_PLUGIN_SYRK_TMA", "0")
    opt = MuonForeach([p], lr=0.02)
    monkeypatch.delenv("MUON_PLUGIN_DISABLE_GRAM")  # later changes do not reach this optimizer
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.backend_overrides == frozenset({"gram", "tma"})
    assert "auto:no-gram,no-tma: " in opt.format_plan_report()
    fresh = MuonForeach([p], lr=0.02)
    assert fresh.backend_overrides == frozenset({"tma"})


class RecordingEnviron(dict):
    """``os.environ`` that records the keys the package's own code reads."""

    def __init__(self, data, reads: list[str]) -> None:
        super().__init__(data)
        self.reads = reads

    def _record(self, key) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(PACKAGE):
                self.reads.append(str(key))
                return
            frame = frame.f_back

    def get(self, key, default=None):
        self._record(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._record(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._record(key)
        return super().__contains__(key)


@pytest.mark.parametrize("state_dtype", [None, "int8", "bf16"])
def test_no_environment_variable_is_read_while_a_step_runs(monkeypatch, state_dtype):
    from muon_plugin import MuonLP

    params = [torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(3, 8, 8))]
    vector = torch.nn.Parameter(torch.randn(8))
    groups = [{"params": params}, {"params": [vector], "algorithm": "adamw"}]
    if state_dtype is None:
        opt = MuonForeach(groups, lr=0.02)
    else:
        pytest.importorskip("torchao")
        opt = MuonLP(groups, lr=0.02, state_dtype=state_dtype)
    reads: list[str] = []
    monkeypatch.setattr(os, "environ", RecordingEnviron(os.environ, reads))
    for _ in range(2):
        for p in (*params, vector):
            p.grad = torch.randn_like(p)
        opt.step()
    assert reads == [], reads


def test_qk_clip_reads_no_environment_variable_while_it_records_and_clips(monkeypatch):
    """QK-Clip's one switch (``MUON_PLUGIN_QK_CLIP_FLEX``) is read when the clip is built; the
    statistic of every attention call and the clip after the step read nothing."""
    from qk_clip_support import GQALayer

    from muon_plugin.qk_clip import QKClip, Visibility

    layer = GQALayer(16, 4, 2, 4)
    clip = QKClip([layer.heads()], tau=0.1)
    q, k = layer.qk(torch.randn(2, 12, 16))
    reads: list[str] = []
    monkeypatch.setattr(os, "environ", RecordingEnviron(os.environ, reads))
    for _ in range(2):
        clip.record(0, q, k, visible=Visibility(causal=True))
        clip.step()
    # the per-call path choice on CUDA tensors (a stand-in: only ``is_cuda`` is asked)
    import muon_plugin.qk_clip.logits as logits

    logits._flex_available(types.SimpleNamespace(is_cuda=True), True)
    assert clip.report().clipped and reads == [], reads
