"""What a user reads of a study (issue 23): the tune command's lines off a terminal, its summary,
report.html (rendered by Chromium where it is installed, parsed as HTML always), and
optuna-dashboard started as the tune command prints it, on one small finished study: a recorded
grid replayed (no real trials), its study in a journal as tune keeps it."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from itertools import takewhile
from pathlib import Path

import pytest

from benchmarks.search_strategies import load_grid, replay_tuner
from slapo_tune.cli._live import TuneView, eta, print_summary
from slapo_tune.cli.tune import dashboard_command
from slapo_tune.plan import TrialStatus, readable
from slapo_tune.schedule_file import read_schedule
from slapo_tune.search._outputs import Outputs

TRIALS = 12


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """(output folder, tuner, summary, the view's lines): a random search with analytic pruning,
    so the study has ok, oom and pruned points; then resumed for two more trials."""
    out = tmp_path_factory.mktemp("study")
    results, budget = load_grid()
    lines = io.StringIO()
    storage = f"journal:{out / 'study.journal'}"

    def run(trials):
        tuner, _ = replay_tuner("random", 0, "analytic", results, budget, trials=trials, storage=storage,
                                study="small", confirm=0, report=TuneView("plain", budget, stream=lines))
        return tuner, tuner.run()

    run(TRIALS)
    tuner, summary = run(TRIALS + 2)  # resumed
    Outputs(out, tuner.problem, tuner.config.strategy, tuner._command()).finish(tuner.study)
    return out, tuner, summary, lines.getvalue().splitlines()


def _status(trial):
    return trial.user_attrs.get("status")


def test_the_plain_lines_say_each_trial_its_result_and_the_best_so_far(study):
    out, tuner, summary, lines = study
    told = [t for t in tuner.study.trials if _status(t) not in (None, "duplicate")]
    # one line per finished trial: repeats and pruned points (never launched: counted, listed in
    # trials.csv and --json-lines) left out
    shown = [t for t in told if _status(t) != "pruned"]
    # a trial's block: its first line, then its figures' rest and its knobs on indented lines
    blocks = [[lines[i], *takewhile(lambda line: line.startswith(" "), lines[i + 1:])]
              for i, line in enumerate(lines) if re.match(r"\[ *\d+/\d+\] #", line)]
    assert len(blocks) == len(shown) and not any(" pruned " in block[0] for block in blocks)
    assert not any("\x1b[" in line for line in lines)  # no terminal codes off a terminal
    assert all(len(line) <= 80 for line in lines)
    best = 0.0
    for t, block in zip(sorted(shown, key=lambda t: t.datetime_complete), blocks):
        figures = next(i for i, line in enumerate(block) if "| best " in line) + 1
        assert " ".join(block[figures:]).split() == readable(t.user_attrs["point"]).split(), block  # its knobs
        line = " ".join(" ".join(block[:figures]).split())
        assert f"#{t.number} " in line and f" {_status(t)} " in line, line
        if _status(t) == "ok":
            best = max(best, t.values[0])
            peak = max(t.user_attrs["result"]["peak_memory"]) / 2**20
            assert f"{t.values[0]:.1f} samples/s" in line and f"peak {peak:.1f} MiB / 9.1 MiB" in line, line
            assert re.search(r"step [0-9.]+ s, predicted [0-9.]+", line), line
        # (the trial that set it, where this run saw it: not after a resume)
        assert re.search(rf"\| best {best:.1f} samples/s( \(#{_best_number(tuner, best)}\))?$" if best else
                         r"\| best -$", line), line
    assert {"ok", "oom", "pruned"} <= {_status(t) for t in told}
    resumed = [line for line in lines if line.startswith("resuming the study")]
    assert len(resumed) == 1 and f"{TRIALS} of {TRIALS + 2} trial(s) launched before" in resumed[0]


def _best_number(tuner, best):
    return min(t.number for t in tuner.study.trials if _status(t) == "ok" and t.values[0] == best)


def test_a_warning_is_shown_once_and_the_eta_counts_this_runs_pace():
    stream = io.StringIO()
    view = TuneView("plain", 2**20, stream=stream)
    base = {"launched": 1, "pruned": 0, "failed": 0, "duplicates": 0, "best": 5.0, "best_point": "tp=1",
            "elapsed": 1.0, "resumed": 0, "target": 4, "knobs": {"tp": 1}}
    for trial, waited in ((0, 59), (1, 85.5)):  # the same warning with another figure: not shown again
        result = {"samples_per_s": 5.0, "peak_memory": [2**19], "step_times": [0.2],
                  "warnings": [f"threads waited {waited}% of a step for a core"]}
        view({**base, "event": "ok", "trial": trial, "result": result, "predicted": {"step_s": 0.1}})
    assert stream.getvalue().count("threads waited") == 1 and "waited 59%" in stream.getvalue()
    import pandas as pd

    from slapo_tune.search._report import _warnings

    report = _warnings(pd.DataFrame({"trial": [1, 2, 3], "warnings": [
        "threads waited 59% of a step; 1 step(s) re-measured", "threads waited 85% of a step", ""]}))
    assert report.count("<li>") == 2 and "threads waited 59% of a step" in report
    assert "(trial(s) 1, 2; the figures vary)" in report and "re-measured <span class='dim'>(trial(s) 1)" in report
    # 6 of 12 launched, 4 of them before this run: 2 in 20 s, so 6 left take 60 s (not 20 / 6 * 6)
    assert eta({"launched": 6, "resumed": 4, "target": 12, "elapsed": 20.0}) == pytest.approx(60.0)
    assert eta({"launched": 4, "resumed": 4, "target": 12, "elapsed": 3.0}) is None  # nothing to go by yet
    assert eta({"launched": 6, "resumed": 0, "target": 12, "elapsed": 60.0, "time_budget": 90.0}) == pytest.approx(30.0)


def test_the_summary_table(study):
    _, tuner, summary, _ = study
    stream = io.StringIO()
    print_summary(summary, tuner.config.memory_budget, stream=stream)
    text = stream.getvalue()
    counts = {}
    for t in tuner.study.trials:
        if _status(t) not in (None, "duplicate"):
            counts[_status(t)] = counts.get(_status(t), 0) + 1
    launched = sum(n for s, n in counts.items() if TrialStatus(s).launched)
    assert f"{launched} launched ({counts['ok']} ok, {counts['oom']} oom)" in text
    assert f"{counts['pruned']} pruned" in text
    assert f"{summary['best']:.2f} samples/s" in text
    assert "over out of the box" in text and re.search(r"~?[0-9.]+x", text)
    assert summary["out_of_the_box"]["point"]["micro_batch"] == 1 and summary["out_of_the_box"]["point"]["tp"] == 1


class _Page(HTMLParser):
    """The report's tables (rows of cell texts), images and code blocks."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self.code, self.captions = [], [], [], []
        self._cell = self._row = None
        self._in = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag in ("code", "figcaption"):
            self._in, self._text = tag, ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr":
            self.tables[-1].append(self._row)
        elif tag == self._in:
            (self.code if tag == "code" else self.captions).append(self._text)
            self._in = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._in:
            self._text += data


def test_the_report_reads_as_tables_and_plots(study, tmp_path):
    """Parsed as HTML (and rendered by Chromium where it is installed: a screenshot of it)."""
    from slapo_tune.cli import build_parser

    out, tuner, _, _ = study
    page = _Page()
    page.feed((out / "report.html").read_text())
    best, trials = page.tables
    schedule = read_schedule(out / "best_schedule.json")
    rows = dict(r for r in best if len(r) == 2)
    for knob, value in schedule["knobs"].items():
        assert rows[knob].split(" (")[0] == str(value)
    assert rows["peak memory per rank"].endswith("of 9.1 MiB") or " of 9.1 MiB (predicted" in rows["peak memory per rank"]
    assert "over out of the box" in rows
    train, reproduce = page.code
    assert train == f"slapo-tune train --schedule {out / 'best_schedule.json'}"
    args = build_parser().parse_args(shlex.split(reproduce)[1:])  # the CLI takes the command as printed
    assert (args.strategy, args.trials, args.prune, args.out) == ("random", TRIALS + 2, "analytic", "replay")
    heading, *body = trials
    assert {"samples/s", "step (s)", "peak (MiB)", "predicted peak (MiB)"} <= set(heading)
    told = [t for t in tuner.study.trials if _status(t) not in (None, "duplicate")]
    assert sorted(int(r[0]) for r in body) == sorted(t.number for t in told)
    assert len(page.images) == len(page.captions) >= 6
    for src in page.images:
        assert base64.b64decode(src.removeprefix("data:image/png;base64,"))[:8] == b"\x89PNG\r\n\x1a\n"
    captions = " ".join(page.captions)
    for what in ("Throughput by knob", "budget (9.1 MiB)", "prediction", "Knob importance", "Timeline"):
        assert what in captions, what
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:  # rendered: the page lays out to a full-width screenshot that is not blank
        shot = tmp_path / "report.png"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1280,3000", f"--screenshot={shot}", (out / "report.html").as_uri()],
                       check=True, capture_output=True, timeout=120)
        import matplotlib.image

        pixels = matplotlib.image.imread(shot)
        assert pixels.shape[:2] == (3000, 1280) and pixels[..., :3].std() > 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_optuna_dashboard_runs_as_printed_and_shows_infeasible_points(study):
    """The command tune prints, started against the study: its API has one parameter per knob,
    the objective named, pruned and out-of-memory points infeasible (Optuna's constraints)."""
    out, tuner, _, _ = study
    command = shlex.split(dashboard_command(str(out / "study.journal")))
    assert command == ["optuna-dashboard", str(out / "study.journal")]
    assert dashboard_command("journal:/a b/study.journal") == "optuna-dashboard '/a b/study.journal'"
    executable = Path(sys.executable).with_name("optuna-dashboard")  # the venv's, as a user's shell finds it
    port = _free_port()
    proc = subprocess.Popen([str(executable), *command[1:], "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, studies = time.monotonic() + 60, None
        while studies is None and proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies",
                                                                       timeout=5) as resp:
                studies = json.load(resp)["study_summaries"]
            time.sleep(0.3)
        assert studies is not None, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no answer"
        (summary,) = studies
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}?after=0",
                                    timeout=10) as resp:
            detail = json.load(resp)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert summary["study_name"] == "small" and detail["objective_names"] == ["samples/s"]
    free = {k.name for k in tuner.space.free}
    assert {p["name"] for p in detail["union_search_space"]} == free
    by_number = {t.number: t for t in tuner.study.trials}
    seen = set()
    for trial in detail["trials"]:
        status = _status(by_number[trial["number"]])
        assert {p["name"] for p in trial["params"]} == free
        if status in ("pruned", "oom"):
            assert trial["constraints"] and trial["constraints"][0] > 0, trial
        elif status == "ok":
            assert trial["constraints"] == [0.0], trial
        seen.add(status)
    assert {"ok", "oom", "pruned"} <= seen
