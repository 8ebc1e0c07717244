"""A model of each start-up phase's seconds from what is known before the start (engine/start_inputs.py), fitted
on this machine's recorded starts of any model, with a prior from the shipped defaults (the terms and their priors:
engine/start_terms.py).

Why a model: the recorded start with the same cache hits predicts a start well (engine/start_estimate.py), but the
first start of a model, or its first warm start, has no such record. What such a phase costs is mostly explained
by a few sizes: bytes to read (at memory speed when the page cache holds them, at disk speed when not), the graph
to compile (layers, distinct weight shapes), whether each cache entry hits. Each phase is a sum of terms,
`coefficient x input`, linear in the coefficients, so the fit is a ridge regression pulled toward the prior: with
no recorded start the prior alone answers, with a few starts of small models the per-byte terms stay near the prior
(small models say little about them), and every start of a larger model moves them.

The fit (`fit`): per phase, minimise sum_i w_i (y_i - x_i . c)^2 + sum_k ((c_k - prior_k) / sd_k)^2 over the
recorded starts i that ran the phase, with w_i = 1 / (REL_NOISE x (y_i + 0.05 s))^2: a recorded phase is taken as
known to 25% (relative errors: a 10 s phase and a 50 ms one count alike, and one start of a model already moves a
prior that is off by more than that); coefficients are kept >= 0 (a negative cost per byte has no meaning). Pure
functions: the records come in, coefficients and predictions go out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .start_terms import Inputs, terms_of

_WEIGHT_FLOOR_S = 0.05  # the relative weights' floor: a phase of a few ms is not fitted to the microsecond
REL_NOISE = 0.25  # how well one recorded start tells a phase's time (run-to-run spread on a busy machine)
SAID_ABOVE_S = 0.0005  # a term worth less than this is counted but left out of the basis text


@dataclass(frozen=True)
class Observation:
    """One recorded start's phase: its inputs and the seconds it took."""

    inputs: Inputs
    seconds: float


@dataclass(frozen=True)
class Coefficients:
    """The fitted coefficients of each phase (key -> value), over how many recorded starts each, and in all: how
    many starts of how many models."""

    values: Mapping[str, Mapping[str, float]]
    starts: Mapping[str, int]
    records: int = 0
    models: int = 0

    def provenance(self) -> str:
        """ " (fitted on 5 recorded starts of 2 models on this machine)", or the prior's."""
        if not self.records:
            return " (shipped prior: no start recorded on this machine)"
        return (
            f" (fitted on {self.records} recorded start{'s' * (self.records != 1)} of {self.models or 1} "
            f"model{'s' * (self.models != 1)} on this machine)"
        )

    def of(self, stage: str) -> dict[str, float]:
        fitted = self.values.get(stage, {})
        return {t.key: fitted.get(t.key, t.prior) for t in terms_of(stage)}


PRIOR = Coefficients({}, {})


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems are a few terms wide)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    m[r] = [vr - f * vc for vr, vc in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) > 1e-300 else 0.0 for i in range(n)]


def fit_phase(stage: str, observations: Sequence[Observation]) -> dict[str, float]:
    """The posterior mean of one phase's coefficients (module docstring), each kept >= 0: a term that would go
    negative is fixed at 0 and the others refitted."""
    terms = list(terms_of(stage))
    free = list(range(len(terms)))
    coef = [t.prior for t in terms]
    rows = [
        ([t.x(o.inputs) for t in terms], o.seconds, 1.0 / (REL_NOISE * (o.seconds + _WEIGHT_FLOOR_S)) ** 2)
        for o in observations
    ]
    while free:
        n = len(free)
        a = [[0.0] * n for _ in range(n)]
        b = [0.0] * n
        for x, y, w in rows:
            fixed = sum(x[k] * coef[k] for k in range(len(terms)) if k not in free)
            for i, ki in enumerate(free):
                b[i] += w * x[ki] * (y - fixed)
                for j, kj in enumerate(free):
                    a[i][j] += w * x[ki] * x[kj]
        for i, ki in enumerate(free):
            a[i][i] += 1.0 / terms[ki].sd ** 2
            b[i] += terms[ki].prior / terms[ki].sd ** 2
        solved = _solve(a, b)
        negative = [ki for ki, v in zip(free, solved) if v < 0]
        for ki, v in zip(free, solved):
            coef[ki] = v
        if not negative:
            break
        for ki in negative:
            coef[ki] = 0.0
            free.remove(ki)
    return {t.key: max(0.0, c) for t, c in zip(terms, coef)}


def fit(observations: Mapping[str, Sequence[Observation]], records: int = 0, models: int = 0) -> Coefficients:
    """Every phase's coefficients from its observations (stage -> recorded starts that ran it); `records` and
    `models`: how many starts of how many models they come from (for the basis)."""
    return Coefficients(
        {s: fit_phase(s, obs) for s, obs in observations.items() if obs},
        {s: len(obs) for s, obs in observations.items()},
        records,
        models,
    )


@dataclass(frozen=True)
class ModelPhase:
    """One phase as the model predicts it: the seconds and the terms that make them, in words."""

    seconds: float
    basis: str
    inputs: dict[str, float]


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def predict_phase(stage: str, inputs: Inputs, coefficients: Coefficients) -> ModelPhase:
    """The model's seconds for `stage`, and its basis: each term with a non-zero part, "coefficient unit x what"."""
    coef = coefficients.of(stage)
    parts: list[str] = []
    used: dict[str, float] = {}
    total = 0.0
    for term in terms_of(stage):
        value = term.x(inputs)
        part = coef[term.key] * value
        if value == 0 or part == 0:
            continue
        total += part
        used[term.key] = round(value, 6)
        if part < SAID_ABOVE_S:
            continue  # counted, not worth a word
        if term.unit == "s":
            parts.append(f"{_num(part)} s {term.what(inputs)}")
        elif term.unit == "x":
            parts.append(f"{_num(coef[term.key])} x {term.what(inputs)}")
        else:
            parts.append(f"{_num(coef[term.key])} {term.unit} x {term.what(inputs)}")
    n = coefficients.starts.get(stage, 0)
    fitted = f"fitted on {n} recorded start{'s' * (n != 1)}" if n else "shipped prior, no recorded start"
    said = " + ".join(parts) or ("nothing to do" if total == 0 else f"{total:.4f} s in small terms")
    if inputs.slowdown > 1 and any(t.cpu and t.value(inputs) for t in terms_of(stage)):
        said += f" (CPU work x {inputs.slowdown:.1f}: load {inputs.get('cpu_load'):.1f} per core)"
    return ModelPhase(total, f"model ({fitted}): {said}", used)
