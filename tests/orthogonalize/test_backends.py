"""Orthogonalization backends: the registry, the paths the built-ins resolve, and a toy backend
added through ``muon_plugin.orthogonalize.backends`` alone and run by a plan."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from muon_plugin import MuonForeach
from muon_plugin.defaults import BACKENDS
from muon_plugin.distributed.plan import plan_orthogonalization, simulate_plan
from muon_plugin.distributed.report import format_report
from muon_plugin.kernels import triton_available, use_symmetric_kernel
from muon_plugin.learning_rate import LrShapeRule, lr_shape_factor
from muon_plugin.orthogonalize import (
    IterationPath,
    MatrixSpec,
    environment_overrides,
    orthogonalize_stack,
    resolve_path,
    zeropower,
)
from muon_plugin.orthogonalize.backends import (
    Backend,
    backend_names,
    elementwise_kernels_allowed,
    register_backend,
    validate_backend,
)

GPU = torch.device("cuda", 0)  # resolution only: nothing runs on it
CPU = torch.device("cpu")
F32 = torch.float32
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not importable")
SWITCHES = (
    "MUON_PLUGIN_DISABLE_TRITON",
    "MUON_PLUGIN_DISABLE_GRAM",
    "MUON_PLUGIN_DISABLE_CUDA_GRAPHS",
    "MUON_PLUGIN_SYRK_TMA",
)


@pytest.fixture
def hopper(monkeypatch):
    """A clean environment, and a Hopper GPU as far as the resolution asks (TMA)."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("muon_plugin.orthogonalize.paths.tma_supported", lambda device: True)
    return monkeypatch


def describe(shape, stack, backend="auto", device=GPU, **spec) -> str:
    return resolve_path(shape, stack, device, F32, MatrixSpec(backend=backend, **spec)).describe()


# ---------------------------------------------------------------------- registry


def test_builtin_backends_are_the_defaults_choices():
    assert backend_names()[: len(BACKENDS)] == BACKENDS
    for name in BACKENDS:
        validate_backend(name)


@pytest.mark.parametrize("bad", ["bogus", None, 3, ""])
def test_unknown_backend_names_the_choices(bad):
    with pytest.raises(ValueError, match=r"backend .*'auto', 'eager', 'cublas', 'plain'"):
        validate_backend(bad)
    with pytest.raises(ValueError, match="backend"):
        resolve_path((4, 4), 1, CPU, F32, MatrixSpec(backend=bad))


def test_register_backend_refuses_builtins_duplicates_and_non_backends():
    with pytest.raises(ValueError, match="already registered"):
        register_backend("auto", Backend())
    register_backend("test-dup", Backend(), replace=True)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("test-dup", Backend())
    register_backend("test-dup", Backend(), replace=True)
    with pytest.raises(TypeError, match="Backend"):
        register_backend("test-fn", lambda X: X)
    with pytest.raises(ValueError, match="name"):
        register_backend("", Backend())


def test_elementwise_kernels_follow_the_backend(monkeypatch):
    assert elementwise_kernels_allowed("auto") == triton_available()
    assert elementwise_kernels_allowed("auto:no-gram") == triton_available()
    assert not elementwise_kernels_allowed("cublas")
    assert not elementwise_kernels_allowed("plain")
    assert not elementwise_kernels_allowed("auto:no-triton")
    with pytest.raises(ValueError, match="backend"):
        elementwise_kernels_allowed("bogus")
    # MUON_PLUGIN_DISABLE_TRITON=1 reaches a group's elementwise kernels through the
    # optimizer, which folds it into the backend's name when it is built.
    from muon_plugin.group_settings import group_settings

    monkeypatch.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    opt = MuonForeach([torch.nn.Parameter(torch.randn(4, 4))])
    group = opt.param_groups[0]
    assert not group_settings(group, 1, opt.backend_overrides).kernels


# ---------------------------------------------------------------------- resolution


def test_cpu_paths_are_the_plain_loop():
    for backend in BACKENDS:
        assert describe((64, 128), 3, backend, CPU) == "x, bf16, eager"
        assert describe((3, 96, 40), 2, backend, CPU) == "x, bf16, eager"


@needs_triton
def test_auto_paths_by_shape(hopper):
    assert describe((64, 128), 3) == "gram, fp16 cublas, graph"
    assert describe((128, 128), 48) == "x, fp16 cublas, graph"
    assert describe((14336, 4096), 1) == "gram, triton(tma), eager"  # tall: its transpose
    assert describe((4096, 4096), 1) == "x, triton(tma), eager"
    assert describe((1024, 4096), 8) == "gram, fp16 cublas + X X^T triton(tma), graph"
    assert describe((1024, 4096), 0) == "gram, fp16 cublas, eager"  # nothing owned here
    assert describe((128, 128), 48, compile=True) == "x, fp16 cublas, eager"
    # GPT-125M's stacks: inside a graph the kernel takes m = 768; eager, cuBLAS keeps it
    assert describe((768, 768), 48) == "x, triton(tma), graph"
    assert describe((768, 3072), 12) == "gram, triton(tma), graph"
    assert describe((3072, 768), 12) == "gram, triton(tma), graph"
    assert describe((768, 768), 48, compile=True) == "x, fp16 cublas, eager"
    assert describe((512, 512), 48) == "x, fp16 cublas, graph"  # below GRAPHED_MIN_M
    eager = resolve_path((768, 768), 48, GPU, F32, MatrixSpec(), graphs=False)
    assert eager.describe() == "x, fp16 cublas, eager"  # one-off stacks, per-unit plans
    split = describe((96, 64), 8, split_sizes=(32, 64))
    assert split == "gram, fp16 cublas; x, fp16 cublas, graph"


@needs_triton
def test_builtin_backends_differ_only_in_features(hopper):
    for shape, stack in [((64, 128), 3), ((4096, 14336), 1), ((4096, 4096), 1)]:
        auto = describe(shape, stack)
        cublas = describe(shape, stack, "cublas")
        assert "triton" not in cublas
        assert cublas == auto.replace("triton(tma)", "fp16 cublas")
        assert describe(shape, stack, "plain") == "x, bf16, eager"


@needs_triton
def test_eager_backend_is_auto_without_graphs(hopper):
    """``"eager"``: auto's paths for stacks that run eagerly, whatever the stack's size (the
    kernel's eager dispatch region included: GPT-125M's m = 768 products stay on cuBLAS)."""
    shapes = [((64, 128), 3), ((768, 768), 48), ((768, 3072), 12), ((1024, 4096), 8)]
    shapes += [((4096, 14336), 1), ((96, 64), 8)]
    for shape, stack in shapes:
        spec = MatrixSpec(split_sizes=(32, 64)) if shape == (96, 64) else MatrixSpec()
        auto_eager = resolve_path(shape, stack, GPU, F32, spec, graphs=False)
        eager = resolve_path(shape, stack, GPU, F32, replace(spec, backend="eager"))
        assert not eager.graph
        assert eager.iterations == auto_eager.iterations, shape
        assert eager.backend == "eager"
    assert describe((768, 768), 48, "eager") == "x, fp16 cublas, eager"
    assert describe((768, 3072), 12, "eager") == "gram, fp16 cublas, eager"


def test_eager_backend_is_a_constructor_choice():
    """``backend="eager"`` is accepted by the optimizer and named in its plan report."""
    from muon_plugin import MuonForeach

    params = [torch.nn.Parameter(torch.randn(24, 40)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = MuonForeach(params, lr=0.01, backend="eager")
    opt.step()
    (row,) = opt.plan_report()
    assert (row["backend"], row["path"]) == ("eager", "x, bf16, eager")


@needs_triton
def test_modifiers_and_environment_switches_take_the_same_features_away(hopper):
    """``auto:no-triton`` resolves like ``cublas``; each modifier takes its feature away; the
    environment's switches, read by ``environment_overrides`` (an optimizer reads them when it
    is built), name the same modifiers."""
    assert describe((4096, 14336), 1) == "gram, triton(tma), eager"
    assert describe((4096, 14336), 1, "auto:no-triton") == describe((4096, 14336), 1, "cublas")
    assert describe((4096, 14336), 1, "auto:no-tma") == "gram, triton(ptr), eager"
    assert describe((4096, 14336), 1, "auto:no-gram,no-tma") == "x, triton(ptr), eager"
    assert describe((64, 128), 3, "auto:no-graphs") == "gram, fp16 cublas, eager"
    assert describe((64, 128), 3) == "gram, fp16 cublas, graph"
    switches = {
        "MUON_PLUGIN_DISABLE_TRITON": ("1", "triton"),
        "MUON_PLUGIN_DISABLE_GRAM": ("1", "gram"),
        "MUON_PLUGIN_DISABLE_CUDA_GRAPHS": ("1", "graphs"),
        "MUON_PLUGIN_SYRK_TMA": ("0", "tma"),
    }
    for variable, (value, feature) in switches.items():
        hopper.setenv(variable, value)
        assert environment_overrides() == {feature}, variable
        hopper.delenv(variable)
    assert environment_overrides() == frozenset()


def test_a_one_off_zeropower_call_reads_the_environment_switches(hopper):
    """``zeropower`` is a one-off call: it resolves through the backend less the features the
    environment switches off at that call (as a one-off ``orthogonalize_stack`` does), so
    ``MUON_PLUGIN_DISABLE_TRITON=1`` gives it the ``cublas`` path, not the Triton kernel."""
    import muon_plugin.orthogonalize.api as api

    asked = []
    real = api.iteration_backend
    hopper.setattr(api, "iteration_backend", lambda name: asked.append(name) or real(name))
    G = torch.randn(16, 64)
    plain = zeropower(G)
    hopper.setenv("MUON_PLUGIN_DISABLE_TRITON", "1")
    hopper.setenv("MUON_PLUGIN_DISABLE_GRAM", "1")
    switched = zeropower(G)
    hopper.delenv("MUON_PLUGIN_DISABLE_TRITON")
    hopper.delenv("MUON_PLUGIN_DISABLE_GRAM")
    assert asked == ["auto", "auto:no-gram,no-triton"]
    torch.testing.assert_close(switched, plain, rtol=0, atol=0)  # the CPU's path either way


@needs_triton
@pytest.mark.parametrize("batch", [1, 4, 8, 32])
def test_auto_reproduces_the_per_product_dispatch(hopper, batch):
    """Today's rules: each product in the Triton kernel where ``use_symmetric_kernel`` says so
    for its own shape and whether the stack is graphed; Gram space where ``n >= 2m``; the fp16
    Q-form where the ``m x m`` products are not in the kernel."""
    for m, n in itertools.product([256, 768, 1024, 2048, 4096], [1024, 2048, 4096, 14336]):
        if m > n:
            continue
        resolved = resolve_path((m, n), batch, GPU, F32, MatrixSpec())
        got, graphed = resolved.iteration(m), resolved.graph
        mm = use_symmetric_kernel(m, m, batch, graphed)
        assert got.xx_triton == use_symmetric_kernel(m, n, batch, graphed), (m, n)
        assert got.space == ("gram" if n >= 2 * m else "x"), (m, n)
        assert got.products == ("triton" if mm else "fp16"), (m, n)


@pytest.mark.parametrize(
    "backend, scale_triton", [("auto", True), ("cublas", False), ("plain", False)]
)
def test_the_scalings_run_in_triton_on_every_auto_path_on_a_gpu(hopper, backend, scale_triton):
    """``"auto"`` runs the per-matrix scalings in the Triton scaling kernel on CUDA whatever
    its products (an eager call pays a dozen small torch ops on the host otherwise); the
    backends without Triton never do, nor does any path on the CPU."""
    for shape in [(1024, 4096), (768, 768), (4096, 14336), (8, 16)]:
        path = resolve_path(shape, 1, GPU, F32, MatrixSpec(backend=backend), graphs=False)
        assert path.iteration(shape[0]).scale_triton == scale_triton, shape
        cpu = resolve_path(shape, 1, CPU, F32, MatrixSpec(backend=backend), graphs=False)
        assert not cpu.iteration(shape[0]).scalings_in_triton, shape


def test_an_eager_path_asks_for_the_scaling_kernel(monkeypatch):
    """A path with ``scale_triton`` hands the pre-scaling and the norms to the scaling kernel
    (which falls back to the same torch ops off CUDA), with products on cuBLAS or not."""
    import muon_plugin.orthogonalize.iterations as iterations

    asked = []
    real = iterations.prescale_
    monkeypatch.setattr(
        iterations,
        "prescale_",
        lambda X, lo, hi, kernel: asked.append(kernel) or real(X, lo, hi, kernel),
    )
    G = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    plain = zeropower(G, path=IterationPath())
    flagged = zeropower(G, path=IterationPath(scale_triton=True))
    assert asked == [False, True]
    assert torch.equal(plain, flagged)


def test_zeropower_takes_a_backend_or_a_path():
    G = torch.randn(2, 24, 40, generator=torch.Generator().manual_seed(0))
    plain = zeropower(G, 5, backend="plain")
    assert torch.equal(plain, zeropower(G, 5))  # on the CPU "auto" is the plain loop
    assert torch.equal(plain, zeropower(G, 5, path=IterationPath()))
    with pytest.raises(ValueError, match="backend"):
        zeropower(G, 5, backend="bogus")


def test_builtin_backends_agree_on_the_cpu():
    X = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(1))
    results = [
        orthogonalize_stack(X, MatrixSpec(backend=b, split_sizes=(16, 32))) for b in BACKENDS
    ]
    assert all(torch.equal(r, results[0]) for r in results[1:])


# ---------------------------------------------------------------------- a backend of one's own


class SVDBackend(Backend):
    """The exact polar factor U V^T from an fp64 SVD (a toy, and an oracle)."""

    def __init__(self) -> None:
        self.resolved = 0

    def resolve(self, shape, stack, device, dtype, spec):
        self.resolved += 1
        return super().resolve(shape, stack, device, dtype, spec)

    def orthogonalize(self, M, *, scale, spec, path, overwrite_input):
        U, _, Vh = torch.linalg.svd(M.double(), full_matrices=False)
        return (scale * (U @ Vh)).to(torch.bfloat16)


def polar(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def svd_backend():
    backend = SVDBackend()
    register_backend("svd", backend, replace=True)
    return backend


def test_a_registered_backend_runs_through_the_plan(svd_backend):
    gen = torch.Generator().manual_seed(2)
    shapes = [(48, 32), (32, 80), (48, 32), (2, 24, 40)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    svd = MatrixSpec(backend="svd", output_scale=LrShapeRule("keller"))
    specs = [svd, svd, svd, MatrixSpec()]
    directions = [torch.randn(s, generator=gen) for s in shapes]
    plan = plan_orthogonalization(params, specs, names=["a", "b", "c", "experts"])
    assert svd_backend.resolved == 2  # once per shape group, when the plan is built
    for _ in range(2):
        updates = plan.run(directions)
    assert svd_backend.resolved == 2  # not per step
    for d, u in zip(directions[:3], updates[:3], strict=True):
        factor = lr_shape_factor(*d.shape, "keller")
        # Small local results come back in the parameter dtype (the executor's out-dtype
        # policy); the direction travels in bf16, the result is rounded to bf16 once.
        assert u.shape == d.shape and u.dtype == torch.float32
        assert rel_err(u, factor * polar(d.to(torch.bfloat16))) < 4e-3
    assert rel_err(updates[3], polar(directions[3])) > 4e-3  # "auto": the iteration
    rows = plan.report()
    assert [r["backend"] for r in rows] == ["svd", "svd", "auto"]
    assert [r["path"] for r in rows] == ["svd", "svd", "x, bf16, eager"]
    text = format_report(rows)
    assert "svd" in text and "auto: x, bf16, eager" in text
    # The same backend for a one-off stack (of the bf16 direction, as the plan sends it).
    one = orthogonalize_stack(directions[0].to(torch.bfloat16)[None], svd)[0]
    assert one.dtype == torch.bfloat16 and torch.equal(one.float(), updates[0])


def test_a_registered_backend_in_a_simulated_plan(svd_backend):
    spec = MatrixSpec(backend="svd")
    plan = simulate_plan([((32, 16), (4,), (torch.distributed.tensor.Shard(0),), spec)] * 3)
    assert [r["backend"] for r in plan.report()] == ["svd"]
    with pytest.raises(RuntimeError, match="cannot run"):
        plan.run([torch.zeros(8, 16)] * 3)


def test_unknown_backend_is_refused_before_planning():
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="backend 'nope'"):
        plan_orthogonalization([p], [MatrixSpec(backend="nope")])


def test_per_matrix_plans_resolve_one_unit_eagerly():
    plan = plan_orthogonalization([torch.zeros(8, 16)] * 3, [MatrixSpec()] * 3, batched=False)
    (group,) = plan.groups
    assert group.path == resolve_path((8, 16), 1, CPU, F32, MatrixSpec())


def test_iteration_paths_are_checked():
    with pytest.raises(ValueError, match="space"):
        IterationPath("y", "fp16")
    with pytest.raises(ValueError, match="Gram space"):
        IterationPath("gram", "bf16")
    assert IterationPath("x", "fp16", xx_triton=True).describe() == (
        "x, fp16 cublas + X X^T triton(ptr)"
    )


def test_the_optimizer_takes_a_backend_per_group(svd_backend):
    """``backend=`` (constructor default, per-group override): a registered backend runs the
    Muon step of its group, the others keep theirs; ``plan_report()`` names each."""
    from muon_plugin import MuonForeach

    gen = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.randn(48, 32, generator=gen))
    b = torch.nn.Parameter(torch.randn(32, 80, generator=gen))
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt = MuonForeach(
        [{"params": [a], "param_names": ["a"]}, {"params": [b], "param_names": ["b"],
                                                 "backend": "plain"}],
        lr=0.1, wd=0.0, momentum=0.0, nesterov=False, backend="svd",
    )  # fmt: skip
    grads = [torch.randn(48, 32, generator=gen), torch.randn(32, 80, generator=gen)]
    a.grad, b.grad = grads
    opt.step()
    step_a = (a0 - a.detach()) / 0.1
    expected = lr_shape_factor(48, 32, "keller") * polar(grads[0].to(torch.bfloat16))
    assert rel_err(step_a, expected) < 4e-3
    assert rel_err((b0 - b.detach()) / 0.1, polar(grads[1])) > 4e-3  # "plain": the iteration
    assert [r["backend"] for r in opt.plan_report()] == ["svd", "plain"]


def test_an_unknown_backend_is_refused_at_construction():
    from muon_plugin import Muon

    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], backend="nope")


def test_group_settings_gate_the_elementwise_kernels_by_backend():
    from muon_plugin import Muon
    from muon_plugin.group_settings import group_settings

    p = torch.nn.Parameter(torch.zeros(4, 4))
    allowed = {
        name: group_settings(Muon([p], backend=name).param_groups[0], 1).kernels
        for name in ("auto", "cublas", "plain")
    }
    assert allowed == {name: elementwise_kernels_allowed(name) for name in allowed}
    assert allowed["cublas"] is False and allowed["plain"] is False
