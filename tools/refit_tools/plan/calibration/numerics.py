"""The numerics of the fit, free of any bench: the log-log power law of V_payload / H, an exact
non-negative least squares for the few unknowns of each cost, and the relative RMS of a fit.
Pure functions of numbers, so that each can be checked on its own."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from refit_tools.plan.calibration.models import CalibrationError


def power_law(points: list[tuple[float, float]]) -> tuple[float, float]:
    xs = [math.log(r) for r, _ in points]
    ys = [math.log(v) for _, v in points]
    if len({round(x, 6) for x in xs}) < 2:
        raise CalibrationError("V_payload needs refit results at two or more change rates")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return math.exp(my - slope * mx), slope


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-10:  # unit-norm columns: a (nearly) dependent one
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(
    rows: Sequence[Sequence[float]], targets: Sequence[float], weights: Sequence[float]
) -> list[float]:
    """Non-negative weighted least squares: the x >= 0 minimising sum (w (row . x - y))^2.

    Exact for the few unknowns here: every subset of free unknowns is solved unconstrained
    (normal equations of unit-norm columns) and the best solution with all of them positive is
    kept."""
    n = len(rows[0])
    wrows = [[w * x for x in row] for row, w in zip(rows, weights, strict=True)]
    wy = [w * y for y, w in zip(targets, weights, strict=True)]
    norms = [math.sqrt(sum(r[i] ** 2 for r in wrows)) for i in range(n)]

    def residual(x: list[float]) -> float:
        return sum(
            (sum(a * b for a, b in zip(r, x, strict=True)) - y) ** 2
            for r, y in zip(wrows, wy, strict=True)
        )

    best, best_res = [0.0] * n, residual([0.0] * n)
    usable = [i for i in range(n) if norms[i] > 0]
    for size in range(1, len(usable) + 1):
        for free in itertools.combinations(usable, size):
            ata = [
                [sum(r[i] * r[j] for r in wrows) / (norms[i] * norms[j]) for j in free]
                for i in free
            ]
            aty = [sum(r[i] * y for r, y in zip(wrows, wy, strict=True)) / norms[i] for i in free]
            sol = _solve(ata, aty)
            if sol is None or min(sol) <= 0:
                continue
            x = [0.0] * n
            for i, value in zip(free, sol, strict=True):
                x[i] = value / norms[i]
            res = residual(x)
            if res < best_res * (1 - 1e-12):
                best, best_res = x, res
    return best


def rms(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    x: Sequence[float],
    totals: Sequence[float],
) -> float:
    """Root mean square of the residuals relative to each point's measured total."""
    errs = [
        (sum(a * b for a, b in zip(r, x, strict=True)) - y) / t
        for r, y, t in zip(rows, targets, totals, strict=True)
    ]
    return math.sqrt(statistics.fmean(e * e for e in errs)) if errs else 0.0
