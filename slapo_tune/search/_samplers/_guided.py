"""``guided`` (the default strategy): the cost model's ranking, corrected by what the study measured."""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...cost_model import Predictions
from ...cost_model.ranking import Fitting
from ...plan import TrialStatus, knob_value
from ...problem import Problem
from ...space import Point, met_first
from .._known import Known, KnownReader
from ._base import FittingPoints, Predict
from ._frontier import frontier_group
from ._ordered import OrderedSampler


class Guided(OrderedSampler):
    """The cost model's ranking, corrected by what the study measured (the default strategy).

    The log of a point's measured throughput is modelled as its predicted one, plus the time
    model's overall scale (unknown and not shrunk: a calibration off by 2x moves every point
    alike), plus one correction per knob value (a kernel or a GPU's communication misjudged
    moves every point with that value), plus what such corrections cannot explain
    (:attr:`MISFIT`). The corrections' prior is normal around 0; its spread is learned from the
    measurements (:meth:`spreads`: the one of greatest marginal likelihood, starting from the
    least, the cost model taken as right until measurements disagree with it, so that a model
    that is right is followed and one that is badly wrong is soon doubted). Bayesian linear (ridge)
    regression then gives every point's corrected log-throughput and its uncertainty.

    The next point is the one of greatest expected improvement over the best measured one (its
    chance to beat it, weighed by how much). Among points tied in prediction, the one least like
    the measured ones is worth most (its measurement tells them apart); a point far from the
    measured ones is worth trying once the measurements say the model's corrections are large.
    Before the first measurement, the best predicted point comes first. Candidates are the points
    not known, not beyond a measured out-of-memory frontier (:func:`beyond_the_frontier`) and not
    outdone by one that recomputes less (:func:`recomputes_less`: the same point but its
    checkpointing, which is measured to fit, or is open and predicted to: recomputation only adds
    work, so it cannot be faster, however wrong the time model is; should that point run out of
    memory, this one is a candidate again). A point predicted to need more than the budget (yet
    not pruned: the memory model's optimistic end fits) counts by its chance to fit: its expected
    improvement is multiplied by it, the memory model's error taken as normal, its mean and spread
    learned from the peaks the study measured (:meth:`memory_error`). A measured out-of-memory
    point (or one exact mode pruned) puts every point predicted to need as much memory after the
    others.

    The search stops early once no open point can beat the best measured one by more than the
    noise even :attr:`STOP` standard deviations above its corrected prediction, at the largest
    spread the measurements do not rule out (and the largest assumed for a knob value none of
    them has). Deterministic: exact ties go to the first point in the space's order (as
    ``model``'s), whatever the seed."""

    # what one correction per knob value leaves unexplained in a measured log-throughput: the
    # knobs' interactions and the trial's noise (an additive fit of each recorded grid leaves 10-14 %)
    MISFIT = 0.1
    STOP = 3.0  # stop when even this many standard deviations above cannot beat the best by NOISE
    NOISE = 0.03  # relative step-time noise of a trial (a short trial's spread on a busy machine)
    MIN_MEASURED = 4  # measured points before the search may stop early
    MEMORY_SPREAD = 0.05  # relative error of a predicted peak (the analytic model's, within 10 % at worst)
    # measured peaks the prior (no error, MEMORY_SPREAD) counts as: half of one. A measured peak is
    # the model's error at a point, exactly; the prior, a guess at the worst case
    MEMORY_PRIOR_WEIGHT = 0.5
    SCALE_SPREAD = 1e3  # the overall scale's prior standard deviation: flat, whatever the time model's units
    # a space of at most this many points is listed and predicted whole (a second or less); a
    # larger one only where it must be (see _tables)
    LISTED_POINTS = 100_000

    def __init__(self, problem: Problem, seed: int = 0, predict: Predict | None = None,
                 known: KnownReader | None = None, fitting: FittingPoints | None = None) -> None:
        super().__init__(problem, seed, known)
        if predict is None:
            raise ValueError("the guided strategy needs the cost model's throughput and peak predictions")
        self.predict, self.fitting = predict, fitting
        self._table: dict[str, Any] | None = None
        self._found: Fitting | None = None  # what a partial table holds (see _tables)
        self._looked: set[str] = set()  # keys of the known points a partial table was extended by (or not of the space)
        self.stopped_early = False

    def _tables(self) -> dict[str, Any]:
        """The space's points in the space's order, each one's log prior, its predicted peak, its
        features (one column index per knob: the knob's value, numbered as a walk of the whole
        space meets them (:meth:`Space.first_met`), and a last column every point has: the overall
        scale) and frontier group; built once (the space is fixed), its points predicted at once
        (:meth:`CostModel.predictions`).

        A space of more than :attr:`LISTED_POINTS` points (a large model's: millions, which took
        minutes to list and predict) is not listed where the points that may fit are given
        (``fitting``): the table is *partial*, its points those the analytic verdict lets through
        (predicted as with the whole space, found without listing the others: the points that may
        fit, the only ones the search ranks), and the points the study knows besides
        (:meth:`_extend`); :meth:`next_point` lists the whole space only where its choice may lie
        among the others (where no open point that may fit is left ahead of them)."""
        if self._table is None:
            met, count = self.space.first_met()
            if self.fitting is None or count <= self.LISTED_POINTS:
                points = list(self.space.enumerate())  # exact ties: the first in the space's order
                self._table = self._table_of(points, self.predict(points), met, True)
            else:
                self._found = self.fitting()
                self._table = self._table_of(self._found.points, self._found.predictions, met, False)
        return self._table

    def _table_of(self, points: list[Point], predicted: Predictions, met: list[list[tuple[str, Any]]],
                  whole: bool) -> dict[str, Any]:
        """The table (:meth:`_tables`) of ``points``, ``predicted`` so (``whole``: the whole space's)."""
        prior = np.asarray(predicted.throughputs, dtype=float)
        names = sorted(self.space.names)
        features, width = _features(points, met, names)
        return _with_groups({
            "points": points, "index": _Index(points, names), "whole": whole, "met": met,
            "log_prior": np.where(prior > 0, np.log(np.maximum(prior, 1e-300)), -np.inf),
            "peak": np.asarray(predicted.peaks, dtype=float), "features": features, "width": width})

    def _extend(self, known: Known) -> None:
        """Add to a partial table (:meth:`_tables`) the points the study knows that it lacks
        (points the cost model says cannot fit), each with its predicted peak as the whole space's
        predictions give it (:meth:`Fitting.peak`): what the study says of them (a frontier, a
        best measured, a peak, an out-of-memory peak) then counts as with the whole space's
        table."""
        t = self._tables()
        if t["whole"]:
            return
        added: list[Point] = []
        for key in known.status:
            if key not in self._looked:
                self._looked.add(key)
                point = None if key in t["index"] else self._point_of(key)
                if point is not None:
                    added.append(point)
        if not added:
            return
        for row, p in enumerate(added, len(t["points"])):
            t["index"].add(p, row)
        t["points"] = t["points"] + added
        features, _ = _features(added, t["met"], sorted(self.space.names))
        t.update(log_prior=np.concatenate([t["log_prior"], np.full(len(added), -np.inf)]),
                 peak=np.concatenate([t["peak"], np.array([self._found.peak(p) for p in added], dtype=float)]),
                 features=np.concatenate([t["features"], features]))
        _with_groups(t)

    def _point_of(self, key: str) -> Point | None:
        """The point of ``key`` in the space's knob order; None where it is not a point of this space."""
        try:
            point = json.loads(key)
        except ValueError:
            return None
        if not isinstance(point, dict) or sorted(point) != sorted(self.space.names) or not self.space.is_legal(point):
            return None
        return {name: point[name] for name in self.space.names}

    def _measured(self, known: Known) -> tuple[list[int], np.ndarray, float | None]:
        """The indices of the measured points the cost model predicts, the log of their measured
        over predicted throughput, and the best measured log-throughput (None before any)."""
        self._extend(known)
        t = self._tables()
        rows, residuals, best = [], [], None
        for key, values in known.values.items():
            i = t["index"].get(key)
            if i is None or known.status.get(key) is not TrialStatus.OK or not values or values[0] <= 0:
                continue
            measured = math.log(values[0])
            best = measured if best is None else max(best, measured)
            if np.isfinite(t["log_prior"][i]):
                rows.append(i)
                residuals.append(measured - t["log_prior"][i])
        return rows, np.array(residuals), best

    def _normal_equations(self, rows: list[int], residuals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """X'X and X'y of the measured points' features X and residuals y (of the size of the
        features, whatever the number of measurements)."""
        t = self._tables()
        gram, target = np.zeros((t["width"], t["width"])), np.zeros(t["width"])
        for i, y in zip(rows, residuals):
            gram[np.ix_(t["features"][i], t["features"][i])] += 1.0
            target[t["features"][i]] += y
        return gram, target

    def _prior_variances(self, spread: float | np.ndarray) -> np.ndarray:
        """Each feature's prior variance: the knob corrections' ``spread`` squared, the scale's flat."""
        variances = np.broadcast_to(np.asarray(spread, dtype=float) ** 2, (self._tables()["width"],)).copy()
        variances[-1] = self.SCALE_SPREAD**2
        return variances

    def spreads(self, rows: list[int], residuals: np.ndarray) -> tuple[float, float]:
        """The knob corrections' spread that explains the measurements best (their marginal
        likelihood), and the largest one they do not rule out (its likelihood within the 95 %
        bound of a likelihood-ratio test), among :data:`SPREADS`. Before two measurements nothing
        tells the spread (one fixes only the scale): the least (the cost model is taken as right
        until measurements disagree with it) and the most."""
        if len(rows) < 2:
            return float(SPREADS[0]), float(SPREADS[-1])
        gram, target = self._normal_equations(rows, residuals)
        log_likelihood = []
        for spread in SPREADS:
            # y ~ N(0, X D X' + MISFIT^2 I): by the determinant lemma and Woodbury's identity, with
            # M = X'X + MISFIT^2 D^-1, log det = log det D + log det M + const and
            # y' C^-1 y = (y'y - y'X M^-1 X'y) / MISFIT^2, y'y the same for every spread
            variances = self._prior_variances(spread)
            m = gram + np.diag(self.MISFIT**2 / variances)
            log_likelihood.append(-0.5 * (np.log(variances).sum() + np.linalg.slogdet(m)[1]
                                          - target @ np.linalg.solve(m, target) / self.MISFIT**2))
        log_likelihood = np.array(log_likelihood)
        best = int(np.argmax(log_likelihood))  # ties: the least
        plausible = np.nonzero(log_likelihood >= log_likelihood[best] - LIKELIHOOD_RATIO_95 / 2)[0]
        return float(SPREADS[best]), float(SPREADS[plausible.max()])

    def scores(self, known: Known, points: np.ndarray,
               spread: float | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float | None]:
        """The corrected log-throughput of the points of indices ``points``, its standard
        deviation (of the point's throughput, not of a trial's measurement), and the best measured
        log-throughput (None before any); the knob corrections' spread the most likely one
        (:meth:`spreads`) unless ``spread`` is given (one per feature, or one for all)."""
        t = self._tables()
        rows, residuals, best = self._measured(known)
        if spread is None:
            spread = self.spreads(rows, residuals)[0]
        gram, target = self._normal_equations(rows, residuals)
        # the posterior: precision X'X / MISFIT^2 + D^-1, mean its inverse times X'y / MISFIT^2
        covariance = np.linalg.inv(gram + np.diag(self.MISFIT**2 / self._prior_variances(spread))) * self.MISFIT**2
        weights = covariance @ target / self.MISFIT**2
        features, log_prior = t["features"][points], t["log_prior"][points]
        corrected = log_prior + weights[features].sum(axis=1)
        variance = np.concatenate([covariance[f[:, :, None], f[:, None, :]].sum(axis=(1, 2))  # x' S x, by chunks
                                   for f in np.array_split(features, max(1, len(features) // 20000))])
        return corrected, np.sqrt(np.maximum(variance, 0.0)), best

    def _open(self, known: Known) -> np.ndarray:
        """Indices of the candidates: the points neither known nor beyond a measured frontier
        (:func:`beyond_the_frontier`: in the group of a known infeasible point, a micro-batch as
        large or larger with as little checkpointing or less), less those outdone by a point that
        recomputes less (:func:`recomputes_less`) and is measured to fit, or is not known, not
        beyond the frontier and predicted to fit (a running one too: it is not known to fail)."""
        self._extend(known)
        t = self._tables()
        possible = np.ones(len(t["points"]), dtype=bool)  # not ruled out by a measured frontier
        measured_ok = np.zeros(len(t["points"]), dtype=bool)
        known_rows = []
        for key, status in known.status.items():
            i = t["index"].get(key)
            if i is None:
                continue
            known_rows.append(i)
            measured_ok[i] = status is TrialStatus.OK
            if status.infeasible:
                possible &= ~((t["group"] == t["group"][i]) & (t["mb"] >= t["mb"][i]) & (t["ckpt"] <= t["ckpt"][i]))
        unknown = possible.copy()
        unknown[known_rows] = False
        budget = self.problem.spec.memory_budget
        predicted_to_fit = np.isfinite(t["log_prior"]) & (t["peak"] <= budget if budget else True)
        fits = measured_ok | (unknown & predicted_to_fit)
        # per setting of the other knobs, which checkpointings fit; a point is outdone when one that
        # recomputes less is among them
        settings, checkpointing = t["setting"], t["checkpointing"]
        fitting = np.zeros((settings.max() + 1 if len(settings) else 0, len(t["less"])), dtype=bool)
        fitting[settings[fits], checkpointing[fits]] = True
        outdone = (fitting.astype(np.int64) @ t["less"].astype(np.int64))[settings, checkpointing] > 0
        for key in known.running:
            i = t["index"].get(key)
            if i is not None:
                unknown[i] = False
        return np.flatnonzero(unknown & ~outdone)

    def memory_error(self, known: Known) -> tuple[float, float]:
        """The memory model's error on this space, log(measured / predicted peak), taken as normal:
        its mean and spread, from the peaks the study measured, starting from no error and
        :attr:`MEMORY_SPREAD` (which count as :attr:`MEMORY_PRIOR_WEIGHT` measured peaks). Peaks
        measured within 1 % of their predictions make a point predicted 5 % over the budget a poor
        bet; peaks measured 10 % under theirs (a pessimistic model), a good one."""
        self._extend(known)
        t = self._tables()
        errors = np.array([math.log(peak / t["peak"][i]) for key, peak in known.peaks.items()
                           if (i := t["index"].get(key)) is not None and peak > 0 and t["peak"][i] > 0])
        weight = self.MEMORY_PRIOR_WEIGHT
        mean = errors.sum() / (len(errors) + weight)
        variance = (weight * self.MEMORY_SPREAD**2 + ((errors - mean) ** 2).sum()) / (len(errors) + weight)
        return mean, math.sqrt(variance)

    def _log_chance_to_fit(self, peaks: np.ndarray, error: tuple[float, float]) -> np.ndarray:
        """log P(true peak <= budget) / P(a peak predicted at the budget fits) of points of predicted
        ``peaks``, the memory model's log ``error`` normal of (mean, spread): 0 for those predicted
        to fit (and without a budget)."""
        budget = self.problem.spec.memory_budget
        chance = np.zeros(len(peaks))
        if not budget:
            return chance
        mean, spread = error
        over = np.flatnonzero(peaks > budget)

        def log_cdf(z: float) -> float:
            return math.log(max(0.5 * math.erfc(-z / math.sqrt(2)), 1e-300))

        at_budget = log_cdf(-mean / spread)
        chance[over] = [log_cdf((math.log(budget / p) - mean) / spread) - at_budget for p in peaks[over].tolist()]
        return chance

    def next_point(self, known: Known) -> Point | None:
        self._extend(known)
        t = self._tables()
        candidates = self._open(known)
        if not len(candidates):
            return None if t["whole"] else self._listed(known)
        # the points the cost model says cannot fit (log prior -inf) score -inf: only the others
        # are scored (in a large model's space, most points)
        finite = np.flatnonzero(np.isfinite(t["log_prior"][candidates]))
        corrected, deviation, best = self.scores(known, candidates[finite])
        measured = sum(1 for s in known.status.values() if s is TrialStatus.OK)
        if best is None:  # nothing measured to improve on: the best predicted
            scored = corrected
        else:
            if measured >= self.MIN_MEASURED:
                # at the largest spread the measurements allow; a knob value none of them has, at
                # the largest assumed (nothing bounds its correction)
                rows, residuals, _ = self._measured(known)
                spread = np.full(t["width"], SPREADS[-1])
                spread[np.unique(t["features"][rows])] = self.spreads(rows, residuals)[1]
                wide, far, _ = self.scores(known, candidates[finite], spread)
                if not np.any(wide + self.STOP * far > best + math.log1p(self.NOISE)):
                    self.stopped_early = True
                    return None
            scored = log_expected_improvement(corrected, deviation, best)
        score = np.full(len(candidates), -np.inf)
        score[finite] = scored + self._log_chance_to_fit(t["peak"][candidates[finite]], self.memory_error(known))
        # a measured out-of-memory point (or one exact mode pruned: analytic mode let it through)
        # says the memory model is optimistic up to its predicted peak: the points predicted to need
        # as much or more are tried after every other
        ooms = [t["index"][k] for k, s in known.status.items() if s.infeasible and k in t["index"]]
        behind = t["peak"][candidates] >= min((t["peak"][i] for i in ooms), default=np.inf)
        # the best score first; lexsort is stable: exact ties (and points the cost model says cannot
        # fit, -inf) in the space's order
        first = np.lexsort((-score, behind))[0]
        if not t["whole"] and behind[first]:
            return self._listed(known)  # a point the partial table lacks may come first
        return t["points"][int(candidates[first])]

    def _listed(self, known: Known) -> Point | None:
        """:meth:`next_point` from the whole space's table, built now (every point listed and
        predicted, as for a small space), where a partial one's choice may not be the whole
        space's. A partial table's open points are those that may fit; it lacks only points the
        cost model says cannot fit, which score -inf and so follow, in the space's order, every
        open point that may fit and is not behind an out-of-memory peak: where it holds none
        such, one it lacks may come first."""
        points = list(self.space.enumerate())
        self._table = self._table_of(points, self.predict(points), self._tables()["met"], True)
        return self.next_point(known)


def recomputes_less(ratio: float, policy: str, other_ratio: float, other_policy: str) -> bool:
    """Whether checkpointing ``ratio`` of the blocks under ``policy`` recomputes less than
    ``other_ratio`` under ``other_policy`` (a point's knobs otherwise the same, its micro-batch
    too): none at all (ratio 0), or no more blocks, each recomputing as much or less (the same
    policy, or ``selective`` against ``full``: a selective block keeps its matmuls' outputs and
    recomputes only the rest of what a full one does). Policies of no known order are compared
    with their own only."""
    if (ratio, policy) == (other_ratio, other_policy):
        return False
    if ratio == 0:
        return True
    return ratio <= other_ratio and (policy == other_policy or (policy, other_policy) == ("selective", "full"))


def _checkpointing_tables(points: list[Point], features: np.ndarray) -> dict[str, np.ndarray]:
    """For :func:`recomputes_less` between points: each point's setting (a number per setting of
    its knobs but its checkpointing: its micro-batch included), its checkpointing (a number per
    distinct ratio and policy), and the matrix less[a, b]: checkpointing a recomputes less than b."""
    if not points:
        return {"setting": np.zeros(0, dtype=np.int64), "checkpointing": np.zeros(0, dtype=np.int64),
                "less": np.zeros((0, 0), dtype=bool)}
    names = sorted(points[0])  # the features' knob columns, in name order
    others = [k for k, name in enumerate(names) if name not in ("ckpt_ratio", "ckpt_policy")]
    # points of equal other columns, numbered (by sorting the rows: np.unique's rows take seconds
    # on a large space)
    rows = features[:, others]
    order = np.lexsort(rows.T[::-1])
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = np.any(rows[order[1:]] != rows[order[:-1]], axis=1)
    setting = np.empty(len(rows), dtype=np.int64)
    setting[order] = np.cumsum(starts) - 1
    # a point's checkpointing: its ratio's and policy's feature columns (a policy fixed when the
    # space has no such knob), numbered; each read from its first point
    ratio = features[:, names.index("ckpt_ratio")]
    policy = features[:, names.index("ckpt_policy")] if "ckpt_policy" in names else np.zeros_like(ratio)
    _, firsts, checkpointing = np.unique(ratio * (policy.max(initial=0) + 1) + policy, return_index=True,
                                         return_inverse=True)
    kinds = [(float(points[i]["ckpt_ratio"]), str(knob_value(points[i], "ckpt_policy"))) for i in firsts]
    less = np.array([[recomputes_less(*a, *b) for b in kinds] for a in kinds], dtype=bool)
    return {"setting": setting, "checkpointing": checkpointing.reshape(-1).astype(np.int64), "less": less}


class _Index(Mapping[str, int]):
    """A point key -> the point's index, by the key read back into its values (no key per point:
    a JSON text per point of a large space costs seconds); a key of other knobs is not in it."""

    def __init__(self, points: list[Point], names: list[str]) -> None:
        self._names = names  # the space's knobs, in name order
        # a point's values in name order, as a tuple (itemgetter of one name gives the value alone)
        self._values = operator.itemgetter(*names) if len(names) > 1 else lambda p: tuple(p[n] for n in names)
        self._rows = {self._values(p): i for i, p in enumerate(points)}

    def add(self, point: Point, row: int) -> None:
        """Index ``point`` (of the space's knobs) as row ``row``."""
        self._rows[self._values(point)] = row

    def __getitem__(self, key: str) -> int:
        point = json.loads(key)
        if sorted(point) != self._names:
            raise KeyError(key)
        return self._rows[self._values(point)]

    def __iter__(self):
        raise TypeError("the index of a space's points is looked up, not listed")

    def __len__(self) -> int:
        return len(self._rows)


def _with_groups(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` (:meth:`Guided._tables`) with each point's frontier group, micro-batch size and
    checkpoint ratio, and its checkpointing tables (:func:`_checkpointing_tables`), from its
    points and features."""
    points, groups = table["points"], {}
    table.update(group=np.array([groups.setdefault(frontier_group(p), len(groups)) for p in points], dtype=np.int64),
                 mb=np.array([p["micro_batch"] for p in points]), ckpt=np.array([p["ckpt_ratio"] for p in points]),
                 **_checkpointing_tables(points, table["features"]))
    return table


def _features(points: list[Point], met: list[list[tuple[str, Any]]] | None = None,
              names: list[str] | None = None) -> tuple[np.ndarray, int]:
    """Each point's feature columns (:meth:`Guided._tables`): one per knob of ``names`` (the
    points' knobs in name order), the column of its value, numbered in the order a walk meets
    the values (``met``, as :meth:`Space.first_met` gives it; by default a walk of ``points``
    themselves), row by row, a row's knobs in name order, and a last one every point has; and
    the number of columns. A knob's values of several types are told apart by their text (1 and
    1.0 are one dict key)."""
    names = (sorted(points[0]) if points else []) if names is None else names
    met = met_first(points) if met is None else met
    types: dict[str, set[type]] = {}
    for pairs in met:
        for k, v in pairs:
            types.setdefault(k, set()).add(type(v))
    text = {k for k, found in types.items() if len(found) > 1}
    column = {name: c for c, name in enumerate(names)}
    numbers: dict[tuple[str, Any], int] = {}
    for pairs in met:
        for k, v in sorted(pairs, key=lambda pair: column[pair[0]]):
            numbers.setdefault((k, str(v) if k in text else v), len(numbers))
    features = np.empty((len(points), len(names) + 1), dtype=np.int64)
    for c, name in enumerate(names):
        value = str if name in text else (lambda v: v)
        features[:, c] = [numbers[(name, value(p[name]))] for p in points]
    features[:, -1] = len(numbers)
    return features, len(numbers) + 1


# the knob corrections' spreads :meth:`Guided.spreads` chooses among: from a trial's noise (3 %) to
# a factor of 4 either way (a time model badly wrong about a knob value)
SPREADS = np.geomspace(0.03, math.log(4), 40)
LIKELIHOOD_RATIO_95 = 3.84  # the chi-square (1 degree of freedom) 95 % point: twice a log-likelihood ratio


def log_expected_improvement(mean: np.ndarray, deviation: np.ndarray, best: float) -> np.ndarray:
    """log E[max(0, X - best)] of normal X of ``mean`` and ``deviation`` (elementwise): log of
    s (phi(z) + z Phi(z)), z = (mean - best) / s. Far below the best (z < -6), the tail's
    expansion phi(z) (1/z^2 - 3/z^4), where the direct form loses every digit."""
    s = np.maximum(deviation, 1e-12)
    z = (mean - best) / s
    log_phi = -0.5 * z**2 - 0.5 * math.log(2 * math.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        cdf = 0.5 * np.vectorize(math.erfc)(-z / math.sqrt(2))
        direct = np.log(np.maximum(np.exp(log_phi) + z * cdf, 1e-300))
        tail = log_phi - 2 * np.log(np.abs(z)) + np.log1p(-3 / z**2)
    return np.log(s) + np.where(z < -6, tail, direct)
