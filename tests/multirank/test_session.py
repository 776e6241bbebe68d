"""The runtime session every step runs through: trials, the cost model's measurements, verify and
the training job."""

from __future__ import annotations

from _session_workers import measure_with_a_busy_rank

from slapo_tune.launch import launch
from slapo_tune.problem import ProblemSpec


def test_a_step_one_rank_waited_through_is_measured_again_on_every_rank(no_leftover_children):
    """Each timed step runs collectives, so the ranks must agree on which steps count: rank 1 waits
    for a core through the first timed step, and both ranks re-measure it (a rank re-measuring
    alone would wait for the others in its extra step's collectives until the trial timed out)."""
    spec = ProblemSpec("gpt2-tiny", 2, global_batch=4, seq_len=16)
    reports = launch(measure_with_a_busy_rank, 2, args=(spec, {"tp": 1, "pp": 1, "micro_batch": 2}, 1), timeout=120)
    assert [r["remeasured"] for r in reports] == [1, 1]
    assert [len(r["times"]) for r in reports] == [2, 2]
    assert [r["steps"] for r in reports] == [4, 4]  # warm-up, the re-measured step and two timed
