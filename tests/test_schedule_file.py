"""best_schedule.json: written atomically, validated on load, refused with one clear line."""

from __future__ import annotations

import json

import pytest

from slapo_tune import UsageError
from slapo_tune.schedule_file import FORMAT, make_schedule, read_schedule, write_schedule


def _schedule():
    knobs = {"tp": 2, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 4, "ckpt_ratio": 0.5,
             "pipeline_schedule": "1f1b", "attn": "sdpa", "fuse": "off"}
    return make_schedule(template={"name": "gpt2", "version": "1"}, knobs=knobs, world_size=2, global_batch=16,
                         seq_len=128, dtype="fp32", model={"name": "gpt2-tiny", "fingerprint": "abc"}, device="cpu",
                         accumulation=4, measured={"samples_per_s": 12.5}, study="s")


def test_round_trip(tmp_path):
    path = tmp_path / "best_schedule.json"
    write_schedule(path, _schedule())
    loaded = read_schedule(path)
    assert loaded["format"] == FORMAT and loaded["knobs"]["tp"] == 2 and loaded["layout"] == {
        "tp": 2, "pp": 1, "dp": 1, "zero": 0}
    assert loaded["versions"]["torch"] and not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(version=99), "unsupported schedule version 99"),
    (lambda d: d.update(format="pickle"), "not a slapo-tune schedule"),
    (lambda d: d.pop("knobs"), "missing field 'knobs'"),
    (lambda d: d.update(world_size="2"), "field 'world_size' should be int"),
    (lambda d: d["knobs"].update(tp=[2]), "knob tp has a non-scalar value"),
    (lambda d: d.update(micro_batch=0), "micro_batch must be positive"),
])
def test_invalid_files_are_refused(tmp_path, mutate, message):
    data = _schedule()
    mutate(data)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=message):
        read_schedule(path)


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        read_schedule(tmp_path / "nope.json")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_schedule())[:50])
    with pytest.raises(UsageError, match="not valid JSON"):
        read_schedule(path)
