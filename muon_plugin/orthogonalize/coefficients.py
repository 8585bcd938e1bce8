"""Coefficient schedules of the orthogonalization iterations.

The strategies differ in their schedule (and ``"turbo_muon"`` in how the input is scaled):

- ``"newton_schulz"``: the fixed quintic ``(3.4445, -4.7750, 2.0315)`` of Muon's reference.
- ``"polar_express"``: the per-step optimal quintics of Polar Express (arXiv:2505.16932),
  with its safety handling (every polynomial but the last divided by 1.01 / 1.01^3 / 1.01^5,
  and the input normalized by ``1.01 * ||X||_F``).
- ``"turbo_muon"``: Turbo-Muon (arXiv:2512.04632): the input's rows (of its wide orientation)
  scaled by AOL, ``1 / sqrt(sum_j |A_ij|)`` from the first Gram matrix ``A = X X^T`` instead of
  dividing by the norm, then the four quintics fitted for that scaling. Meant for 4 steps (one
  fewer than the others); later steps repeat the last quintic. The row scaling ``D`` is not a
  scalar, so the iteration approximates the polar factor of ``D X``, not of ``X``
  (docs/design/turbo_aol.md measures the difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from muon_plugin.defaults import MAX_NS_STEPS, NS_EPS, STRATEGIES
from muon_plugin.errors import SettingError

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

# Turbo-Muon's quintics fitted for AOL-scaled inputs (flash-newton-schulz, the set its later
# releases and dion's fast Newton-Schulz use), one per step of its 4-step schedule.
TURBO_MUON_COEFFICIENTS: tuple[Coefficients, ...] = (
    (4.6051, -9.6552, 5.6769),
    (4.7505, -6.0861, 2.1790),
    (2.7763, -2.3190, 0.5523),
    (2.4231, -2.2861, 0.8193),
)

MAX_STEPS = MAX_NS_STEPS
EPS = NS_EPS


@dataclass(frozen=True)
class Schedule:
    """The coefficients of every step, and how the input is scaled first: divided by
    ``norm_safety * ||X||_F``, or with ``aol`` its rows scaled by AOL (``norm_safety`` unused)."""

    coefficients: tuple[Coefficients, ...]
    norm_safety: float
    aol: bool = False


def validate_steps(steps: object, strategy: object) -> None:
    """Raise ValueError unless ``strategy`` is known and can run ``steps`` iterations."""
    if strategy not in STRATEGIES:
        raise SettingError(
            "orthogonalization_strategy",
            f"unknown orthogonalization_strategy {strategy!r}; expected one of {STRATEGIES}",
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < MAX_STEPS:
        raise SettingError(
            "ns_steps",
            f"ns_steps={steps!r} cannot be run by {strategy!r}: "
            f"it needs an integer number of steps in [1, {MAX_STEPS})",
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
        raise SettingError(
            "ns_coefficients",
            f"ns_coefficients must be three finite numbers (a, b, c), got {coefficients!r}",
        )


@cache
def coefficient_schedule(
    strategy: str, steps: int, coefficients: Coefficients | None = None
) -> Schedule:
    """The coefficient schedule of ``strategy`` for ``steps`` iterations.

    ``coefficients`` (torch.optim.Muon's ``ns_coefficients``) replace the strategy's schedule
    by one fixed quintic for every step, with the input normalized by ``||X||_F`` alone (by
    AOL for ``"turbo_muon"``).
    """
    validate_steps(steps, strategy)
    aol = strategy == "turbo_muon"
    if coefficients is not None:
        validate_coefficients(coefficients)
        a, b, c = (float(x) for x in coefficients)
        return Schedule(((a, b, c),) * steps, 1.0, aol)
    if strategy == "newton_schulz":
        return Schedule((NEWTON_SCHULZ_COEFFICIENTS,) * steps, 1.0)
    if aol:
        table = TURBO_MUON_COEFFICIENTS
        return Schedule(tuple(table[min(i, len(table) - 1)] for i in range(steps)), 1.0, aol)
    s = POLAR_EXPRESS_SAFETY
    safe = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    table = safe + [POLAR_EXPRESS_COEFFICIENTS[-1]]
    coefficients = tuple(table[min(i, len(table) - 1)] for i in range(steps))
    return Schedule(coefficients, s)
