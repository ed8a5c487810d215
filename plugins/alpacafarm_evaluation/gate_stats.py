"""The statistics of the CI gate: a one-sided paired non-inferiority test on per-instruction outcomes.

Every system of a benchmark answers the same instructions, each judged against the same reference output; its
per-instruction score is 1 (win), 0.5 (tie) or 0 (loss). The candidate's and the baseline's scores are paired
by instruction, and the gate looks at ``d_i = 100 · (candidate_i - baseline_i)`` (points of win-rate). With
``n`` paired instructions, mean ``Δ`` and standard error ``SE = sd(d) / sqrt(n)`` (``ddof=1``):

* ``L = Δ - t · SE`` and ``U = Δ + t · SE`` with ``t`` the ``1 - alpha`` quantile of Student's t with ``n - 1``
  degrees of freedom: each is a one-sided ``1 - alpha`` confidence bound, ``[L, U]`` the two-sided ``1 - 2 alpha``
  interval that the report prints;
* the non-inferiority p-value tests ``H0: Δ <= -margin`` against ``H1: Δ > -margin`` (paired t-test of
  ``d + margin`` against 0, one-sided): ``p = P(T_{n-1} >= (Δ + margin) / SE)``;
* the regression p-value tests ``H0: Δ >= 0`` against ``H1: Δ < 0``: ``P(T_{n-1} <= Δ / SE)``.

Verdicts (:func:`verdict`), decided on the bounds alone — the same inputs always give the same verdict:

* **PASS** — ``L > -margin`` (non-inferiority shown at level alpha: ``p < alpha``), or every output is identical;
* **FAIL** — ``L <= -margin`` and ``U < 0``: a regression is shown at level alpha (the interval excludes "no change")
  and the non-inferiority is not;
* **INCONCLUSIVE** — ``L <= -margin`` and ``U >= 0``: the interval holds both "no change" and "a regression of
  at least the margin"; the benchmark is too small (too few instructions) to decide this change.

Under noise alone (a true ``Δ = 0``) FAIL needs ``U < 0``, which happens with probability alpha, so the false-alarm
rate is at most alpha (``benchmarks/gate_false_alarm.py`` measures it). The **minimum detectable effect** is
``MDE = (t + z_power) · SE``: a true regression of MDE points FAILs with probability ``power`` (80 % by default),
and an unchanged method PASSes with that probability when the margin is at least MDE. Testing several systems
at once, the gate divides alpha among them (Bonferroni: see :func:`family_alpha`), so that the whole gate's
false-alarm rate stays at most alpha.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from alpacafarm import exit_status

PASS, FAIL, INCONCLUSIVE, STALE = "PASS", "FAIL", "INCONCLUSIVE", "STALE"
#: Exit status of ``alpacafarm bench`` for each verdict (2 stays "user error", as for every command).
EXIT_CODES = {PASS: exit_status.OK, FAIL: exit_status.FAILED, INCONCLUSIVE: exit_status.INCONCLUSIVE,
              STALE: exit_status.STALE}
#: The worst verdict of several decides the gate: a stale baseline first, then a regression, then doubt.
SEVERITY = (STALE, FAIL, INCONCLUSIVE, PASS)
DEFAULT_MARGIN = 5.0
DEFAULT_ALPHA = 0.05
DEFAULT_POWER = 0.8
#: The gate's protocol is bounded (docs/ci-gate.md): a margin of 1e9 points, an alpha of 0.9 or a power of 0.01
#: would turn the gate off by one edit. (low, high, open at low, open at high); margin in win-rate points.
PROTOCOL_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "margin": (0.0, 20.0, True, False), "alpha": (0.001, 0.2, False, False), "power": (0.5, 0.99, False, False)}



@dataclass(frozen=True)
class GateTest:
    """The outcome of one paired non-inferiority test (differences and bounds in win-rate points)."""

    n: int
    delta: float
    standard_error: float
    ci_low: float
    ci_high: float
    p_value: float
    p_regression: float
    mde: float | None
    margin: float
    alpha: float
    power: float
    identical: bool
    verdict: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def family_alpha(alpha: float, n_systems: int) -> float:
    """The per-system level when ``n_systems`` are gated together (Bonferroni: the gate's false alarms <= alpha)."""
    return alpha / max(1, n_systems)


def paired_differences(candidate: Mapping[str, float], baseline: Mapping[str, float]) -> list[float]:
    """``100 · (candidate - baseline)`` on the instructions both scored, in the baseline's order."""
    return [100.0 * (candidate[key] - baseline[key]) for key in baseline if key in candidate]


def _check(margin: float, alpha: float, power: float) -> None:
    if not margin > 0:
        raise ValueError(f"margin must be positive (win-rate points), got {margin}")
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")


def verdict(ci_low: float, ci_high: float, margin: float) -> str:
    """PASS / FAIL / INCONCLUSIVE from the one-sided bounds (see the module docstring)."""
    if ci_low > -margin:
        return PASS
    if ci_high < 0:
        return FAIL
    return INCONCLUSIVE


def non_inferiority(differences: Sequence[float], margin: float = DEFAULT_MARGIN, alpha: float = DEFAULT_ALPHA,
                    power: float = DEFAULT_POWER, *, identical: bool = False) -> GateTest:
    """The paired non-inferiority test of per-instruction differences ``d_i`` (win-rate points).

    ``identical`` (every output the same as the baseline's) is an immediate PASS, whatever the judge said.
    With no spread at all (every ``d_i`` equal) the bounds collapse onto the mean and the p-values are 0 or 1.
    """
    from scipy.stats import norm, t

    _check(margin, alpha, power)
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired test needs at least 2 instructions in common, got {n}")
    delta = math.fsum(differences) / n
    variance = math.fsum((d - delta) ** 2 for d in differences) / (n - 1)
    se = math.sqrt(variance / n)
    quantile = float(t.ppf(1 - alpha, n - 1))
    if se > 0:
        p_value = float(t.sf((delta + margin) / se, n - 1))
        p_regression = float(t.cdf(delta / se, n - 1))
    else:
        p_value = 0.0 if delta > -margin else 1.0
        p_regression = 0.0 if delta < 0 else 1.0
    low, high = delta - quantile * se, delta + quantile * se
    mde = (quantile + float(norm.ppf(power))) * se
    outcome = PASS if identical else verdict(low, high, margin)
    return GateTest(n, delta, se, low, high, p_value, p_regression, mde, margin, alpha, power, identical, outcome)


def worst(verdicts: Sequence[str]) -> str:
    """The gate's verdict from its systems' (PASS when there is none)."""
    for candidate in SEVERITY:
        if candidate in verdicts:
            return candidate
    return PASS


# ------------------------------------------------------------------------------------------- baseline power


@dataclass(frozen=True)
class BaselinePower:
    """What a new baseline can detect: the estimated MDE of one system, and the instructions the margin needs."""

    system: str
    n: int
    mde: float
    margin: float
    #: the correlation of a re-run's per-instruction scores with these, assumed by the estimate (see below)
    correlation: float
    #: the fewest instructions whose estimated MDE is at most the margin (None: fewer than 2 scored)
    needed: int | None

    @property
    def underpowered(self) -> bool:
        return self.mde > self.margin

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "underpowered": self.underpowered}


def _mde_at(n: int, sd: float, alpha: float, power: float) -> float:
    from scipy.stats import norm, t

    return (float(t.ppf(1 - alpha, n - 1)) + float(norm.ppf(power))) * sd / math.sqrt(n)


def baseline_power(scores: Mapping[str, Mapping[str, float]], margin: float = DEFAULT_MARGIN,
                   alpha: float = DEFAULT_ALPHA, power: float = DEFAULT_POWER) -> list[BaselinePower]:
    """The estimated MDE of each system of a new baseline (``{system: {instruction: score in [0, 1]}}``).

    The gate's MDE is ``(t + z_power) · sd(d) / sqrt(n)`` with ``d`` a candidate's paired differences, unknown
    before there is a candidate. The estimate takes a candidate that redraws every output (the same method under
    other seeds): ``var(d) = 2 · var(s) · (1 - rho)``, with ``var(s)`` the system's per-instruction score variance and
    ``rho`` the correlation between the two runs' scores on the same instructions (how much of the spread is the
    instructions' difficulty). ``rho`` is taken as the *smallest* correlation between two systems of this baseline:
    another method on the same instructions correlates less with a system than that system's own re-run does, so
    the estimate errs towards a larger MDE; with one system ``rho`` is 0 (an upper bound). On the built-in
    benchmark this estimate (4.8 and 5.1 points on 192 instructions) matched the MDE measured over re-runs by
    ``benchmarks/gate_false_alarm.py`` (4.7). ``alpha`` is shared among the systems, as the gate shares it.
    """
    _check(margin, alpha, power)
    names = sorted(scores)
    per_system_alpha = family_alpha(alpha, len(names))
    common = sorted(set.intersection(*(set(scores[name]) for name in names))) if names else []
    rho = 0.0
    if len(names) > 1 and len(common) > 2:
        rho = max(0.0, min(_correlation([scores[a][k] for k in common], [scores[b][k] for k in common])
                           for i, a in enumerate(names) for b in names[i + 1:]))
    out = []
    for name in names:
        values = [100.0 * v for v in scores[name].values()]
        n = len(values)
        if n < 2:
            out.append(BaselinePower(name, n, math.inf, margin, rho, None))
            continue
        mean = math.fsum(values) / n
        sd = math.sqrt(2 * (1 - rho) * math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        out.append(BaselinePower(name, n, _mde_at(n, sd, per_system_alpha, power), margin, rho,
                                 _needed(sd, margin, per_system_alpha, power)))
    return out


def _needed(sd: float, margin: float, alpha: float, power: float) -> int:
    """The fewest instructions whose MDE is at most ``margin``: from the normal approximation upwards."""
    from scipy.stats import norm

    if sd == 0:
        return 2
    n = max(2, math.ceil(((float(norm.ppf(1 - alpha)) + float(norm.ppf(power))) * sd / margin) ** 2))
    while _mde_at(n, sd, alpha, power) > margin:  # Student's t is wider than the normal: a few steps up
        n += 1
    return n


def _correlation(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson's r (0 when either side has no spread)."""
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    sab = math.fsum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    saa, sbb = math.fsum((x - ma) ** 2 for x in a), math.fsum((y - mb) ** 2 for y in b)
    return sab / math.sqrt(saa * sbb) if saa > 0 and sbb > 0 else 0.0
