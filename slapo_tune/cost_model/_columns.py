"""The array layer: the memory model's code for one point (Python scalars) or for a batch of rows
evaluated together (numpy arrays, one element per row), each row's terms the same float operations
as its own (:func:`~._stage.stage_builder`, :meth:`~slapo_tune.cost_model.CostModel.group_verdicts`).
Branches on the knobs run one way for a whole batch (:func:`_same`, :func:`_scalar`), or split it
(:class:`_Split`, :func:`by_branches`); selections, minima and maxima work on either
(:func:`_pick`, :func:`_min`, :func:`_max`); :func:`_each` maps a scalar function over rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .hardware import choose, larger, smaller


def _nonzero(terms: dict[str, float]) -> dict[str, float]:
    """The terms that hold bytes (events stay small: plan evaluates ~100k of them)."""
    return {k: v for k, v in terms.items() if (v.any() if isinstance(v, np.ndarray) else v)}


def _at_least_zero(x):
    return _max(0.0, x)


# stage_builder's knobs may be array columns, one element per row (a point and a stage) of a batch
# evaluated together (CostModel.group_verdicts): each row's terms are then the same float operations
# as its own. A branch on the knobs runs one way for all of a batch's rows, or the rows are split by
# it (_Split) and each side run apart; these helpers are the scalar code where nothing is an array.
class _Split(Exception):
    """A branch condition ``mask`` that differs between the rows of a batch: run its sides apart."""

    def __init__(self, mask: np.ndarray):
        super().__init__("rows differ in a branch")
        self.mask = mask


def by_branches(columns: dict[str, np.ndarray], run: Callable[[dict[str, np.ndarray]], Any]
                ) -> list[tuple[np.ndarray, Any]]:
    """``run`` of a batch of rows (``columns``: arrays, one element per row) as ``(rows, result)``:
    of all of them, or where a branch of ``run`` splits them (:class:`_Split`), of each side apart."""
    pending, done = [np.arange(len(next(iter(columns.values()))))], []
    while pending:
        rows = pending.pop()
        try:
            done.append((rows, run({k: v[rows] for k, v in columns.items()})))
        except _Split as split:
            pending += [rows[split.mask], rows[~split.mask]]
    return done


def _same(condition) -> bool:
    """A branch condition's truth, shared by every row of a batch (else :class:`_Split`)."""
    if isinstance(condition, np.ndarray):
        if condition.all():
            return True
        if condition.any():
            raise _Split(condition.astype(bool))
        return False
    return bool(condition)


def _scalar(value):
    """A knob-derived value every row of a batch shares, as a Python scalar (else :class:`_Split`
    by whether a row's is the first row's)."""
    if isinstance(value, np.ndarray):
        first = value.flat[0]
        if (value == first).all():
            return first.item()
        raise _Split(value == first)
    return value


# row by row for a batch: the time model's elementwise selections (one definition of each)
_pick, _min, _max = choose, smaller, larger


def _any(x) -> bool:
    """Whether a term holds bytes in any row (adding one that holds none changes no sum)."""
    return bool(x.any()) if isinstance(x, np.ndarray) else bool(x)


def _int(x):
    return x.astype(np.int64) if isinstance(x, np.ndarray) else int(x)


def row_codes(columns: list[np.ndarray]) -> np.ndarray:
    """One int64 per row, equal where the rows (``columns``' elements at one position) are equal:
    each column's values coded (small non-negative integers stand for themselves, which needs no
    sort), the codes combined."""
    code = np.zeros(len(columns[0]), dtype=np.int64)
    span = 1  # the codes' range so far
    for a in columns:
        a = np.asarray(a)
        top = int(a.max()) if a.dtype.kind in "iub" and len(a) else -1
        if 0 <= top < 2**20 and a.min() >= 0:
            values, inverse = top + 1, a.astype(np.int64)
        else:
            unique, inverse = np.unique(a, return_inverse=True)
            values, inverse = len(unique), inverse.reshape(-1)
        if span * values >= 2**62:  # too wide to combine: renumber what is combined so far
            code = np.unique(code, return_inverse=True)[1].reshape(-1)
            span = int(code.max()) + 1 if len(code) else 1
        code = code * values + inverse
        span *= values
    return code


def _each(fn: Callable, *args):
    """``fn(*args)``, or for a batch ``fn`` of each row's scalars (once per distinct row), as an
    array (a tuple of arrays where ``fn`` returns tuples)."""
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    if not arrays:
        return fn(*args)
    n = len(arrays[0])
    if n > 512:  # the distinct rows by array operations
        _, first, inverse = np.unique(row_codes(arrays), return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        columns = [a[first].tolist() if isinstance(a, np.ndarray) else [a] * len(first) for a in args]
        results = [fn(*row) for row in zip(*columns)]
    else:  # few rows: a dictionary of the distinct ones
        columns = [a.tolist() if isinstance(a, np.ndarray) else [a] * n for a in args]
        distinct: dict[tuple, int] = {}
        inverse = np.array([distinct.setdefault(row, len(distinct)) for row in zip(*columns)])
        results = [fn(*row) for row in distinct]
    if isinstance(results[0], tuple):
        return tuple(np.array(column)[inverse] for column in zip(*results))
    return np.array(results)[inverse]
