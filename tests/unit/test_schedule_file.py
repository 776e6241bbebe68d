"""best_schedule.json: written atomically, validated on load, refused with one clear line."""

from __future__ import annotations

import json

import pytest

from slapo_tune import UsageError
from slapo_tune.plan import Plan, Workload
from slapo_tune.schedule_file import FORMAT, make_schedule, read_schedule, write_schedule


def _schedule():
    knobs = {"tp": 2, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 4, "ckpt_ratio": 0.5,
             "pipeline_schedule": "1f1b", "attn": "sdpa", "fuse": "off"}
    return make_schedule(template={"name": "gpt2", "version": "1"}, plan=Plan.of(knobs, Workload(2, 16, 128)),
                         world_size=2, global_batch=16, seq_len=128, precision="fp32",
                         model={"name": "gpt2-tiny", "fingerprint": "abc"}, device="cpu",
                         measured={"samples_per_s": 12.5}, study="s")


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
    # figures show prints: a tampered one is one line, not a traceback there
    (lambda d: d["measured"].update(baseline_samples_per_s="fast"), "measured.baseline_samples_per_s should be a number"),
    (lambda d: d["measured"].update(gain=[1.3]), "measured.gain should be a number"),
])
def test_invalid_files_are_refused(tmp_path, mutate, message):
    data = _schedule()
    mutate(data)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=message):
        read_schedule(path)


def test_the_baseline_figures_add_to_version_2(tmp_path):
    """A schedule with the baseline's measured figures is still version 2 and loads; one without
    them (written before) loads as it did."""
    data = _schedule()
    data["measured"].update(baseline_samples_per_s=9.5, baseline_trial=0, gain=1.3, gain_low=1.1, gain_high=1.7)
    path = tmp_path / "s.json"
    write_schedule(path, data)
    loaded = read_schedule(path)
    assert loaded["version"] == 2 and loaded["measured"]["baseline_samples_per_s"] == 9.5
    write_schedule(path, _schedule())
    assert "baseline_samples_per_s" not in read_schedule(path)["measured"]


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        read_schedule(tmp_path / "nope.json")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_schedule())[:50])
    with pytest.raises(UsageError, match="not valid JSON"):
        read_schedule(path)


# The file format as docs/tuning.md documents it (Outputs): written out here, not read from the code.
REQUIRED = ("format", "version", "template", "knobs", "world_size", "layout", "global_batch", "micro_batch",
            "accumulation", "seq_len", "precision", "model", "device")
OPTIONAL = ("versions", "measured", "predicted", "study", "created")


def _written(tmp_path, data) -> str:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field", REQUIRED)
def test_each_required_field_is_required(tmp_path, field):
    data = _schedule()
    del data[field]
    with pytest.raises(UsageError, match=f"missing field '{field}'|not a slapo-tune schedule|unsupported schedule"):
        read_schedule(_written(tmp_path, data))


def test_optional_fields_may_be_absent(tmp_path):
    """A hand-written schedule (or one from a tool that records no measurements) still loads."""
    data = {k: v for k, v in _schedule().items() if k not in OPTIONAL}
    assert read_schedule(_written(tmp_path, data))["knobs"]["tp"] == 2


@pytest.mark.parametrize("field,limit", [("world_size", 2**20), ("global_batch", 2**31), ("micro_batch", 2**31),
                                         ("accumulation", 2**31), ("seq_len", 2**24)])
def test_sizes_up_to_the_largest_clusters_load_and_absurd_ones_do_not(tmp_path, field, limit):
    """The bounds only stop a tampered size from making the space enumeration run for ever: a million
    ranks, a 2**31 batch and 16 M-token sequences load; one more is refused with one line."""
    data = _schedule()
    data[field] = limit
    assert read_schedule(_written(tmp_path, data))[field] == limit
    data[field] = limit + 1
    with pytest.raises(UsageError, match=f"{field} must be at most {limit}"):
        read_schedule(_written(tmp_path, data))


def test_a_single_rank_schedule_without_accumulation_loads(tmp_path):
    """One GPU, one micro-batch per step: every size at its smallest legal value, 1."""
    data = _schedule()
    data.update(world_size=1, global_batch=1, micro_batch=1, accumulation=1, seq_len=1)
    assert read_schedule(_written(tmp_path, data))["world_size"] == 1


@pytest.mark.parametrize("section,key,message", [("template", "name", "template.name must be a string"),
                                                 ("template", "version", "template.version must be a string"),
                                                 ("model", "name", "model.name must be a string")])
def test_the_template_and_model_must_be_named(tmp_path, section, key, message):
    data = _schedule()
    del data[section][key]
    with pytest.raises(UsageError, match=message):
        read_schedule(_written(tmp_path, data))


def test_unreadable_files_are_one_line_errors(tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(UsageError, match="schedule file .*dir.json is a directory"):
        read_schedule(tmp_path / "dir.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError, match="schedule file .*binary.json is not UTF-8 text"):
        read_schedule(tmp_path / "binary.json")


def test_versions_name_the_installed_packages_and_skip_absent_ones(monkeypatch):
    """A job without Optuna (a training job) still writes schedules: absent packages are left out."""
    import importlib.metadata as md

    from slapo_tune import schedule_file

    real = md.version

    def version(name):
        if name == "optuna":
            raise md.PackageNotFoundError(name)
        return real(name)

    schedule_file._installed_versions.cache_clear()
    monkeypatch.setattr(md, "version", version)
    try:
        versions = schedule_file.library_versions()
    finally:
        schedule_file._installed_versions.cache_clear()
    assert "optuna" not in versions  # and the packages after it are still looked up:
    assert versions["torch"] == real("torch") and versions["ray"] == real("ray")


def test_a_version_1_file_loads_with_the_precision_it_ran_in(tmp_path):
    """Version-1 files named a dtype; "bf16" then meant autocast over fp32 parameters, which is
    today's amp-bf16 (not bf16 parameters). fp16 ran without a loss scaler and is refused."""
    path = tmp_path / "v1.json"
    for dtype, precision in (("fp32", "fp32"), ("bf16", "amp-bf16")):
        data = {k: v for k, v in _schedule().items() if k != "precision"}
        path.write_text(json.dumps({**data, "version": 1, "dtype": dtype}))
        loaded = read_schedule(path)
        assert (loaded["version"], loaded["precision"], "dtype" in loaded) == (2, precision, False)
    path.write_text(json.dumps({**data, "version": 1, "dtype": "fp16"}))
    with pytest.raises(UsageError, match="version-1 dtype 'fp16' has no precision here"):
        read_schedule(path)
