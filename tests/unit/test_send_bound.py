"""The pipeline send bound the cost model reads (:func:`~slapo_tune.parallel._send_release.pending_gradient_sends`:
a walk of torch's action lists keeping only what the bound needs, two rounds of micro-batches at
most) is, on every rank, what the runtime's proof (:class:`~slapo_tune.parallel._send_release.SendProof`)
gives walked over the whole step of torch's lowering."""

import gc
import json
from pathlib import Path

import pytest

from slapo_tune._partition import interleaved_microbatches_ok

pytest.importorskip("torch")

SCHEDULES = ("1f1b", "zb")


def _proof_bounds(pp: int, vpp: int, m: int, schedule: str) -> list[int]:
    """The ground truth: the runtime's proof over torch's whole lowered step, rank by rank."""
    from torch.distributed.pipelining import schedules

    from slapo_tune.parallel._send_release import SendProof, _lowered_orders

    cls = schedules.ScheduleInterleavedZeroBubble if schedule == "zb" else schedules.ScheduleInterleaved1F1B
    proof = SendProof(*_lowered_orders(cls, pp, vpp, m))
    return [proof.pending_gradient_sends(rank) for rank in range(pp)]


def _microbatches(pp: int, most: int) -> list[int]:
    """Every micro-batch count torch's interleaved schedules run on ``pp`` ranks, from ``pp`` to
    ``most`` (whole rounds of ``pp``, and the uneven rounds it allows between them)."""
    return [m for m in range(pp, most + 1) if interleaved_microbatches_ok(m, pp)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", range(2, 9))
def test_the_bound_is_the_proofs_walked_over_the_whole_step(schedule, pp):
    """pp 2-8, vpp 1-4, every micro-batch count torch runs up to four rounds (whole rounds
    beyond the second are not walked by the bound): the bound of every rank is the proof's."""
    from slapo_tune.parallel._send_release import pending_gradient_sends

    for vpp in range(1, 5):
        for m in _microbatches(pp, 4 * pp):
            assert [pending_gradient_sends(pp, vpp, m, r, schedule) for r in range(pp)] == \
                _proof_bounds(pp, vpp, m, schedule), (pp, vpp, m)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp, vpp, rounds", [(2, 2, 6), (4, 3, 8), (3, 5, 4), (8, 5, 5)]
                         + [(pp, vpp, 5) for pp in range(9, 13) for vpp in (2, 3, 4, 6)]
                         + [(16, vpp, 3) for vpp in (2, 4)])
def test_the_bound_past_two_rounds_is_the_proofs_on_longer_steps_and_wider_pipelines(schedule, pp, vpp, rounds):
    from slapo_tune.parallel._send_release import pending_gradient_sends

    for m in (pp, 2 * pp, rounds * pp):
        assert [pending_gradient_sends(pp, vpp, m, r, schedule) for r in range(pp)] == \
            _proof_bounds(pp, vpp, m, schedule), (pp, vpp, m)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_bound_leaves_the_garbage_collector_as_it_found_it(enabled):
    """(It pauses the collector while torch lowers the schedule.)"""
    from slapo_tune.parallel._send_release import _bounds

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        _bounds.cache_clear()
        _bounds(3, 2, 6, "1f1b")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", range(2, 9))
def test_the_receive_counts_past_two_rounds_are_those_of_the_whole_step(schedule, pp):
    """The receive buffers the cost model reads (:func:`receive_buffers`: the most, at the rank's
    last backward and at the last loss; counted as a real step keeps them in
    tests/multirank/test_cost_model.py) walk two rounds of micro-batches at most: pp 2-8, vpp 2-4,
    every micro-batch count torch runs up to four rounds, every rank's three counts are those of
    torch's whole lowered step."""
    from torch.distributed.pipelining import schedules

    from slapo_tune.parallel._send_release import (
        _known_kinds,
        _lowered_orders,
        _receives_alive,
        receive_buffers,
    )

    cls = schedules.ScheduleInterleavedZeroBubble if schedule == "zb" else schedules.ScheduleInterleaved1F1B
    for vpp in range(2, 5):
        for m in _microbatches(pp, 4 * pp):
            orders, stage_to_rank = _lowered_orders(cls, pp, vpp, m)
            kinds = _known_kinds(orders)
            whole = [_receives_alive(orders[r], kinds[r], pp * vpp - 1) for r in range(pp)]
            assert [receive_buffers(pp, vpp, m, r, schedule) for r in range(pp)] == whole, (pp, vpp, m)


@pytest.fixture
def bounds_file(tmp_path, monkeypatch):
    """The cost model's file of schedule bounds in an empty cache, nothing of it in memory."""
    from slapo_tune.cost_model import _schedule_bounds

    monkeypatch.setenv("SLAPO_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(_schedule_bounds, "_KNOWN", {})
    monkeypatch.setattr(_schedule_bounds, "_READ", set())
    return _schedule_bounds


SHAPES = ((2, 2, 4, "1f1b"), (4, 2, 8, "zb"), (4, 3, 16, "1f1b"))  # the last: past two rounds, read as 8


def test_the_cost_models_bounds_are_the_walks_and_a_second_process_reads_them_from_its_file(bounds_file,
                                                                                            monkeypatch):
    """What the cost model reads equals the walk's; a new process (nothing in memory) reads the
    same from the file, walking nothing (a walk would fail here)."""
    from slapo_tune.parallel import _send_release

    found = {shape: bounds_file.schedule_bounds(*shape) for shape in SHAPES}
    for (pp, vpp, m, schedule), (sends, receives) in found.items():
        assert list(sends) == [_send_release.pending_gradient_sends(pp, vpp, m, r, schedule) for r in range(pp)]
        assert list(receives) == [_send_release.receive_buffers(pp, vpp, m, r, schedule) for r in range(pp)]
    assert bounds_file._file().exists()
    monkeypatch.setattr(bounds_file, "_KNOWN", {})
    monkeypatch.setattr(bounds_file, "_READ", set())

    def no_walk(*args):
        raise AssertionError(f"walked {args} again")

    monkeypatch.setattr(_send_release, "schedule_bounds", no_walk)
    assert {shape: bounds_file.schedule_bounds(*shape) for shape in SHAPES} == found
    assert all(isinstance(r, _send_release.ReceiveBuffers) for _, receives in found.values() for r in receives)


def test_a_bounds_file_of_another_walk_or_not_of_this_form_is_not_read(bounds_file, tmp_path, monkeypatch):
    """The file is named by the walk's source, so an edited walk finds its own; a file whose
    entries are not of the form written (or not JSON) gives way to the walk."""
    from slapo_tune.parallel import _send_release

    path = bounds_file._file()
    edited = tmp_path / "_send_release.py"
    edited.write_text(Path(_send_release.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(_send_release, "__file__", str(edited))
    assert bounds_file._file() != path
    monkeypatch.undo()  # the walk's own file again (and a fresh memory below)
    monkeypatch.setattr(bounds_file, "_KNOWN", {})
    monkeypatch.setattr(bounds_file, "_READ", set())
    monkeypatch.setenv("SLAPO_TUNE_CACHE", str(tmp_path))
    truth = _send_release.schedule_bounds(4, 2, 8, "zb")
    for text in ("not json", json.dumps([[[4, 2, 8, "zb"], [9, 9], [[9, 9, 9]] * 4]]),
                 json.dumps([[[4, 2, 8, "zb"], ["x"] * 4, [[1, 1, 1]] * 4]]), json.dumps({"4": 1})):
        path.write_text(text)
        bounds_file._KNOWN.clear()
        bounds_file._READ.clear()
        assert bounds_file.schedule_bounds(4, 2, 8, "zb") == truth, text
