"""Orthogonalization: the approximate polar factor ``U V^T`` of a (batched) matrix.

Pure functions, no optimizer state. One iteration loop, :func:`zeropower`, is driven by a
coefficient schedule; the strategies differ only in their schedule:

- ``"newton_schulz"``: the fixed quintic ``(3.4445, -4.7750, 2.0315)`` of Muon's reference.
- ``"polar_express"``: the per-step optimal quintics of Polar Express (arXiv:2505.16932),
  with its safety handling (every polynomial but the last divided by 1.01 / 1.01^3 / 1.01^5,
  and the input normalized by ``1.01 * ||X||_F``).

Each step on ``X`` (``m <= n``; tall inputs are transposed so the Gram matrix is the small one):

    A = X @ X^T;   B = b*A + c*A@A;   X = a*X + B@X

``X @ X^T`` and ``A @ A`` (= ``A @ A^T``, ``A`` symmetric) go through
:func:`muon_plugin.kernels.gram`, which uses the Triton symmetric kernel on a GPU where it is
faster and ``torch`` matmuls everywhere else.

:func:`orthogonalize_stack` applies a :class:`MatrixSpec` (flattening, row blocks of fused
weights, the learning-rate shape rule) to a stack of whole parameter-shaped updates; it is the
one entry point the optimizer and the distributed plan call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import Tensor

from muon_plugin.defaults import LR_ADJUSTMENTS, MAX_NS_STEPS, NS_EPS, STRATEGIES
from muon_plugin.kernels import gram, kernel_handles

Coefficients = tuple[float, float, float]

NEWTON_SCHULZ_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)

# Polar Express, degree 5, l0 = 1e-3 (Amsel et al., arXiv:2505.16932, Algorithm 1).
# Later steps repeat the last polynomial, which is the fixed point of the scheme.
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01

MAX_STEPS = MAX_NS_STEPS
EPS = NS_EPS


@dataclass(frozen=True)
class Schedule:
    """The coefficients of every step, and the factor the input norm is inflated by."""

    coefficients: tuple[Coefficients, ...]
    norm_safety: float


def validate_steps(steps: object, strategy: object) -> None:
    """Raise ValueError unless ``strategy`` is known and can run ``steps`` iterations."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"unknown orthogonalization_strategy {strategy!r}; expected one of {STRATEGIES}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < MAX_STEPS:
        raise ValueError(
            f"ns_steps={steps!r} cannot be run by {strategy!r}: "
            f"it needs an integer number of steps in [1, {MAX_STEPS})"
        )


def validate_coefficients(coefficients: object) -> None:
    """Raise ValueError unless ``coefficients`` is None or three finite numbers ``(a, b, c)``."""
    if coefficients is None:
        return
    ok = (
        isinstance(coefficients, (tuple, list))
        and len(coefficients) == 3
        and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
            for c in coefficients
        )
    )
    if not ok:
        raise ValueError(
            f"ns_coefficients must be three finite numbers (a, b, c), got {coefficients!r}"
        )


@cache
def coefficient_schedule(
    strategy: str, steps: int, coefficients: Coefficients | None = None
) -> Schedule:
    """The coefficient schedule of ``strategy`` for ``steps`` iterations.

    ``coefficients`` (torch.optim.Muon's ``ns_coefficients``) replace the strategy's schedule
    by one fixed quintic for every step, with the input normalized by ``||X||_F`` alone.
    """
    validate_steps(steps, strategy)
    if coefficients is not None:
        validate_coefficients(coefficients)
        a, b, c = (float(x) for x in coefficients)
        return Schedule(((a, b, c),) * steps, 1.0)
    if strategy == "newton_schulz":
        return Schedule((NEWTON_SCHULZ_COEFFICIENTS,) * steps, 1.0)
    s = POLAR_EXPRESS_SAFETY
    safe = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    table = safe + [POLAR_EXPRESS_COEFFICIENTS[-1]]
    coefficients = tuple(table[min(i, len(table) - 1)] for i in range(steps))
    return Schedule(coefficients, s)


def lr_shape_factor(rows: int, cols: int, rule: str) -> float:
    """The factor Muon's learning rate is multiplied by for a ``rows x cols`` matrix."""
    if rule == "keller":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(rows / cols)
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown lr_adjust {rule!r}; expected one of {LR_ADJUSTMENTS}")


def zeropower(
    G: Tensor,
    steps: int = 5,
    strategy: str = "polar_express",
    *,
    scale: float = 1.0,
    eps: float = EPS,
    overwrite_input: bool = False,
    gram_space: bool | None = None,
    coefficients: Coefficients | None = None,
) -> Tensor:
    """Approximate polar factor ``scale * U V^T`` of ``G`` (``..., m, n``), computed in bf16.

    Leading dimensions are a batch. ``scale`` is folded into the last step, so scaling the
    result costs nothing. The caller's tensor is left untouched unless ``overwrite_input`` is
    set and ``G`` is a contiguous bf16 scratch buffer, which may then be overwritten.
    ``gram_space`` picks :func:`iterate_gram` (True) or :func:`iterate` (False); by default
    :func:`use_gram_iteration` decides from the shape. ``coefficients`` replace the
    strategy's schedule (see :func:`coefficient_schedule`).

    The input is divided by ``safety * ||G||_F`` (see :class:`Normalization`): where the
    first step's ``m x m`` products run in the Triton kernel that division is folded into
    them, elsewhere the bf16 copy is scaled in place first.
    """
    if G.ndim < 2:
        raise ValueError(f"zeropower needs a matrix or a batch of matrices, got {tuple(G.shape)}")
    schedule = coefficient_schedule(
        strategy, steps, None if coefficients is None else tuple(coefficients)
    )
    shape = G.shape
    X = G.reshape(-1, shape[-2], shape[-1])
    if not (overwrite_input and X.dtype == torch.bfloat16 and X.is_contiguous()):
        X = X.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    tall = X.size(-2) > X.size(-1)
    wide = X.mT if tall else X
    if gram_space is None:
        gram_space = use_gram_iteration(wide)
    run = iterate_gram if gram_space else iterate
    normalize = Normalization(schedule.norm_safety, eps)
    normalize.prescale_(X)
    X = run(wide, schedule.coefficients, scale, transpose_result=tall, normalize=normalize)
    return X.reshape(shape)


@dataclass(frozen=True)
class Normalization:
    """Divide the input by ``safety * ||X||_F``, per matrix, inside the iteration.

    Folded into the first step where its ``m x m`` products run in the Triton kernel (the
    norm is the trace of the Gram matrix, and the ``m x m`` results are scaled instead of the
    ``m x n`` input); elsewhere ``X`` is scaled in place first.
    """

    safety: float
    eps: float = EPS

    # Matrices whose max-abs exceeds this are first scaled down by a power of two: the fp32
    # sum of squares behind the norm (and the Gram matrix) overflows above ~1.8e19.
    PRESCALE_ABOVE = 2.0**32

    def prescale_(self, X: Tensor) -> None:
        """Scale each matrix of the batch ``X`` whose max-abs is huge by a power of two, in place.

        The polar factor does not depend on a positive scale, and a power of two is exact, so
        this changes nothing for ordinary inputs (the factor is exactly 1) and lets inputs with
        entries up to the dtype's maximum be orthogonalized like any other instead of giving
        an overflowed norm (an exactly zero, or non-finite, result). Non-finite inputs stay
        non-finite.
        """
        amax = torch.linalg.vector_norm(
            X, ord=math.inf, dim=(-2, -1), keepdim=True, dtype=torch.float32
        )
        big = amax > self.PRESCALE_ABOVE
        factor = torch.where(big, torch.exp2(-torch.floor(torch.log2(amax))), 1.0)
        X.mul_(factor.to(X.dtype))

    def _inverse(self, norm: Tensor) -> Tensor:
        return norm.mul_(self.safety).clamp_min_(self.eps).reciprocal_()

    def inverse_norms(self, gram_matrix: Tensor) -> Tensor:
        """``1 / (safety * ||X||_F)`` per matrix, (B, 1, 1) fp32, from ``trace(X X^T)``."""
        trace = gram_matrix.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32)
        return self._inverse(trace.clamp_min(0.0).sqrt_()).view(-1, 1, 1)

    def scale_(self, X: Tensor) -> None:
        """Divide the batch ``X`` by its norms in place."""
        # Same-dtype in-place scaling runs at memory speed; a bf16 * fp32 mix would not.
        X.mul_(self._inverse(self._norms(X)).to(X.dtype))

    def scaled_copy(self, X: Tensor, dtype: torch.dtype) -> Tensor:
        """``X`` divided by its norms, in a new ``dtype`` tensor (one pass; X's strides)."""
        out = torch.empty_like(X, dtype=dtype)
        return torch.mul(X, self._inverse(self._norms(X)), out=out)

    @staticmethod
    def _norms(X: Tensor) -> Tensor:
        return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)


def uses_q_form(X: Tensor) -> bool:
    """Whether :func:`iterate` runs the ``m x m`` products of the wide batch ``X`` in Triton."""
    m = X.size(-2)
    return kernel_handles(X[..., :m])  # the shape, dtype and device of X's Gram matrix


def uses_half_q_form(X: Tensor) -> bool:
    """Whether :func:`iterate`, where the kernel does not run, uses the fp16 cuBLAS Q-form."""
    return X.is_cuda


def iterate(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float = 1.0,
    *,
    transpose_result: bool = False,
    normalize: Normalization | None = None,
) -> Tensor:
    """Run the odd quintic iteration ``X <- a X + (b A + c A A) X`` on a wide batch ``X``.

    The terms of ``a X + B X`` nearly cancel in the first steps, and ``Q = a I + B`` is close
    to ``I`` in the last ones, so how ``Q`` is rounded decides the error:

    - where the Triton kernel handles ``A`` it forms ``Q = a I + b A + c A A`` in fp32 and
      rounds once to bf16, and the step is ``X <- Q X`` (a plain ``bmm``, no copy of ``X``);
    - elsewhere on CUDA (cuBLAS) the whole loop runs in fp16, normalized first (entries of
      order one; 3 more mantissa bits than bf16, so ``Q``, rounded twice, stays closer to the
      fp64 loop than the bf16 forms: tests), also ``X <- Q X``, and the result is cast back;
    - on the CPU, one bf16 ``baddbmm`` per step, ``X <- a X + B X`` summed in fp32.

    With ``transpose_result`` the last step computes ``X^T <- X^T Q`` (``Q`` is symmetric), so
    a tall input's result comes out contiguous in its own orientation. ``normalize`` divides
    the unnormalized input by its norm: with the kernel inside the first step (``A`` by the
    norm squared, ``Q`` by the norm), elsewhere before the loop (``X`` may be overwritten).
    """
    q_form = uses_q_form(X)
    half = not q_form and uses_half_q_form(X)
    if half:
        X = normalize.scaled_copy(X, torch.float16) if normalize else X.to(torch.float16)
        normalize = None
    elif normalize is not None and not q_form:
        normalize.scale_(X)
        normalize = None
    out = _iterate_loop(X, coefficients, scale, transpose_result, normalize, q_form or half)
    return out.to(torch.bfloat16) if half else out


def _iterate_loop(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float,
    transpose_result: bool,
    normalize: Normalization | None,
    q_form: bool,
) -> Tensor:
    """The steps of :func:`iterate`, in ``X``'s dtype: ``X <- Q X`` or one ``baddbmm``."""
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        A = gram(X)
        s = scale if i == last else 1.0
        final_transposed = i == last and transpose_result
        if q_form:
            inv = None
            if i == 0 and normalize is not None:
                inv = normalize.inverse_norms(A)
                A.mul_((inv * inv).to(A.dtype))
            Q = gram(A, alpha=c * s, C=A, beta=b * s, gamma=a * s)
            if inv is not None:
                Q.mul_(inv.to(Q.dtype))
            if final_transposed:
                return torch.bmm(X.mT, Q)
            X = torch.bmm(Q, X)
            continue
        B = gram(A, alpha=c, C=A, beta=b)
        if _is_transposed(X):
            # A tall input seen through .mT: update its contiguous tall form, X^T <- X^T Q
            # (baddbmm copies its input, and a contiguous copy is a plain memcpy).
            T = torch.baddbmm(X.mT, X.mT, B, beta=a * s, alpha=s)
            if final_transposed:
                return T
            X = T.mT
            continue
        if final_transposed:
            return torch.baddbmm(X.mT, X.mT, B, beta=a * s, alpha=s)
        X = torch.baddbmm(X, B, X, beta=a * s, alpha=s)
    return X


def _is_transposed(X: Tensor) -> bool:
    """Whether the batch ``X`` is the ``.mT`` view of a contiguous batch."""
    return not X.is_contiguous() and X.mT.is_contiguous()


# Gram-space iteration: the Gram matrix is stored as GRAM_SCALE_CAP-capped ``m * X X^T`` in
# fp16 (entries of order one, 3 more mantissa bits than bf16), and X and its Gram matrix are
# re-formed after every 3 steps (every 2 below m = 256), before rounding errors in the
# accumulated polynomial grow. Measured against the fp64 loop (tests, docs/performance.md):
# with these intervals the result is closer to it than the bf16 plain loop's; one more step
# between restarts is not, for small m.
GRAM_SCALE_CAP = 8192.0


def gram_restart_interval(m: int) -> int:
    """Steps accumulated in Gram space before ``X`` and its Gram matrix are re-formed."""
    return 3 if m >= 256 else 2


# Wide enough that skipping (n / m)-sized work pays for the extra m x m products (measured
# on an H200: see docs/performance.md).
GRAM_MIN_ASPECT = 2.0


def use_gram_iteration(X: Tensor) -> bool:
    """Whether the wide batch ``X`` (``..., m, n``, ``m <= n``) is iterated in Gram space.

    On CUDA where ``n >= GRAM_MIN_ASPECT * m``; never with ``MUON_PLUGIN_DISABLE_GRAM=1``.
    The ``m x m`` products run in the Triton kernel where it handles them (``a I + b R + c R^2``
    summed in fp32, one rounding), else as fp16 cuBLAS products; either way the result is
    closer to the fp64 loop than the bf16 plain loop (tests). Not on the CPU (no fast fp16).
    """
    if os.environ.get("MUON_PLUGIN_DISABLE_GRAM", "0") == "1":
        return False
    m, n = X.shape[-2:]
    return X.is_cuda and n >= GRAM_MIN_ASPECT * m


def iterate_gram(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float = 1.0,
    *,
    transpose_result: bool = False,
    normalize: Normalization | None = None,
    restart_every: int | None = None,
) -> Tensor:
    """:func:`iterate` run on the ``m x m`` Gram matrix of a wide batch ``X`` (``m <= n``).

    Every step's ``Q_k = a I + b R_k + c R_k^2`` is a polynomial in ``R_0 = X X^T``, so all
    ``Q``s and ``R``s commute and ``R_{k+1} = Q_k R_k Q_k``: the steps run on ``m x m``
    symmetric matrices (half-cost symmetric products) and ``X`` is touched only when the
    accumulated ``Q = Q_0 Q_1 ...`` is applied, at a restart (every ``restart_every`` steps,
    default :func:`gram_restart_interval`, which bounds the error of the accumulated product)
    and at the end. For ``n >> m`` this
    skips most of the ``m x n`` work of :func:`iterate`. The ``m x m`` matrices are fp16
    (the Gram matrix scaled by ``m``), ``X`` stays bf16. Same result as :func:`iterate` up to
    rounding (tested against it). ``normalize`` divides the unnormalized input by its norm:
    the first Gram matrix (formed in fp32) by the norm squared, the first ``Q`` applied to
    ``X`` by the norm.
    """
    if restart_every is None:
        restart_every = gram_restart_interval(X.size(-2))
    s = min(float(X.size(-2)), GRAM_SCALE_CAP)
    half = torch.float16
    inv = None
    if normalize is None:
        R = gram(X, alpha=s, out_dtype=half)
    else:
        R32 = gram(X, out_dtype=torch.float32)
        inv = normalize.inverse_norms(R32)
        R = R32.mul_(inv * inv * s).to(half)
        del R32
    Q: Tensor | None = None
    taken = 0  # steps accumulated in Q since X was last re-formed
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        k = scale if i == last else 1.0
        # Z = a I + b (R / s) + c (R / s)^2, summed in fp32 and rounded once.
        Z = gram(R, alpha=c * k / s**2, C=R, beta=b * k / s, gamma=a * k, out_dtype=half)
        Q = Z if Q is None else gram(Q, Y=Z)
        taken += 1
        if i == last:
            break
        if taken == restart_every:
            X = torch.bmm(_applied(Q, inv, X.dtype), X)
            R = gram(X, alpha=s, out_dtype=half)
            Q, taken, inv = None, 0, None
        else:
            R = gram(gram(Z, Y=R), Y=Z)  # Z R Z, symmetric since Z and R commute
    assert Q is not None
    Q = _applied(Q, inv, X.dtype)
    return torch.bmm(X.mT, Q) if transpose_result else torch.bmm(Q, X)


def _applied(Q: Tensor, inv: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``Q`` (times the pending inverse norms, if any) in X's dtype, ready to multiply X."""
    return Q.to(dtype) if inv is None else (Q * inv).to(dtype)


@dataclass(frozen=True)
class MatrixSpec:
    """How a parameter's update is orthogonalized; hashable, so it keys shape groups.

    ``split_sizes`` cut the rows (dim 0) into blocks orthogonalized independently (fused QKV);
    ``flatten`` views a >2-D parameter as ``(dim0, -1)`` (conv weights) instead of a batch of
    matrices over its leading dims. ``coefficients`` (one fixed quintic for every step) replace
    the strategy's schedule when set; ``eps`` bounds the input norm from below.
    """

    steps: int = 5
    strategy: str = "polar_express"
    lr_adjust: str = "keller"
    flatten: bool = False
    split_sizes: tuple[int, ...] | None = None
    compile: bool = False
    coefficients: Coefficients | None = None
    eps: float = EPS

    def matrix_view(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(batch, rows, cols)`` of the matrices a parameter of ``shape`` is made of."""
        if self.flatten:
            return 1, shape[0], math.prod(shape[1:])
        return math.prod(shape[:-2]), shape[-2], shape[-1]

    def row_blocks(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Row-block sizes of each matrix (one block unless ``split_sizes`` is set)."""
        _, rows, _ = self.matrix_view(shape)
        return self.split_sizes or (rows,)

    def flops(self, shape: tuple[int, ...]) -> float:
        """Matmul FLOPs of orthogonalizing one parameter of ``shape`` (plain-matmul count)."""
        batch, _, cols = self.matrix_view(shape)
        total = 0.0
        for rows in self.row_blocks(shape):
            m, n = min(rows, cols), max(rows, cols)
            total += batch * self.steps * (4 * m * m * n + 2 * m**3)
        return total


def stack_bf16(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Stack same-shape tensors into one bf16 buffer (one cast-while-copy launch).

    ``out``, if given, is that buffer (``(len(tensors), *shape)``, bf16); else a new one.
    """
    if out is None:
        first = tensors[0]
        shape = (len(tensors), *first.shape)
        out = torch.empty(shape, dtype=torch.bfloat16, device=first.device)
    return torch.stack(list(tensors), out=out)


def orthogonalize_stack(
    X: Tensor | Sequence[Tensor],
    spec: MatrixSpec,
    out_dtype: torch.dtype | None = None,
    *,
    overwrite_input: bool = False,
) -> Tensor:
    """Orthogonalize a stack ``(B, *param_shape)`` of whole updates, scaled by the lr shape rule.

    ``X`` is a tensor or a sequence of same-shape tensors (stacked here into a bf16 scratch
    buffer, which is then normalized in place). Returns a bf16 tensor ``(B, *param_shape)``.
    Each matrix (or row block) is scaled by ``lr_shape_factor`` of its own shape, so
    ``param -= lr * result`` is the Muon update. ``out_dtype`` casts the whole stack once (one
    launch), which keeps the later multi-tensor update on its fast single-dtype path.
    ``overwrite_input`` lets a bf16 tensor ``X`` be used as that scratch buffer.
    """
    result = _orthogonalize_stack(X, spec, overwrite_input)
    return result if out_dtype is None else result.to(out_dtype)


def _orthogonalize_stack(
    X: Tensor | Sequence[Tensor], spec: MatrixSpec, overwrite_input: bool
) -> Tensor:
    """``orthogonalize_stack`` in bf16 (see there)."""
    if spec.compile:
        return compiled_orthogonalize_stack()(X, replace(spec, compile=False))
    scratch = overwrite_input or not isinstance(X, Tensor)
    if scratch:
        X = stack_bf16(X)
    param_shape = tuple(X.shape[1:])
    batch, rows, cols = spec.matrix_view(param_shape)
    M = X.reshape(X.size(0) * batch, rows, cols)
    blocks = spec.row_blocks(param_shape)
    if len(blocks) == 1:
        factor = lr_shape_factor(rows, cols, spec.lr_adjust)
        out = zeropower(
            M,
            spec.steps,
            spec.strategy,
            scale=factor,
            eps=spec.eps,
            overwrite_input=scratch,
            coefficients=spec.coefficients,
        )
        return out.reshape(X.shape)
    out = torch.empty(M.shape, dtype=torch.bfloat16, device=M.device)
    # Blocks of one size share a shape and a scale: orthogonalize them in one batched call.
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    for size in sorted(set(blocks)):
        picked = [s for s, b in zip(starts, blocks, strict=True) if b == size]
        stacked = torch.stack([M[:, s : s + size] for s in picked], dim=1)
        factor = lr_shape_factor(size, cols, spec.lr_adjust)
        result = zeropower(
            stacked,
            spec.steps,
            spec.strategy,
            scale=factor,
            eps=spec.eps,
            overwrite_input=True,
            coefficients=spec.coefficients,
        )
        for j, s in enumerate(picked):
            out[:, s : s + size] = result[:, j]
    return out.reshape(X.shape)


@cache
def compiled_orthogonalize_stack():
    """``orthogonalize_stack`` under ``torch.compile`` (built once, on first use)."""
    return torch.compile(orthogonalize_stack, dynamic=False)
