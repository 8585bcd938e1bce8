"""The on-disk table of autotuned configs (muon_plugin.kernels.tuning_cache)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from muon_plugin.kernels.tuning_cache import TuningCache, cache_dir, read_tuning_settings


@pytest.fixture(autouse=True)
def settings_of_the_real_environment():
    """The tests point the tables elsewhere; later tests read the real environment again."""
    yield
    read_tuning_settings()


def test_configs_round_trip_through_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path))
    read_tuning_settings()
    monkeypatch.delenv("MUON_PLUGIN_AUTOTUNE_CACHE", raising=False)
    read_tuning_settings()
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
    read_tuning_settings()
    assert fresh.get("hash1", key) is None


def test_a_corrupt_file_is_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path))
    read_tuning_settings()
    cache = TuningCache("gpu", "1")
    cache.path.write_text("{not json")
    assert cache.get("h", (1,)) is None
    assert "ignoring the autotune cache" in caplog.text
    cache.put("h", (1,), {"BLOCK_M": 64})  # rewritten whole
    assert TuningCache("gpu", "1").get("h", (1,)) == {"BLOCK_M": 64}


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MUON_PLUGIN_CACHE_DIR", raising=False)
    read_tuning_settings()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    read_tuning_settings()
    assert cache_dir() == tmp_path / "muon_plugin"


def test_packaged_table_backs_the_local_one(tmp_path, monkeypatch):
    """The shipped table answers what this machine's table lacks; the local entry wins."""
    from muon_plugin.kernels import tuning_cache

    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(tuning_cache, "PACKAGED_DIR", packaged)
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path / "local"))
    read_tuning_settings()
    monkeypatch.delenv("MUON_PLUGIN_AUTOTUNE_CACHE", raising=False)
    read_tuning_settings()
    shipped = {"BLOCK_M": 128, "num_warps": 8}
    table = TuningCache("NVIDIA H200-sm90", "3.6.0")
    (packaged / table.path.name).write_text(
        json.dumps({TuningCache.entry_key("h", (1, 2)): shipped})
    )
    assert TuningCache("NVIDIA H200-sm90", "3.6.0").get("h", (1, 2)) == shipped
    assert TuningCache("NVIDIA H100-sm90", "3.6.0").get("h", (1, 2)) is None
    local = {"BLOCK_M": 64, "num_warps": 4}
    TuningCache("NVIDIA H200-sm90", "3.6.0").put("h", (1, 2), local)
    assert TuningCache("NVIDIA H200-sm90", "3.6.0").get("h", (1, 2)) == local
    monkeypatch.setenv("MUON_PLUGIN_AUTOTUNE_CACHE", "0")
    read_tuning_settings()
    assert TuningCache("NVIDIA H200-sm90", "3.6.0").get("h", (1, 2)) is None


def test_tables_of_the_same_family_back_a_gpu_without_its_own(tmp_path, monkeypatch, caplog):
    """A GPU with no table of its own takes the shipped configs of a GPU with the same compute
    capability and SM count (and Triton), not of another family; its own entries win."""
    import logging

    from muon_plugin.kernels import tuning_cache

    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(tuning_cache, "PACKAGED_DIR", packaged)
    monkeypatch.setenv("MUON_PLUGIN_CACHE_DIR", str(tmp_path / "local"))
    read_tuning_settings()
    monkeypatch.delenv("MUON_PLUGIN_AUTOTUNE_CACHE", raising=False)
    read_tuning_settings()
    h100 = TuningCache("NVIDIA H100 80GB HBM3", "3.6.0", "sm90-132sms")
    assert h100.path.name == "autotune-NVIDIA-H100-80GB-HBM3-sm90-132sms-triton3.6.0.json"
    shipped = {"BLOCK_M": 128, "num_warps": 8}
    entry = TuningCache.entry_key("h", (1, 2))
    (packaged / h100.path.name).write_text(json.dumps({entry: shipped}))

    def h200(sms: int = 132, triton: str = "3.6.0") -> TuningCache:
        return TuningCache("NVIDIA H200", triton, f"sm90-{sms}sms")

    with caplog.at_level(logging.INFO, logger="muon_plugin.kernels"):
        assert h200().get("h", (1, 2)) == shipped
    assert "from autotune-NVIDIA-H100-80GB-HBM3-sm90-132sms-triton3.6.0.json" in caplog.text
    assert h200().get("h", (3, 4)) is None  # a key the family table lacks
    assert h200(sms=114).get("h", (1, 2)) is None  # another SM count
    assert h200(triton="3.7.0").get("h", (1, 2)) is None  # another Triton
    assert TuningCache("NVIDIA H200", "3.6.0").get("h", (1, 2)) is None  # no family given
    own = {"BLOCK_M": 64, "num_warps": 4}
    h200().put("h", (1, 2), own)  # what this GPU tuned itself wins
    assert h200().get("h", (1, 2)) == own
    assert not (packaged / h200().path.name).exists()  # the shipped tables are never written
    gh200 = TuningCache("NVIDIA GH200", "3.6.0", "sm90-132sms")
    monkeypatch.setenv("MUON_PLUGIN_AUTOTUNE_CACHE", "own")  # tuning afresh: no shipped table
    read_tuning_settings()
    assert gh200.get("h", (1, 2)) is None and h100.get("h", (1, 2)) is None
    assert h200().get("h", (1, 2)) == own  # its own table still answers
    monkeypatch.setenv("MUON_PLUGIN_AUTOTUNE_CACHE", "0")
    read_tuning_settings()
    assert gh200.get("h", (1, 2)) is None


KERNEL = """
import triton
import triton.language as tl

SCALE = {scale}


@triton.jit
def helper(x):
    return x * SCALE


@triton.jit
def kernel(ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(ptr + offs, helper(tl.load(ptr + offs)))
"""


def _kernel_module(tmp_path, name: str, text: str):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_source_hash_ignores_the_kernels_place_in_its_file(tmp_path):
    """Edits elsewhere in the file keep the key (Triton's own cache_key changes with the line);
    a change to the kernel, a function it calls or a constant it reads gives a new one."""
    pytest.importorskip("triton")
    from muon_plugin.kernels.tuning_cache import source_hash

    base = _kernel_module(tmp_path, "k_base", KERNEL.format(scale=2))
    moved = _kernel_module(tmp_path, "k_moved", "\n\n# a comment\n" + KERNEL.format(scale=2))
    scaled = _kernel_module(tmp_path, "k_scaled", KERNEL.format(scale=3))
    helper = _kernel_module(
        tmp_path, "k_helper", KERNEL.format(scale=2).replace("x * SCALE", "x + SCALE")
    )
    assert base.kernel.cache_key != moved.kernel.cache_key
    assert source_hash(base.kernel) == source_hash(moved.kernel)
    assert source_hash(base.kernel) != source_hash(scaled.kernel)
    assert source_hash(base.kernel) != source_hash(helper.kernel)


def test_shipped_tables_match_the_current_kernels():
    """Every shipped config is keyed by the symmetric kernels as they are now: a kernel edit
    must come with a re-tuned table (or the table's removal), never leave dead entries."""
    pytest.importorskip("triton")
    from muon_plugin.kernels import _symmetric_triton as sym
    from muon_plugin.kernels.tuning_cache import PACKAGED_DIR, read_table

    current = {sym._POINTER.source_hash, sym._TMA.source_hash}
    for path in sorted(PACKAGED_DIR.glob("autotune-*.json")):
        # named by family (compute capability, SM count), so GPUs of that family find it
        assert re.fullmatch(r"autotune-.+-sm\d+-\d+sms-triton[\d.]+\.json", path.name), path.name
        entries = read_table(path)
        assert entries, f"{path.name}: empty or unreadable"
        for entry, config in entries.items():
            kernel_hash = entry.split("|", 1)[0]
            assert kernel_hash in current, f"{path.name}: {entry} is for another kernel source"
            assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"} <= config.keys()
