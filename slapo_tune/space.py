"""Search spaces of schedule knobs with finite, dependent domains.

A :class:`Space` is an ordered list of :class:`Knob` s. A knob's raw domain may depend on the
values chosen for earlier knobs (``pp`` must divide ``world_size / tp``), and the space can add
constraints on complete points. The *legal* values of a knob are the raw values that still have a
legal completion, so a sampler walking the knobs in order never reaches a dead end, and never
sees an illegal point. Derived knobs (``dp``) are computed, not chosen.

For Optuna's define-by-run API each knob is one parameter, named as the knob, whose distribution
is every value the knob takes in some legal point (:meth:`Space.domain`): Optuna requires one
distribution per name, and one parameter per knob is what optuna-dashboard and
``optuna.importance`` show. The values legal at a trial depend on its earlier knobs; the sampler
the study asks through keeps to them (``search._samplers.LegalDomains``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

Point = dict[str, Any]


@dataclass(frozen=True)
class Knob:
    """One schedule decision.

    ``choices(point)`` returns the raw domain given the earlier knobs' values (``point``);
    ``depends`` names those knobs. A ``derive``d knob is computed from earlier ones and never
    suggested.
    """

    name: str
    choices: Callable[[Point], Sequence[Any]] | Sequence[Any] = ()
    depends: tuple[str, ...] = ()
    derive: Callable[[Point], Any] | None = None
    doc: str = ""
    kind: type = int
    limited_by: str = ""  # why values one would expect are not offered (said when one is asked for)

    def raw(self, point: Point) -> list[Any]:
        if self.derive is not None:
            return [self.derive(point)]
        values = self.choices(point) if callable(self.choices) else self.choices
        return list(values)


@dataclass
class Space:
    """An ordered set of knobs plus constraints on complete points."""

    knobs: list[Knob]
    constraints: list[Callable[[Point], str | None]] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # what the domains were computed for

    def __post_init__(self) -> None:
        self._by_name = {k.name: k for k in self.knobs}
        self._completion_cache: dict[tuple, bool] = {}
        self._domains: dict[str, list[Any]] | None = None

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    @property
    def free(self) -> list[Knob]:
        """Knobs a sampler chooses (not derived)."""
        return [k for k in self.knobs if k.derive is None]

    def knob(self, name: str) -> Knob:
        try:
            return self._by_name[name]
        except KeyError:
            raise UsageError(f"unknown knob '{name}' (knobs: {', '.join(self.names)})") from None

    def pinned(self, values: Mapping[str, Any]) -> Space:
        """This space with each knob of ``values`` held at its value: the points where that value
        is not legal are left out, the other knobs are searched as before (a user who already
        decided ``tp=8`` searches the rest). A derived knob (``dp``) is held by a constraint. An
        unknown knob is a :class:`UsageError`."""
        for name in values:
            self.knob(name)
        knobs = [knob if knob.name not in values or knob.derive is not None
                 else dataclasses.replace(knob, choices=functools.partial(_held, knob, values[knob.name]))
                 for knob in self.knobs]
        derived = {name: value for name, value in values.items() if self.knob(name).derive is not None}
        constraints = [*self.constraints, functools.partial(_derived_held, derived)] if derived else list(self.constraints)
        return Space(knobs, constraints, dict(self.context))

    # ------------------------------------------------------------ enumeration
    def _violation(self, point: Point) -> str | None:
        for check in self.constraints:
            reason = check(point)
            if reason:
                return reason
        return None

    def _walk(self, point: Point, index: int) -> Iterator[Point]:
        if index == len(self.knobs):
            if self._violation(point) is None:
                yield dict(point)
            return
        knob = self.knobs[index]
        for value in knob.raw(point):
            point[knob.name] = value
            yield from self._walk(point, index + 1)
        point.pop(knob.name, None)

    def enumerate(self, prefix: Mapping[str, Any] | None = None) -> Iterator[Point]:
        """Every legal point (extending ``prefix``, whose knobs must come first), in knob order."""
        point = dict(prefix or {})
        start = len(point)
        if list(point) != self.names[:start]:
            raise UsageError(f"a prefix must give the first knobs in order ({', '.join(self.names)})")
        return self._walk(point, start)

    def differing(self, point: Mapping[str, Any], changes: int) -> Iterator[Point]:
        """Every legal point that differs from ``point`` in exactly ``changes`` of its knobs (a knob
        it does not give never counts), in :meth:`enumerate`'s order, without walking the others:
        a branch is left once it differs in more, or once too few of ``point``'s knobs are left to
        differ in as many (the points nearest a default, from a space of millions)."""
        names = self.names
        # of point's knobs, how many come at or after each knob
        after = [sum(name in point for name in names[i:]) for i in range(len(names) + 1)]

        def walk(current: Point, index: int, left: int) -> Iterator[Point]:
            if left > after[index]:
                return
            if index == len(self.knobs):
                if self._violation(current) is None:
                    yield dict(current)
                return
            knob = self.knobs[index]
            for value in knob.raw(current):
                differs = knob.name in point and value != point[knob.name]
                if differs > left:
                    continue
                current[knob.name] = value
                yield from walk(current, index + 1, left - differs)
            current.pop(knob.name, None)

        return walk({}, 0, changes)

    def prefixes(self, depth: int, prefix: Mapping[str, Any] | None = None) -> Iterator[Point]:
        """Every assignment of the first ``depth`` knobs (extending ``prefix``, whose knobs must come
        first), in knob order: the order :meth:`enumerate` lists their completions in. Some may
        have no legal completion (:meth:`completions` counts them)."""
        point = dict(prefix or {})
        start = len(point)
        if list(point) != self.names[:start] or depth < start:
            raise UsageError(f"a prefix must give the first knobs in order ({', '.join(self.names)})")

        def walk(index: int) -> Iterator[Point]:
            if index == depth:
                yield dict(point)
                return
            knob = self.knobs[index]
            for value in knob.raw(point):
                point[knob.name] = value
                yield from walk(index + 1)
            point.pop(knob.name, None)

        return walk(start)

    def completions(self, prefix: Mapping[str, Any]) -> int:
        """How many legal points :meth:`enumerate` lists for ``prefix``, without listing them: where
        nothing constrains complete points, the trailing knobs of fixed domains (nothing after them
        can read them) multiply the count."""
        point = dict(prefix)
        if list(point) != self.names[:len(point)]:
            raise UsageError(f"a prefix must give the first knobs in order ({', '.join(self.names)})")
        end, factor = len(self.knobs), 1
        while (not self.constraints and end > len(point) and self.knobs[end - 1].derive is None
               and not callable(self.knobs[end - 1].choices)):
            end -= 1
            factor *= len(self.knobs[end].choices)
        if not factor:
            return 0

        def walk(index: int) -> int:
            if index == end:
                return factor if end < len(self.knobs) or self._violation(point) is None else 0
            knob = self.knobs[index]
            total = 0
            for value in knob.raw(point):
                point[knob.name] = value
                total += walk(index + 1)
            point.pop(knob.name, None)
            return total

        return walk(len(point))

    def count(self) -> int:
        """Number of legal points (without listing them: a knob with a fixed domain that no later
        knob depends on multiplies the count)."""
        needed = {d for k in self.knobs for d in k.depends}

        def walk(point: Point, index: int) -> int:
            if index == len(self.knobs):
                return 0 if self._violation(point) else 1
            knob = self.knobs[index]
            if (not self.constraints and knob.derive is None and not callable(knob.choices)
                    and knob.name not in needed):
                return len(knob.choices) * walk(point, index + 1)
            total = 0
            for value in knob.raw(point):
                point[knob.name] = value
                total += walk(point, index + 1)
            point.pop(knob.name, None)
            return total

        return walk({}, 0)

    def first_met(self) -> tuple[list[list[tuple[str, Any]]], int]:
        """What a walk of every legal point (:meth:`enumerate`'s order) meets first: for each
        point at which it first meets some (knob, value) pairs, those pairs (in knob order), the
        points in walk order; and the number of legal points. A value of another type is another
        pair (1 and 1.0). Not every point is walked: what a branch (the points of one prefix)
        meets, and how many points it holds, follow from the prefix's values that its domains and
        constraints read (:class:`Reads`), so a branch is summed up once per distinct such values
        and remembered (a large model's millions of points are thousands of distinct branches)."""
        knobs = self.knobs
        # per depth: the knobs a branch read -> their values (with their types) -> (met, count)
        memo: list[dict[tuple[str, ...], dict[tuple, tuple[list, int]]]] = [{} for _ in range(len(knobs) + 1)]
        order = {name: i for i, name in enumerate(self.names)}
        point: Point = {}

        def branch(index: int) -> tuple[list[tuple[tuple, list[tuple[str, Any]]]], int, set[str]]:
            """(what the branch of ``point`` (its first ``index`` knobs) meets first: (the values of
            the point meeting them, from knob ``index`` on; the pairs), its count, what it read)."""
            for names, known in memo[index].items():
                found = known.get(tuple((type(point[n]), point[n]) for n in names))
                if found is not None:
                    return (*found, set(names))
            view = Reads(point)
            if index == len(knobs):
                legal = self._violation(view) is None
                met: list = [((), [])] if legal else []
                count, read = int(legal), view.read
            else:
                knob = knobs[index]
                values = knob.raw(view)
                read, met, count, seen = set(view.read), [], 0, set()
                for value in values:
                    point[knob.name] = value
                    below, n, below_read = branch(index + 1)
                    read |= below_read - {knob.name}
                    count += n
                    for first, (tail, pairs) in enumerate(below):
                        pairs = [(knob.name, value), *pairs] if first == 0 else pairs
                        new = [(k, v) for k, v in pairs if (k, type(v), v) not in seen]
                        if new:
                            seen.update((k, type(v), v) for k, v in new)
                            met.append(((value, *tail), new))
                point.pop(knob.name, None)
            names = tuple(sorted(read, key=order.__getitem__))
            memo[index].setdefault(names, {})[tuple((type(point[n]), point[n]) for n in names)] = (met, count)
            return met, count, read

        met, count, _ = branch(0)
        return [pairs for _, pairs in met], count

    def _completes(self, prefix: Point) -> bool:
        key = tuple(prefix.items())
        if key not in self._completion_cache:
            self._completion_cache[key] = next(self.enumerate(prefix), None) is not None
        return self._completion_cache[key]

    def legal_values(self, name: str, prefix: Mapping[str, Any]) -> list[Any]:
        """Values of knob ``name`` that keep ``prefix`` (all earlier knobs) completable."""
        knob = self.knob(name)
        prefix = dict(prefix)
        return [v for v in knob.raw(prefix) if self._completes({**prefix, name: v})]

    def domains(self) -> dict[str, list[Any]]:
        """Every value each knob takes in some legal point, in :func:`natural_order` (names as a
        walk of the points first meets them: :meth:`first_met`, which walks a large model's space
        of millions of points in a second, where listing it took a minute)."""
        seen: dict[str, list[Any]] = {n: [] for n in self.names}
        for pairs in self.first_met()[0]:
            for n, v in pairs:
                if v not in seen[n]:
                    seen[n].append(v)
        return {n: natural_order(values) for n, values in seen.items()}

    # ------------------------------------------------------------- checking
    def complete(self, partial: Mapping[str, Any]) -> Point:
        """A legal point with the given knob values; unspecified knobs take their first legal value,
        or, where that would make a given value illegal, the first that keeps every given one legal
        (``vpp=2`` alone: an interleaving schedule, not the first schedule, GPipe, which has none).

        Raises :class:`UsageError` naming the knob and its legal values when a value is illegal
        whatever the unspecified knobs take.
        """
        for name in partial:
            self.knob(name)
        try:
            return self._complete_first(partial)
        except UsageError:
            found = self._complete_search(dict(partial), {})
            if found is None:
                raise
            return found

    def _complete_search(self, partial: dict[str, Any], point: Point) -> Point | None:
        """The first legal point, in the knobs' order and each knob's order of values, that holds
        ``partial``'s values (depth first from ``point``, the knobs before the next one); None if none."""
        if len(point) == len(self.knobs):
            return dict(point)
        knob = self.knobs[len(point)]
        legal = self.legal_values(knob.name, point)
        for value in ([partial[knob.name]] if knob.name in partial else legal):
            if value in legal:
                found = self._complete_search(partial, {**point, knob.name: value})
                if found is not None:
                    return found
        return None

    def _complete_first(self, partial: Mapping[str, Any]) -> Point:
        point: Point = {}
        for knob in self.knobs:
            legal = self.legal_values(knob.name, point)
            if knob.name in partial:
                value = partial[knob.name]
                if value not in legal:
                    given = ", ".join(f"{k}={v}" for k, v in point.items() if k in knob.depends)
                    where = f" with {given}" if given else ""
                    values = ", ".join(str(v) for v in legal) or "none"
                    why = f" ({knob.limited_by})" if knob.limited_by else ""
                    raise UsageError(f"{knob.name}={value} is not legal for this model and world{where}; "
                                     f"legal values: {values}{why}")
            elif legal:
                value = legal[0]
            else:
                raise UsageError(f"no legal value for {knob.name} given {format_point(point)}")
            point[knob.name] = value
        return point

    def is_legal(self, point: Mapping[str, Any]) -> bool:
        try:
            return self.complete(point) == dict(point)
        except UsageError:
            return False

    # ---------------------------------------------------------------- optuna
    def domain(self, name: str) -> list[Any]:
        """Every value knob ``name`` takes in some legal point (:meth:`domains`, worked out once):
        its one Optuna distribution."""
        if self._domains is None:
            self._domains = self.domains()
        return self._domains[name]

    def legal_given(self, name: str, values: Mapping[str, Any]) -> list[Any]:
        """The legal values of knob ``name`` given ``values`` of (at least) the knobs before it, as
        an Optuna trial's parameters hold them (derived knobs are worked out again)."""
        prefix: Point = {}
        for knob in self.knobs:
            if knob.name == name:
                return self.legal_values(name, prefix)
            prefix[knob.name] = knob.derive(prefix) if knob.derive else values[knob.name]
        raise UsageError(f"unknown knob '{name}' (knobs: {', '.join(self.names)})")

    def suggest(self, trial: Any) -> Point:
        """Ask an Optuna trial (define-by-run) for a legal point, knob by knob: the trial's sampler
        must keep to the legal values (``LegalDomains``); a value outside them is a bug there."""
        point: Point = {}
        for knob in self.knobs:
            if knob.derive is not None:
                point[knob.name] = knob.derive(point)
                continue
            legal = self.legal_values(knob.name, point)
            value = trial.suggest_categorical(knob.name, self.domain(knob.name))
            if value not in legal:
                raise ValueError(f"the sampler proposed {knob.name}={value} at {format_point(point)}, where "
                                 f"only {legal} are legal")
            point[knob.name] = value
        return point

    def point_from_params(self, params: Mapping[str, Any]) -> Point:
        """Rebuild a point from an Optuna trial's parameters (one per free knob)."""
        point: Point = {}
        for knob in self.knobs:
            point[knob.name] = knob.derive(point) if knob.derive else params[knob.name]
        return point

    def params_of(self, point: Point) -> dict[str, Any]:
        """``point`` as Optuna parameters (one per free knob), to enqueue it."""
        return {knob.name: point[knob.name] for knob in self.free}


class Reads(Mapping[str, Any]):
    """A point that records which knobs are read of it (what a knob's domain, a constraint or the
    cost model's terms depend on)."""

    def __init__(self, point: Mapping[str, Any]):
        self.point, self.read = point, set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return self.point[name]

    def __contains__(self, name: object) -> bool:
        if name in self.point:
            self.read.add(name)
            return True
        return False

    def __iter__(self):
        self.read.update(self.point)
        return iter(self.point)

    def __len__(self) -> int:
        self.read.update(self.point)
        return len(self.point)


def _held(knob: Knob, value: Any, point: Point) -> list[Any]:
    """A pinned knob's domain at ``point``: its value, where the knob's own domain has it."""
    return [value] if value in knob.raw(point) else []


def _derived_held(values: Mapping[str, Any], point: Point) -> str | None:
    """The constraint holding derived knobs at pinned values."""
    off = [f"{name}={point[name]}" for name, value in values.items() if point[name] != value]
    return f"{', '.join(off)} differs from the pinned {format_point(values)}" if off else None


def met_first(points: Sequence[Point]) -> list[list[tuple[str, Any]]]:
    """What a walk of ``points``, in their order, meets first: for each point at which it first
    meets some (knob, value) pairs, those pairs (a value of another type another pair). Of every
    legal point in :meth:`Space.enumerate`'s order, what :meth:`Space.first_met` gives without
    walking them."""
    seen: set[tuple] = set()
    met = []
    for p in points:
        new = [(k, v) for k, v in p.items() if (k, type(v), v) not in seen]
        seen.update((k, type(v), v) for k, v in new)
        if new:
            met.append(new)
    return met


def natural_order(values: Sequence[Any]) -> list[Any]:
    """Numbers ascending (``ckpt_ratio`` 0.0, 0.25, ..., 1.0, not the order first met); other
    values (names) as given."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sorted(values)
    return list(values)


def format_point(point: Mapping[str, Any]) -> str:
    """Stable one-line text form: ``tp=2,pp=1,dp=2,...`` in knob order."""
    return ",".join(f"{k}={v}" for k, v in point.items())


def point_key(point: Mapping[str, Any]) -> str:
    """Order-independent identity of a point (for "was this point already run?")."""
    return json.dumps(dict(sorted(point.items())))


def point_json(point: Mapping[str, Any]) -> str:
    """Stable JSON form (knob order preserved)."""
    return json.dumps(dict(point))


def parse_knobs(text: str) -> dict[str, str]:
    """``"tp=2,pp=2"`` -> ``{"tp": "2", "pp": "2"}``; a knob given twice or a malformed item is a
    :class:`UsageError`."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UsageError(f"knobs must be NAME=VALUE separated by commas, got '{item}'")
        name = name.strip()
        if name in out:
            raise UsageError(f"knob '{name}' is given twice")
        out[name] = value.strip()
    return out


def coerce(space: Space, raw: Mapping[str, str]) -> dict[str, Any]:
    """Convert textual knob values to the types of the knobs' domains (given in knob order)."""
    out: dict[str, Any] = {}
    for name, text in raw.items():
        kind = space.knob(name).kind
        try:
            out[name] = kind(text)
        except ValueError:
            raise UsageError(f"{name}={text}: not a valid {kind.__name__}") from None
    return out


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending, found in O(sqrt n) steps (a world of 2^20 ranks: 1,024)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def product_size(domains: Mapping[str, Sequence[Any]]) -> int:
    """Size of the unconstrained cartesian product (for reports)."""
    return math.prod(len(v) for v in domains.values()) if domains else 0
