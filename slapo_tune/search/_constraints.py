"""A trial's memory constraint, where Optuna's samplers and optuna-dashboard both read it.

Out-of-memory and pruned points are infeasible (a constraint > 0), so that a constraint-aware
sampler (TPE; NSGA-II and GP too) stops proposing their neighbourhood. Optuna's public ways of
setting one do not reach the dashboard: ``constraints_func`` (deprecated since Optuna 5.0, to be
removed in 7.0) writes the list under the trial's system attribute ``"constraints"`` from the
sampler's ``after_trial``, and ``Trial.set_constraint``, its replacement, writes a key per name
(``"constraints:NAME"``), which Optuna's samplers read but optuna-dashboard does not: it shows a
trial's feasibility from the ``"constraints"`` list only. So this module writes that list itself,
as ``constraints_func`` would have, through Optuna's storage (its one private access: the trial's
storage id); Optuna reads it back as the trial's constraint ``"0"`` (``FrozenTrial.constraints``).
``tests/unit/test_search.py`` fails if Optuna or the dashboard renames the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optuna.trial import Trial


def record_constraint(trial: Trial, value: float) -> None:
    """Set ``trial``'s one constraint (> 0: infeasible) before it is told, in the list format
    Optuna's ``constraints_func`` writes: read by Optuna's samplers and by optuna-dashboard."""
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY  # (optuna: not loaded by --help)

    trial.storage.set_trial_system_attr(trial._trial_id, _CONSTRAINTS_KEY, (value,))
