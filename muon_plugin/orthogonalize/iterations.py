"""The iterations: the approximate polar factor of a batch of wide matrices, on a given path.

Each step on ``X`` (``m <= n``; tall inputs are transposed so the Gram matrix is the small one):

    A = X @ X^T;   B = b*A + c*A@A;   X = a*X + B@X

How the products run is an :class:`IterationPath`, resolved once by a backend
(:mod:`muon_plugin.orthogonalize.backends`) and passed in: nothing here chooses a kernel or
reads the environment. The symmetric products go through :func:`muon_plugin.kernels.gram`,
told by the path whether to use the Triton kernel (and its TMA loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from muon_plugin.kernels import baddbmm, bmm, gram
from muon_plugin.kernels.matrix_scale import prescale_, scale_matrices_
from muon_plugin.orthogonalize.aol import aol_factors, aol_start, scaled_gram
from muon_plugin.orthogonalize.coefficients import EPS, Coefficients, Schedule

SPACES = ("x", "gram")
PRODUCTS = ("triton", "fp16", "bf16")


@dataclass(frozen=True)
class IterationPath:
    """How one batched iteration runs; the iteration itself makes no choices.

    - ``space``: ``"x"`` runs the steps on the ``m x n`` matrix (:func:`iterate`), ``"gram"``
      on its ``m x m`` Gram matrix (:func:`iterate_gram`).
    - ``products``: the ``m x m`` products and the form of a step. ``"triton"``: the Triton
      symmetric kernel (``Q = a I + b A + c A A`` summed in fp32, rounded once; ``X <- Q X``);
      ``"fp16"``: cuBLAS in fp16 (x-space: the whole loop in fp16, ``X <- Q X``; Gram space:
      fp16 ``m x m`` matrices); ``"bf16"``: the plain loop, one bf16 ``baddbmm`` per step.
    - ``xx_triton``: the ``X X^T`` products of the ``m x n`` matrix run in the Triton kernel.
    - ``tma``: the Triton kernel may load (and store) by TMA.
    - ``scale_triton``: the per-matrix scalings run in the Triton scaling kernel even where no
      product does (one launch, not a dozen small torch ops; the same bits).
    """

    space: str = "x"
    products: str = "bf16"
    xx_triton: bool = False
    tma: bool = False
    scale_triton: bool = False

    def __post_init__(self) -> None:
        known = self.space in SPACES and self.products in PRODUCTS
        if not known or (self.space == "gram" and self.products == "bf16"):
            raise ValueError(
                f"IterationPath(space={self.space!r}, products={self.products!r}): expected "
                f"space in {SPACES} and products in {PRODUCTS} (Gram space: triton or fp16)"
            )

    @property
    def mm_triton(self) -> bool:
        """Whether the ``m x m`` products run in the Triton kernel."""
        return self.products == "triton"

    @property
    def scalings_in_triton(self) -> bool:
        """Whether the per-matrix scalings run in Triton (asked for, or a product does)."""
        return self.scale_triton or self.xx_triton or self.mm_triton

    def describe(self) -> str:
        """E.g. ``"gram, triton(tma)"``, ``"x, fp16 cublas"``, ``"x, bf16"``."""
        kernel = f"triton({'tma' if self.tma else 'ptr'})"
        products = {"triton": kernel, "fp16": "fp16 cublas", "bf16": "bf16"}[self.products]
        if self.xx_triton and not self.mm_triton:
            products += f" + X X^T {kernel}"
        return f"{self.space}, {products}"


PLAIN_PATH = IterationPath()


@dataclass(frozen=True)
class Normalization:
    """Divide the input by ``safety * ||X||_F``, per matrix, inside the iteration.

    Folded into the first step where its ``m x m`` products run in the Triton kernel (the
    norm is the trace of the Gram matrix, and the ``m x m`` results are scaled instead of the
    ``m x n`` input); elsewhere ``X`` is scaled in place first. With ``aol`` the rows of the
    wide input are scaled by AOL instead (:mod:`muon_plugin.orthogonalize.aol`), always from
    the first Gram matrix, which the first step then reuses (``safety`` is unused).
    """

    safety: float
    eps: float = EPS
    aol: bool = False

    # Matrices whose max-abs exceeds this are first scaled down by a power of two: the fp32
    # sum of squares behind the norm (and the Gram matrix) overflows above ~1.8e19.
    PRESCALE_ABOVE = 2.0**32
    # Matrices whose max-abs is below this (and not zero) are first scaled up by a power of
    # two: their norm would fall under eps (1e-7 by default) or their squares underflow, and
    # the update would come out far smaller than the same gradient's at scale 1.
    PRESCALE_BELOW = 2.0**-20

    def prescale_(self, X: Tensor, kernel: bool = False) -> None:
        """Scale each matrix of the batch ``X`` whose max-abs is huge or tiny by a power of
        two, in place.

        The polar factor does not depend on a positive scale, and a power of two is exact, so
        this changes nothing for ordinary inputs (the factor is exactly 1) and makes the
        update scale-invariant at both ends: inputs with entries up to the dtype's maximum,
        and down to its smallest, are orthogonalized like the same input at scale 1 (bit for
        bit for a power-of-two scale) instead of giving an overflowed norm (a zero or
        non-finite result) or a norm clamped to ``eps`` (a result far too small). An all-zero
        matrix stays zero; non-finite inputs stay non-finite. ``kernel``: in the Triton
        kernel (which skips the matrices left as they are), same results.
        """
        prescale_(X, self.PRESCALE_BELOW, self.PRESCALE_ABOVE, kernel)

    def _inverse(self, norm: Tensor) -> Tensor:
        return norm.mul_(self.safety).clamp_min_(self.eps).reciprocal_()

    def factors(self, gram_matrix: Tensor) -> Tensor:
        """What the wide input's rows are multiplied by, from its fp32 Gram matrix ``X X^T``:
        ``(B, 1, 1)`` inverse norms, or with ``aol`` ``(B, 1, m)`` AOL factors."""
        if self.aol:
            return aol_factors(gram_matrix, self.eps)
        return self.inverse_norms(gram_matrix)

    def inverse_norms(self, gram_matrix: Tensor) -> Tensor:
        """``1 / (safety * ||X||_F)`` per matrix, (B, 1, 1) fp32, from ``trace(X X^T)``."""
        trace = gram_matrix.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32)
        return self._inverse(trace.clamp_min(0.0).sqrt_()).view(-1, 1, 1)

    def scale_(self, X: Tensor, kernel: bool = False) -> None:
        """Divide the batch ``X`` by its norms in place (``kernel``: in the Triton kernel)."""
        scale_matrices_(X, self._inverse(self._norms(X)), kernel)

    def scaled_copy(self, X: Tensor, dtype: torch.dtype) -> Tensor:
        """``X`` divided by its norms, in a new ``dtype`` tensor (one pass; X's strides)."""
        out = torch.empty_like(X, dtype=dtype)
        return torch.mul(X, self._inverse(self._norms(X)), out=out)

    @staticmethod
    def _norms(X: Tensor) -> Tensor:
        return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float32)


def run_iteration(
    G: Tensor,
    schedule: Schedule,
    path: IterationPath,
    *,
    scale: float = 1.0,
    eps: float = EPS,
    overwrite_input: bool = False,
) -> Tensor:
    """``scale`` times the approximate polar factor of ``G`` (``..., m, n``), in bf16, on ``path``.

    The caller's tensor is left untouched unless ``overwrite_input`` is set and ``G`` is a
    contiguous bf16 scratch buffer (the result may then come back in it). The input is divided
    by ``safety * ||G||_F`` (see :class:`Normalization`), folded into the first step where its
    ``m x m`` products run in the Triton kernel, elsewhere by scaling the bf16 copy in place
    first; with ``schedule.aol`` its rows are scaled by AOL from the first Gram matrix.
    """
    shape = G.shape
    X = G.reshape(-1, shape[-2], shape[-1])
    if not (overwrite_input and X.dtype == torch.bfloat16 and X.is_contiguous()):
        X = X.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
    tall = X.size(-2) > X.size(-1)
    wide = X.mT if tall else X
    normalize = Normalization(schedule.norm_safety, eps, schedule.aol)
    normalize.prescale_(X, path.scalings_in_triton)
    kwargs = {"transpose_result": tall, "normalize": normalize, "path": path}
    if path.space == "gram":  # X is this call's to overwrite: the result may go into it
        X = iterate_gram(wide, schedule.coefficients, scale, out=X, **kwargs)
    else:
        X = iterate(wide, schedule.coefficients, scale, **kwargs)
    return X.reshape(shape)


def iterate(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float = 1.0,
    *,
    transpose_result: bool = False,
    normalize: Normalization | None = None,
    path: IterationPath = PLAIN_PATH,
) -> Tensor:
    """Run the odd quintic iteration ``X <- a X + (b A + c A A) X`` on a wide batch ``X``.

    The terms of ``a X + B X`` nearly cancel in the first steps, and ``Q = a I + B`` is close
    to ``I`` in the last ones, so how ``Q`` is rounded decides the error (``path.products``):

    - ``"triton"``: the kernel forms ``Q = a I + b A + c A A`` in fp32 and rounds once to
      bf16, and the step is ``X <- Q X`` (a plain ``bmm``, no copy of ``X``);
    - ``"fp16"`` (cuBLAS on CUDA): the whole loop runs in fp16, normalized first (entries of
      order one; 3 more mantissa bits than bf16, so ``Q``, rounded twice, stays closer to the
      fp64 loop than the bf16 forms: tests), also ``X <- Q X``, and the result is cast back;
    - ``"bf16"``: one bf16 ``baddbmm`` per step, ``X <- a X + B X`` summed in fp32.

    With ``transpose_result`` the last step computes ``X^T <- X^T Q`` (``Q`` is symmetric), so
    a tall input's result comes out contiguous in its own orientation. ``normalize`` divides
    the unnormalized input by its norm: with the kernel inside the first step (``A`` by the
    norm squared, ``Q`` by the norm), elsewhere before the loop (``X`` may be overwritten).
    With ``normalize.aol`` the first Gram matrix is formed in fp32, gives the AOL factors ``D``
    and is reused as ``D A D`` by the first step; ``D`` goes into the first ``Q`` on the kernel
    path (``X <- Q D X``), into ``X`` (scaled in place, or into the fp16 copy) elsewhere.
    """
    out = _iterate_loop(X, coefficients, scale, transpose_result, normalize, path)
    return out.to(torch.bfloat16) if path.products == "fp16" else out


def _iterate_loop(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float,
    transpose_result: bool,
    normalize: Normalization | None,
    path: IterationPath,
) -> Tensor:
    """The steps of :func:`iterate`: ``X <- Q X`` or one ``baddbmm``, in ``X``'s dtype (fp16
    on the ``"fp16"`` path). The input is normalized here: into the loop's own fp16 copy
    (dropped after the first step), inside the first step where the Triton kernel forms ``Q``,
    else by scaling ``X`` in place.

    Each ``m x m`` temporary is dropped as soon as it is used (``del``), so a step holds ``X``,
    two ``m x m`` matrices and the new ``X`` at most: for square matrices two stacks fewer
    than if each lived until it was replaced (what a CUDA graph's pool keeps between steps).
    """
    q_form = path.products != "bf16"
    xx, mm, tma = path.xx_triton, path.mm_triton, path.tma
    # AOL: the first step's Gram matrix, and the factors left to fold into its Q.
    X, normalize, first_gram, fold = _loop_input(X, normalize, path)
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        A = gram(X, kernel=xx, tma=tma) if first_gram is None else first_gram
        first_gram = None
        s = scale if i == last else 1.0
        final_transposed = i == last and transpose_result
        if q_form:
            inv = None
            if i == 0 and normalize is not None:
                inv = normalize.inverse_norms(A)
                scale_matrices_(A, inv * inv, mm)
            Q = gram(A, alpha=c * s, C=A, beta=b * s, gamma=a * s, kernel=mm, tma=tma)
            del A
            if inv is not None:
                scale_matrices_(Q, inv, mm)
            if fold is not None:  # X <- (Q D) X; Q D is not symmetric
                Q, fold = Q.mul_(fold), None
                if final_transposed:
                    return bmm(X.mT, Q.mT)
            if final_transposed:
                return bmm(X.mT, Q)
            X = bmm(Q, X)
            del Q
            continue
        B = gram(A, alpha=c, C=A, beta=b, kernel=mm, tma=tma)
        del A
        if not X.is_contiguous() and X.mT.is_contiguous():
            # A tall input seen through .mT: update its contiguous tall form, X^T <- X^T Q
            # (baddbmm copies its input, and a contiguous copy is a plain memcpy).
            T = baddbmm(X.mT, X.mT, B, beta=a * s, alpha=s)
            del B
            if final_transposed:
                return T
            X = T.mT
            continue
        if final_transposed:
            return baddbmm(X.mT, X.mT, B, beta=a * s, alpha=s)
        X = baddbmm(X, B, X, beta=a * s, alpha=s)
        del B
    return X


def _loop_input(
    X: Tensor, normalize: Normalization | None, path: IterationPath
) -> tuple[Tensor, Normalization | None, Tensor | None, Tensor | None]:
    """The loop's input, normalized here unless the kernel folds the norm into the first step
    (then ``normalize`` comes back): ``(X, normalize, first Gram matrix, factors to fold)``,
    the last two with AOL (its first Gram matrix formed here once, in fp32), else None."""
    if normalize is not None and normalize.aol:
        A32 = gram(X, out_dtype=torch.float32, kernel=path.xx_triton, tma=path.tma)
        half = path.products == "fp16"
        first_gram, X, fold = aol_start(A32, X, normalize.factors(A32), half, path.mm_triton)
        return X, None, first_gram, fold
    if path.products == "fp16":
        X = normalize.scaled_copy(X, torch.float16) if normalize else X.to(torch.float16)
        return X, None, None, None
    if normalize is not None and not path.mm_triton:
        normalize.scale_(X, path.scalings_in_triton)
        return X, None, None, None
    return X, normalize, None, None


# Gram-space iteration: the Gram matrix is stored as GRAM_SCALE_CAP-capped ``m * X X^T`` in
# fp16 (entries of order one, 3 more mantissa bits than bf16), and X and its Gram matrix are
# re-formed after every 2 steps: the accumulated ``Q`` grows, in the directions of small
# singular values, like the product of the steps' leading coefficients (8.2 x 4.1 x 3.9 for
# Polar Express's first three), and its fp16 rounding leaks the dominant direction into them;
# with 3 steps between restarts an ill-conditioned momentum (a rank-one gradient over a
# Gaussian bulk) came out with singular values of 20-45, non-finite with the kernel's mirrored
# products (tests/orthogonalize/test_gram_stability.py; docs/design/gram_space.md).
GRAM_SCALE_CAP = 8192.0
GRAM_RESTART_INTERVAL = 2  # steps accumulated in Q before X and its Gram matrix are re-formed


def iterate_gram(
    X: Tensor,
    coefficients: tuple[Coefficients, ...],
    scale: float = 1.0,
    *,
    transpose_result: bool = False,
    normalize: Normalization | None = None,
    restart_every: int | None = None,
    path: IterationPath = PLAIN_PATH,
    out: Tensor | None = None,
) -> Tensor:
    """:func:`iterate` run on the ``m x m`` Gram matrix of a wide batch ``X`` (``m <= n``).

    Every step's ``Q_k = a I + b R_k + c R_k^2`` is a polynomial in ``R_0 = X X^T``, so all
    ``Q``s and ``R``s commute and ``R_{k+1} = Q_k R_k Q_k``: the steps run on ``m x m``
    symmetric matrices (half-cost symmetric products) and ``X`` is touched only when the
    accumulated ``Q = Q_0 Q_1 ...`` is applied, at a restart (every ``restart_every`` steps,
    default :data:`GRAM_RESTART_INTERVAL`, which bounds the error of the accumulated product)
    and at the end. For ``n >> m`` this skips most of the ``m x n`` work of :func:`iterate`.
    The ``m x m`` matrices are fp16 (the Gram matrix scaled by ``m``), ``X`` stays bf16; the
    products run in the Triton kernel where ``path`` says so, else as fp16 torch products.
    Same result as :func:`iterate` up to rounding (tested against it). ``normalize`` divides
    the unnormalized input by its norm: the first Gram matrix (formed in fp32) by the norm
    squared, the first ``Q`` applied to ``X`` by the norm (with ``normalize.aol``: ``D A D``
    and ``Q D``, AOL's row factors ``D``). ``out``: a contiguous bf16 buffer
    shaped like the result (``X``, or ``X^T`` with ``transpose_result``) that the caller no
    longer needs, typically the input's own storage. Once a restart has re-formed ``X``
    elsewhere, the next ``X`` (or the result) goes into the buffer the previous one left: two
    stacks are alive at a restart however many restarts there are (one stack less to
    allocate than without ``out``).
    """
    if restart_every is None:
        restart_every = GRAM_RESTART_INTERVAL
    xx = {"kernel": path.xx_triton, "tma": path.tma}
    mm = {"kernel": path.mm_triton, "tma": path.tma}
    s = min(float(X.size(-2)), GRAM_SCALE_CAP)
    half = torch.float16
    inv = None
    if normalize is None:
        R = gram(X, alpha=s, out_dtype=half, **xx)
    else:
        R32 = gram(X, out_dtype=torch.float32, **xx)
        inv = normalize.factors(R32)  # (B, 1, 1), or AOL's (B, 1, m)
        R = scaled_gram(R32, inv, half, s)
        del R32
    Q: Tensor | None = None
    taken = 0  # steps accumulated in Q since X was last re-formed
    # ``free``: a contiguous buffer of X's size that nothing reads any more (the next X or the
    # result goes there); ``holder``: the buffer X is in, free once a restart moves X (the
    # input's storage is ``out``'s to give).
    free, holder = None, out
    last = len(coefficients) - 1
    # Temporaries are dropped (``del``) as soon as they have been used.
    for i, (a, b, c) in enumerate(coefficients):
        k = scale if i == last else 1.0
        # Z = a I + b (R / s) + c (R / s)^2, summed in fp32 and rounded once.
        Z = gram(R, alpha=c * k / s**2, C=R, beta=b * k / s, gamma=a * k, out_dtype=half, **mm)
        Q = Z if Q is None else gram(Q, Y=Z, **mm)
        taken += 1
        if i == last:
            break
        if taken == restart_every:
            del R, Z
            X = bmm(_applied(Q, inv, X.dtype), X, out=_as(free, X.shape))
            free, holder = holder, X
            Q, taken, inv = None, 0, None
            R = gram(X, alpha=s, out_dtype=half, **xx)
        else:
            R = gram(gram(Z, Y=R, **mm), Y=Z, **mm)  # Z R Z, symmetric since Z and R commute
            del Z
    del R, Z
    assert Q is not None
    Q = _applied(Q, inv, X.dtype)
    if transpose_result:  # (Q X)^T = X^T Q^T; Q^T = Q unless AOL's factors are still in it
        Qt = Q.mT if inv is not None and inv.size(-1) > 1 else Q
        return bmm(X.mT, Qt, out=_as(free, X.mT.shape))
    return bmm(Q, X, out=_as(free, X.shape))


def _as(buffer: Tensor | None, shape: torch.Size) -> Tensor | None:
    """``buffer``'s storage viewed as a contiguous tensor of ``shape`` (same element count)."""
    return None if buffer is None else buffer.view(shape)


def _applied(Q: Tensor, inv: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``Q`` (times the pending inverse norms or AOL factors, if any: ``Q diag(f)``) in X's
    dtype, ready to multiply X."""
    return Q.to(dtype) if inv is None else (Q * inv).to(dtype)
