"""The on-disk table of autotuned configs (muon_plugin.kernels.tuning_cache)."""

from __future__ import annotations

import torch

from muon_plugin.kernels.tuning_cache import TuningCache, cache_dir


def test_configs_round_trip_through_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MUON_PLUGIN_AUTOTUNE_CACHE", raising=False)
    key = (4096, 14336, False, torch.bfloat16, torch.bfloat16, torch.float32, "tf32", "tma")
    config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    TuningCache("NVIDIA H200-sm90", "3.6.0").put("hash1", key, config)
    fresh = TuningCache("NVIDIA H200-sm90", "3.6.0")  # what a new process reads
    assert fresh.path.parent == tmp_path and fresh.path.name.startswith("autotune-NVIDIA-H200")
    assert fresh.get("hash1", key) == config
    assert fresh.get("hash2", key) is None  # the kernel changed
    assert fresh.get("hash1", (*key[:-1], "pointer")) is None  # another launch key
    assert TuningCache("NVIDIA H100-sm90", "3.6.0").get("hash1", key) is None  # another GPU
    assert TuningCache("NVIDIA H200-sm90", "3.7.0").get("hash1", key) is None  # another Triton
    other = {**config, "BLOCK_K": 32}
    TuningCache("NVIDIA H200-sm90", "3.6.0").put("hash1", (1, 2), other)  # merged, not replaced
    assert TuningCache("NVIDIA H200-sm90", "3.6.0").get("hash1", key) == config
    monkeypatch.setenv("MUON_PLUGIN_AUTOTUNE_CACHE", "0")
    assert fresh.get("hash1", key) is None


def test_a_corrupt_file_is_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path))
    cache = TuningCache("gpu", "1")
    cache.path.write_text("{not json")
    assert cache.get("h", (1,)) is None
    assert "ignoring the autotune cache" in caplog.text
    cache.put("h", (1,), {"BLOCK_M": 64})  # rewritten whole
    assert TuningCache("gpu", "1").get("h", (1,)) == {"BLOCK_M": 64}


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MUON_PLUGIN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "muon_plugin"
