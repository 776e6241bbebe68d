"""The memory calibration's fit (``cost_model.calibration.fit``) against peaks made with known weights:
whatever the analytic terms miss by a constant factor, the fit finds."""

from __future__ import annotations

import pytest

from slapo_tune.cost_model import CostModel, Hardware
from slapo_tune.cost_model.analytic import DEFAULT_WEIGHTS, combine, memory_terms
from slapo_tune.cost_model.calibration import fit
from slapo_tune.problem import ProblemSpec

CPU = Hardware("test-cpu", 16 * 2**30, 1e10, 1e9, 1e9, 5e-5, 2, 4e-4, 2)


def _samples(true_weights: dict[str, float]) -> list:
    """(events, peak) of a stage per point of gpt2-tiny on one rank, the peak what ``true_weights``
    give (a model whose activations the default weights under-count)."""
    problem = ProblemSpec("gpt2-tiny", 1, global_batch=8, seq_len=64).resolve()
    model = CostModel(problem, CPU)
    points = [problem.plan(dict(micro_batch=mb, ckpt_ratio=c, attn=a)) for mb, c, a in
              [(1, 0.0, "sdpa"), (8, 0.0, "eager"), (4, 1.0, "sdpa"), (2, 0.5, "eager"), (8, 1.0, "sdpa"),
               (1, 1.0, "eager"), (2, 0.0, "sdpa"), (4, 0.25, "eager")]]
    return [(st.events, combine(st.events, true_weights)[0])
            for p in points for st in memory_terms(model.layout, p, problem.workload, model.backend)]


def _worst(samples, weights) -> float:
    return max(abs(combine(events, weights)[0] / peak - 1) for events, peak in samples)


def test_the_fit_recovers_what_the_default_weights_miss():
    """Peaks whose activation terms are 1.4x what the defaults count: the default weights
    under-predict them; the fitted weights predict them at least three times better, and every
    activation term present moves up from its default."""
    activations = [k for k in DEFAULT_WEIGHTS if k.startswith("act")]
    truth = {**DEFAULT_WEIGHTS, **{k: 1.4 * DEFAULT_WEIGHTS[k] for k in activations}}
    samples = _samples(truth)
    before = _worst(samples, DEFAULT_WEIGHTS)
    assert before > 0.05  # the defaults really miss these peaks
    calibration = fit(samples)
    assert calibration.points == len(samples) and calibration.source == "exact"
    after = _worst(samples, calibration.weights)
    assert after < before / 3, (before, after)
    assert calibration.uncertainty == pytest.approx(max(0.03, 1.25 * after))
    present = {k for events, _ in samples for terms in events.values() for k, v in terms.items() if v}
    moved = [k for k in activations if k in present]
    assert moved and all(calibration.weights[k] > DEFAULT_WEIGHTS[k] for k in moved), \
        {k: calibration.weights[k] for k in moved}
