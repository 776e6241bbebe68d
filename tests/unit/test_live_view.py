"""tune's live view to the end (issue 42): every line within 80 columns however long a point's
knobs or a failure's error (knobs wrap onto lines of their own), the confirmation a phase of the
bar with its own count and ETA, every outcome word with its reason (the bar's counts too), and why each trial is
confirmed said once. Events as the tuner reports them, fed to the view by hand: no study."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from slapo_tune.cli._live import MEANINGS, TuneView, print_summary

WIDTH = 80
# a user's template with long knob names and values: one point is ~260 characters
KNOBS = {"tp": 2, "pp": 2, "cp": 1, "sp": "on", "dp": 2, "zero": 3, "micro_batch": 16, "ckpt_ratio": 0.75,
         "ckpt_policy": "selective", "pipeline_schedule": "interleaved_zero_bubble", "vpp": 2,
         "loss_parallel": "on", "attn": "flash_attention_with_sliding_window", "fuse": "on",
         "expert_parallel_degree": 8, "activation_offload_policy": "offload_every_other_block_to_host",
         "communication_overlap": "aggressive_bucketed_reduce_scatter"}
LONG_ERROR = ("RuntimeError: " + "the rank could not allocate its pinned host buffer for the offloaded "
              "activations of block 17 because the host ran out of locked memory " * 2)
BASE = {"pruned": 0, "failed": 0, "duplicates": 0, "infrastructure": 0, "best": None, "best_point": None,
        "elapsed": 10.0, "resumed": 0, "target": 12, "time_budget": None, "knobs": KNOBS, "point": "tp=2,..."}


def _events():
    """A short study's events: trials (ok, lost, crash), a pruned point, a repeat, then a
    confirmation of two candidates and the baseline (one round lost), and the crowning."""
    ok = {"samples_per_s": 97.2, "peak_memory": [7 * 2**20], "step_times": [0.16, 0.17, 0.165], "warnings": []}
    yield {**BASE, "event": "start", "launched": 0, "baseline_point": {**KNOBS, "tp": 1}, "made_to_fit": False}
    yield {**BASE, "event": "launched", "launched": 0, "trial": 0, "predicted": {}}
    yield {**BASE, "event": "ok", "launched": 1, "trial": 0, "best": 97.2, "result": ok,
           "predicted": {"step_s": 0.05}}
    yield {**BASE, "event": "lost", "launched": 1, "trial": 1, "best": 97.2, "infrastructure": 1,
           "result": {"error": "ray.exceptions.ActorDiedError: the actor died unexpectedly (its node was removed)"}}
    yield {**BASE, "event": "crash", "launched": 2, "trial": 2, "best": 97.2, "failed": 1,
           "result": {"error": LONG_ERROR}}
    yield {**BASE, "event": "pruned", "launched": 2, "trial": 3, "best": 97.2, "pruned": 1, "failed": 1,
           "reason": "predicted peak 20.1 MiB (at least 18.0 MiB) on stage 0 > budget 16.0 MiB"}
    yield {**BASE, "event": "pruned", "launched": 2, "trial": 4, "best": 97.2, "pruned": 2, "failed": 1,
           "reason": "predicted peak 30.0 MiB (at least 28.0 MiB) on stage 0 > budget 16.0 MiB"}
    yield {**BASE, "event": "launched", "launched": 2, "trial": 5, "best": 97.2, "pruned": 2, "failed": 1,
           "duplicates": 1, "predicted": {}}
    counts = {**BASE, "launched": 12, "best": 97.2, "pruned": 2, "failed": 1, "duplicates": 1, "elapsed": 300.0}
    yield {**counts, "event": "confirming", "rounds": 3, "runs": 9, "estimate_s": 20.0, "baseline": 0, "trials": [
        {"trial": 6, "samples_per_s": 97.2, "why": "the fastest trial"},
        {"trial": 3, "samples_per_s": 95.1, "why": "within 3% of the fastest, a trial's noise"},
        {"trial": 0, "samples_per_s": 41.0, "why": "the baseline, for the measured gain"}]}
    where = {"rounds": 3, "runs": 9, "round": 1}
    yield {**counts, **where, "event": "confirm_launched", "trial": 6, "run": 1}
    yield {**counts, **where, "event": "confirm", "trial": 6, "run": 1, "status": "ok", "samples_per_s": 90.1,
           "error": "", "trial_samples_per_s": 97.2, "elapsed": 320.0}
    yield {**counts, **where, "event": "confirm_launched", "trial": 3, "run": 2, "elapsed": 320.0}
    yield {**counts, **where, "event": "confirm", "trial": 3, "run": 2, "status": "lost", "samples_per_s": 0.0,
           "error": "ray.exceptions.ActorDiedError: the actor died unexpectedly", "trial_samples_per_s": 95.1,
           "elapsed": 340.0}


def _fed(view: TuneView, until: tuple[str, int] | None = None) -> TuneView:
    """``view`` fed the events, up to the first of kind ``until[0]`` of trial ``until[1]``."""
    for event in _events():
        view(event)
        if until == (event["event"], event.get("trial")):
            break
    return view


def test_every_line_fits_80_columns_with_long_knobs_and_errors():
    stream = io.StringIO()
    _fed(TuneView("plain", 16 * 2**20, stream=stream))
    lines = stream.getvalue().splitlines()
    assert max(len(line) for line in lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    text = " ".join(" ".join(lines).split())
    # nothing was cut: every knob of the point, the whole error
    assert all(f"{k}={v}" in text for k, v in KNOBS.items() if k not in ("micro_batch", "ckpt_ratio", "ckpt_policy",
                                                                         "pipeline_schedule"))
    assert "mb=16 ckpt=0.75 ckpt_by=selective sched=interleaved_zero_bubble" in text
    assert " ".join(LONG_ERROR.split())[:150] in text
    # the knobs on lines of their own, below the trial's figures
    first = next(i for i, line in enumerate(lines) if line.startswith("[  1/12] #0"))
    assert "97.2 samples/s" in lines[first] and "tp=" not in lines[first]
    assert lines[first + 1].startswith("     ") and "tp=" in " ".join(lines[first + 1:first + 5])
    assert "(out of the box)" not in text  # the baseline is tp=1: trial 0 is not it


def test_every_outcome_word_comes_with_its_reason():
    stream = io.StringIO()
    _fed(TuneView("plain", 16 * 2**20, stream=stream))
    text = " ".join(stream.getvalue().split())
    # a lost trial: its error and what "lost" means
    assert re.search(r"#1 +lost +ray\.exceptions\.ActorDiedError: the actor died unexpectedly \(its node was "
                     r"removed\) \(the cluster lost a rank or node", text), text
    # pruned points are not listed (the bar counts them, with why: see the bar's test)
    assert "20.1 MiB" not in text and "30.0 MiB" not in text
    # a lost confirmation round: its error, what lost means, and what happens to the round
    assert ("[confirm 2/9] #3 round 1/3: lost: ray.exceptions.ActorDiedError: the actor died unexpectedly "
            f"({MEANINGS['lost']}) (this round is left out of its figure)") in text
    # the summary: each word that occurred, with what it means
    summary = {"best_point": None, "by_status": {"ok": 3, "crash": 1, "pruned": 2, "interrupted": 1, "lost": 1},
               "duplicates": 2, "stop": "trials", "elapsed": 10.0}
    out = io.StringIO()
    print_summary(summary, 2**24, stream=out)
    table = " ".join(re.sub(r"[│┌┐└┘├┤─┬┴┼]", " ", out.getvalue()).split())
    for word in ("crash", "pruned", "interrupted", "lost", "repeat"):
        assert f"{word}: {MEANINGS[word]}" in table, word


def test_why_each_trial_is_confirmed_is_said_once():
    stream = io.StringIO()
    _fed(TuneView("plain", 16 * 2**20, stream=stream))
    lines = stream.getvalue().splitlines()
    text = " ".join(" ".join(lines).split())
    assert sum(line.startswith("[confirm] measured again side by side") for line in lines) == 1
    assert "#6 (97.20 samples/s as a trial): the fastest trial" in text
    assert "#3 (95.10 samples/s as a trial): within 3% of the fastest, a trial's noise" in text
    assert "#0 (41.00 samples/s as a trial): the baseline, for the measured gain" in text
    assert text.count("the fastest trial") == 1  # not again on each round's line
    assert "[confirm 1/9] #6 round 1/3: 90.10 samples/s (as a trial 97.20)" in text


def _frame(view: TuneView) -> list[str]:
    console = Console(file=io.StringIO(), width=WIDTH, record=True)
    console.print(view.frame())
    return console.export_text().splitlines()


@pytest.mark.parametrize("phase", ["launched", "confirm_launched", "confirm"])
def test_the_bar_fits_80_columns_and_confirmation_is_a_phase_of_its_own(phase, monkeypatch):
    """During the trials the bar counts trials; once confirmation begins, its runs, with an ETA
    from the trials' time per run (before the first run ends) or the runs' own pace; what is in
    flight is named."""
    import slapo_tune.cli._live as live

    clock = iter(range(1000, 2000, 10))
    monkeypatch.setattr(live.time, "monotonic", lambda: float(next(clock)))
    view = _fed(TuneView("live", 16 * 2**20, stream=io.StringIO()), until=(phase, 5 if phase == "launched" else 6))
    frame = _frame(view)
    assert max(len(line) for line in frame) <= WIDTH, frame
    bar = frame[0]
    if phase == "launched":  # trial 5 in flight, its long knobs wrapped
        assert "trials 2/12" in bar and re.search(r"ETA \d", bar), bar
        assert " ".join(" ".join(frame[1:3]).split()) == ("pruned 2 (predicted not to fit, never run), failed 1 "
                                                         "(crashed or timed out), repeats 1 (known points, not run again)")
        assert any(line.startswith("  #5 running for") for line in frame)
        assert "sched=interleaved_zero_bubble" in " ".join(frame)
        return
    done = 0 if phase == "confirm_launched" else 1
    assert f"confirming {done}/9 runs" in bar and "trials 12/12" not in bar, bar
    eta = re.search(r"ETA (\d+)m(\d+)s", bar)
    assert eta and int(eta.group(1)) * 60 + int(eta.group(2)) > 0, bar
    counts = " ".join(" ".join(frame[1:3]).split())
    assert ("after 12/12 trials: pruned 2 (predicted not to fit, never run), failed 1 (crashed or timed out), "
            "repeats 1 (known points, not run again)") in counts, frame
    if phase == "confirm_launched":
        assert int(eta.group(1)) * 60 + int(eta.group(2)) == 9 * 20  # nine runs at the trials' 20 s
        assert re.match(r"  #6 round 1/3 running for \d+s", frame[3]), frame
