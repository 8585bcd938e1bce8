"""PyTorch's own generic optimizer suite, ``TestOptimRenewed``, run on ``Muon`` and ``MuonForeach``.

``tests/torch_upstream/test_optim.py`` is torch's ``test/test_optim.py``, vendored unchanged (its
header says from where). Its ``TestOptimRenewed`` runs every test over the ``OptimizerInfo``
entries of ``torch.testing._internal.common_optimizers.optim_db`` (shipped in the torch wheel).
This module loads that file once per class under test, each time with ``optim_db`` replaced by a
one-entry list: torch's own ``OptimizerInfo`` of ``torch.optim.Muon`` (its sample inputs, error
inputs, declared flags and skips) with the optimizer class swapped in. The tests are instantiated
for the CPU and exposed here as ``TestOptimRenewedMuonCPU`` and ``TestOptimRenewedMuonForeachCPU``
(test names end in ``_Muon_cpu_float32`` / ``_MuonForeach_cpu_float32``).

torch's suite recognises Muon by class name (``optim_cls.__name__ == "Muon"``) to leave out the
1-D bias that Muon refuses; ``MuonForeach`` shares that restriction, so it runs under a subclass
named ``Muon`` that adds nothing (the test names still say ``MuonForeach``).

Every upstream test that does not apply is listed in ``NOT_APPLICABLE`` with the reason and shows
up as a skipped test; ``test_every_upstream_test_runs_or_has_a_reason`` fails if an upstream test
is neither run nor listed, if a listed name is stale, or if too few tests were instantiated.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import unittest
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from muon_plugin import Muon, MuonForeach

# torch's testing utilities import expecttest (a test dependency of torch, not of its wheel).
pytest.importorskip("expecttest", reason="torch.testing._internal needs the expecttest package")
from torch.testing._internal import common_device_type, common_optimizers  # noqa: E402

UPSTREAM = Path(__file__).parents[1] / "torch_upstream" / "test_optim.py"
TORCH_MUON_INFO = next(i for i in common_optimizers.optim_db if i.optim_cls is torch.optim.Muon)
CLASSES = [Muon, MuonForeach]


# Upstream tests (by their name in TestOptimRenewed) that cannot apply to Muon / MuonForeach on
# the CPU, with the reason. Each shows up as a skipped test for both classes.
_NO_FOREACH = (
    "torch's Muon OptimizerInfo declares supported_impls=(): there is no foreach flag to "
    "compare (MuonForeach is a separate class, run through this whole suite itself)"
)
_NO_FUSED = (
    "torch's Muon OptimizerInfo declares no fused implementation (supported_impls=(), "
    "supports_fused_on=())"
)
NOT_APPLICABLE: dict[str, str] = {
    "test_rosenbrock_sparse": (
        "torch's Muon OptimizerInfo declares no sparse-gradient support (supports_sparse=False)"
    ),
    "test_complex": (
        "torch's Muon OptimizerInfo declares supports_complex=False: Muon refuses complex "
        "parameters (test_errors checks that)"
    ),
    "test_complex_2d": (
        "torch's Muon OptimizerInfo declares supports_complex=False; the test also steps 1-D "
        "parameters, which Muon refuses"
    ),
    "test_foreach_matches_forloop": _NO_FOREACH,
    "test_set_default_dtype_works_with_foreach": _NO_FOREACH + "; CUDA-only test",
    "test_foreach_large_tensor": _NO_FOREACH + "; CUDA-only test",
    "test_peak_memory_foreach": _NO_FOREACH + "; CUDA-only test",
    "test_defaults_changed_to_foreach": _NO_FOREACH + "; CUDA-only test",
    "test_mixed_device_dtype": _NO_FOREACH + "; no fused either; CUDA-only test needing two GPUs",
    "test_fused_matches_forloop": _NO_FUSED,
    "test_fused_error_on_params_on_meta": _NO_FUSED,
    "test_fused_large_tensor": _NO_FUSED,
    "test_fused_does_not_step_if_foundinf": _NO_FUSED + "; CUDA-only test",
    "test_cpu_load_state_dict": _NO_FUSED + "; it also skips itself on the CPU",
    "test_fused_cpu_matches_cuda": _NO_FUSED + "; CUDA-only test",
    "test_fused_mixed_precision_state_init": (
        "tests torch.optim.Adam/AdamW's fused CUDA kernel with bf16 state only; CUDA-only test"
    ),
    "test_fused_mixed_precision_hook_skips_existing_state": (
        "tests torch.optim.Adam/AdamW's fused CUDA kernel with bf16 state only; CUDA-only test"
    ),
    "test_fused_mixed_precision_numerics": (
        "tests torch.optim.Adam/AdamW's fused CUDA kernel with bf16 state only; CUDA-only test"
    ),
    "test_second_order_optims_return_consistent_types": (
        "for optimizers whose step requires a closure (LBFGS); torch's Muon OptimizerInfo "
        "declares step_requires_closure=False"
    ),
    "test_adamw_serialization": (
        "tests torch.optim.AdamW / Adam state dicts only, not the optimizer under test"
    ),
    "test_step_iteration": "tests torch.optim.LBFGS only, not the optimizer under test",
    "test_forloop_goes_right_direction_multigpu": "CUDA-only test needing two GPUs",
    "test_state_dict_with_cuda_params": "CUDA-only test (moves the state to a CUDA device)",
}

# torch's Muon error inputs (by their ``desc``) where this project deliberately does something
# else, with the reason; test_errors runs the others, and test_deliberate_differences checks
# what happens instead.
DIFFERENT_ON_PURPOSE: dict[str, str] = {
    "only support 2D parameters": (
        ">2-D parameters are batches of matrices here (MoE expert stacks [E, m, n]; or one "
        "(dim0, -1) matrix with flatten=True), so a 3-D parameter is accepted"
    ),
    "does not support complex parameters": (
        "refused earlier: at construction, as ValueError with torch's message (torch raises "
        "RuntimeError at the first step)"
    ),
    "a param group cannot have duplicate parameters": (
        "refused with a ValueError naming the parameter (torch warns, then updates it twice "
        "per step)"
    ),
}

# Fewer runnable tests than this per class means the loading went wrong: torch's suite gives
# torch.optim.Muon 44 CPU tests, 5 of them skipped here (NOT_APPLICABLE).
MIN_RUNNABLE = 39


class _RenamedInfo(common_optimizers.OptimizerInfo):
    """torch's ``OptimizerInfo`` with another optimizer class and the test-name part it gives."""

    def __init__(self, base: common_optimizers.OptimizerInfo, optim_cls: type, name: str) -> None:
        vars(self).update(vars(base))
        self.optim_cls = optim_cls
        self._name = name
        torch_error_inputs = base.optim_error_inputs_func

        def error_inputs(device: Any, dtype: Any) -> list[Any]:
            inputs = torch_error_inputs(device, dtype)
            return [e for e in inputs if e.optimizer_error_input.desc not in DIFFERENT_ON_PURPOSE]

        self.optim_error_inputs_func = error_inputs

    @property
    def name(self) -> str:
        """The optimizer's part of the test names (torch uses ``optim_cls.__name__``)."""
        return self._name


def _as_torch_muon(cls: type) -> type:
    """``cls`` under the class name torch's suite keys its Muon-only (2-D only) branches on."""
    if cls.__name__ == "Muon":
        return cls
    return type("Muon", (cls,), {"__module__": cls.__module__, "__doc__": cls.__doc__})


@contextmanager
def _upstream_environment(info: common_optimizers.OptimizerInfo) -> Iterator[dict[str, Any]]:
    """What the vendored file needs while it executes: ``optim_db`` holding ``info`` only,
    stand-ins for the torch ``test/optim`` modules it imports test classes from (those are not
    optimizer-generic and not run here), and device instantiation restricted to the CPU.

    Yields a dict that receives the names of the upstream (generic) tests.
    """
    captured: dict[str, Any] = {}
    instantiate = common_device_type.instantiate_device_type_tests

    def instantiate_on_cpu(generic_cls: type, scope: dict[str, Any], **kwargs: Any) -> None:
        captured["tests"] = sorted(n for n in vars(generic_cls) if n.startswith("test"))
        instantiate(generic_cls, scope, **{**kwargs, "only_for": "cpu"})

    stubs: dict[str, types.ModuleType] = {"optim": types.ModuleType("optim")}
    for module, name in (
        ("test_lrscheduler", "TestLRScheduler"),
        ("test_optim", "TestDifferentiableOptimizer"),
        ("test_swa_utils", "TestSWAUtils"),
    ):
        stub = types.ModuleType(f"optim.{module}")
        setattr(stub, name, type(name, (), {"__test__": False}))
        stubs[stub.__name__] = stub
    with ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, stubs))
        stack.enter_context(mock.patch.object(common_optimizers, "optim_db", [info]))
        stack.enter_context(
            mock.patch.object(
                common_device_type, "instantiate_device_type_tests", instantiate_on_cpu
            )
        )
        # torch marks its two large-tensor CUDA tests with pytest.mark.serial, unregistered here.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings(
            "ignore", "Unknown pytest.mark.serial", pytest.PytestUnknownMarkWarning
        )
        yield captured


def _test_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """A unittest class's test methods by attribute name (what pytest collects)."""
    return {
        name: getattr(cls, name)
        for name in dir(cls)
        if name.startswith("test") and callable(getattr(cls, name))
    }


def _load_upstream(cls: type) -> tuple[type, list[str]]:
    """Run the vendored file for ``cls``: its CPU test class, with the ``NOT_APPLICABLE`` tests
    turned into skips, and the names of all upstream tests."""
    info = _RenamedInfo(TORCH_MUON_INFO, _as_torch_muon(cls), cls.__name__)
    module_name = f"_torch_upstream_test_optim_{cls.__name__}"
    spec = importlib.util.spec_from_file_location(module_name, UPSTREAM)
    assert spec is not None and spec.loader is not None, UPSTREAM
    module = importlib.util.module_from_spec(spec)
    with _upstream_environment(info) as captured:
        spec.loader.exec_module(module)
    test_class = module.TestOptimRenewedCPU
    for name, method in _test_methods(test_class).items():
        reason = NOT_APPLICABLE.get(method.__name__)  # __name__: the upstream test's name
        if reason is not None:
            setattr(test_class, name, unittest.skip(reason)(method))
    return test_class, captured["tests"]


LOADED = {cls.__name__: _load_upstream(cls) for cls in CLASSES}
# The instantiated suites, collected by pytest under these names.
TestOptimRenewedMuonCPU = LOADED["Muon"][0]
TestOptimRenewedMuonForeachCPU = LOADED["MuonForeach"][0]


def _not_instantiated() -> list[tuple[str, str]]:
    """(class, upstream test) pairs that torch's Muon OptimizerInfo leaves out entirely."""
    pairs = []
    for label, (test_class, upstream_tests) in LOADED.items():
        instantiated = {m.__name__ for m in _test_methods(test_class).values()}
        pairs += [(label, name) for name in upstream_tests if name not in instantiated]
    return pairs


@pytest.mark.parametrize(("label", "name"), _not_instantiated())
def test_not_instantiated_upstream_test(label: str, name: str) -> None:
    """An upstream test that torch's Muon OptimizerInfo does not instantiate: skipped with the
    reason from ``NOT_APPLICABLE`` (the guard below fails when there is none)."""
    if name in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[name])
    pytest.fail(f"{name} is not instantiated for {label} and has no NOT_APPLICABLE reason")


@pytest.mark.parametrize("label", list(LOADED))
def test_every_upstream_test_runs_or_has_a_reason(label: str) -> None:
    """Guard: the suite was loaded, every upstream test either runs here or is skipped with a
    stated reason, no reason is stale, and enough tests run (loading must not silently drop
    them)."""
    test_class, upstream_tests = LOADED[label]
    methods = _test_methods(test_class)
    runnable = {
        name for name, method in methods.items() if not getattr(method, "__unittest_skip__", False)
    }
    runnable_upstream = {methods[name].__name__ for name in runnable}
    assert set(NOT_APPLICABLE) <= set(upstream_tests), set(NOT_APPLICABLE) - set(upstream_tests)
    assert runnable_upstream.isdisjoint(NOT_APPLICABLE)
    missing = set(upstream_tests) - runnable_upstream - set(NOT_APPLICABLE)
    assert not missing, f"upstream tests neither run nor listed in NOT_APPLICABLE: {missing}"
    assert len(runnable) >= MIN_RUNNABLE, sorted(runnable)
    assert all(name.endswith(f"_{label}_cpu_float32") for name in runnable), sorted(runnable)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_deliberate_differences(cls: type) -> None:
    """torch's error inputs left out of test_errors (``DIFFERENT_ON_PURPOSE``), and what this
    project does instead: a 3-D parameter steps as a batch of matrices; a complex one is
    refused at construction with torch's message; a parameter given twice in a group is
    refused by name instead of warned about."""
    inputs = {
        e.optimizer_error_input.desc: e
        for e in TORCH_MUON_INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)
    }
    assert set(DIFFERENT_ON_PURPOSE) <= set(inputs), set(DIFFERENT_ON_PURPOSE) - set(inputs)
    batch = inputs["only support 2D parameters"].optimizer_error_input.params[0]
    before = batch.detach().clone()
    cls([batch], lr=0.1).step()
    assert not torch.equal(batch, before)
    complex_input = inputs["does not support complex parameters"]
    with pytest.raises(ValueError, match=complex_input.error_regex):
        cls(complex_input.optimizer_error_input.params, lr=0.1)
    twice = inputs["a param group cannot have duplicate parameters"].optimizer_error_input
    with pytest.raises(ValueError, match=r"parameter #1 .* appears twice \(positions 0 and 1\)"):
        cls(twice.params, **twice.kwargs)
