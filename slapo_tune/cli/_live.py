"""What ``tune`` shows while it runs, built on rich: the tuner's events (its ``report``) for a person.

On a terminal, a live display: a progress bar in two phases, the trials launched (of ``--trials``)
with the pruned, failed and repeated ones, then the confirmation's runs (see
``search._confirm``), each with elapsed time and an ETA, and what is in flight (a trial's knobs,
a confirmation's round) and how long it has run; above it one block per finished trial (its
throughput, peak memory against the budget, predicted against measured step time, the best so
far; its knobs on the next lines) and per confirmation run, why each trial is confirmed (once, as
the phase begins), and each warning once. Every outcome other than ok comes with its reason (the
error, and what the word means: :data:`MEANINGS`; the bar's counts with :data:`COUNTED`). Pruned
points, never launched, are counted, not listed (a budget that nothing fits would list the whole
space): trials.csv and ``json`` list them. Every line fits :data:`WIDTH` columns (or the
terminal, if narrower): knobs and long errors wrap onto indented lines. Elsewhere (a log file, a
pipe) the same lines, plain. ``json``: one object per event on stdout; ``quiet``: nothing until
the summary (:func:`print_summary`).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ..plan import TrialStatus, readable
from ..search._report import gain_text, warning_kind
from ..units import format_size
from ._common import wrapped

STYLES = {"ok": "green", "oom": "yellow", "crash": "red", "timeout": "red", "invalid": "red",
          "lost": "magenta", "placement_timeout": "magenta"}
STOPS = {"trials": "--trials spent", "time budget": "--time-budget spent", "no improvement": "--patience spent"}
ERROR_ROOM = 160  # characters of a failed trial's error (wrapped onto a second line)
WIDTH = 80  # the columns every line fits (a narrower terminal's own width)
INDENT = 5  # a block's continuation lines: knobs, the rest of an error
BAR = 30  # the progress bar's widest
# what each outcome word means, said with it (the trial lines, the confirmation's, the summary)
MEANINGS = {
    "oom": "ran out of memory",
    "crash": "a rank failed",
    "timeout": "stopped at --trial-timeout",
    "invalid": "not a legal point",
    "pruned": "the cost model predicts it cannot fit the budget: never launched",
    "interrupted": "in flight when an earlier run was stopped: run again",
    "lost": "the cluster lost a rank or node, not the point's fault",
    "placement_timeout": "the cluster could not place the ranks in time, not the point's fault",
    "repeat": "a point the study already knew: answered from it, not run again",
}
RETRIED = "; its point is run again once"  # a trial the cluster failed (see search._driver)
# the bar's counts, each with why (short: the bar's line)
COUNTED = {"pruned": "predicted not to fit, never run", "failed": "crashed or timed out",
           "repeats": "known points, not run again"}


def clock(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def fit(parts: list[str], width: int = WIDTH, indent: int = INDENT) -> list[str]:
    """``parts`` joined by two spaces into lines of at most ``width`` columns: a part that would
    pass the end starts a new line, indented; one longer than a line (an error, a sentence) goes on
    where the line is, broken at its spaces."""
    lines: list[str] = []
    for part in filter(None, parts):
        room = width - len(lines[-1]) - 2 if lines else width
        if len(part) <= room:
            lines[-1:] = [f"{lines[-1]}  {part}" if lines else part]
            continue
        flows = len(part) > width - indent  # would not fit a line of its own either
        text, head = (f"{lines.pop()}  {part}", "") if flows and lines else (part, " " * indent if lines else "")
        lines += wrapped(text, head, " " * indent, width=width)
    return lines


def knob_lines(knobs: str, width: int = WIDTH, indent: int = INDENT) -> list[str]:
    """A point's knobs on lines of their own, indented, at most ``width`` columns."""
    return wrapped(knobs, " " * indent, " " * indent, width=width)


def outcome(status: str, error: str | None = None, retried: bool = False) -> str:
    """``lost: <the error> (the cluster lost ...: what the word means)``: an outcome with its reason
    (``retried``: a trial's, whose point the tuner runs again where the cluster failed)."""
    last = (error or "").strip().splitlines()
    reason = textwrap.shorten(last[-1], ERROR_ROOM, placeholder=" ...") if last else ""
    meaning = MEANINGS.get(status, "") + (RETRIED if retried and TrialStatus(status).infrastructure else "")
    if reason and meaning:
        return f"{status}: {reason} ({meaning})"
    return f"{status}: {reason or meaning}" if reason or meaning else status


def eta(event: dict[str, Any]) -> float | None:
    """Seconds left, from this run's pace: the trials launched in this run (a resumed study's
    earlier ones took none of its time) over its elapsed time, times the trials left; within a
    ``--time-budget``. None before this run has launched a trial (nothing to go by)."""
    done_here = event["launched"] - event.get("resumed", 0)
    if done_here <= 0:
        return None
    left = max(0, event["target"] - event["launched"]) * event["elapsed"] / done_here
    if event.get("time_budget"):
        left = min(left, max(0.0, event["time_budget"] - event["elapsed"]))
    return left


class TuneView:
    """The tuner's ``report``: ``mode`` is ``live`` (a terminal), ``plain``, ``json`` or ``quiet``;
    ``auto`` is live where ``stream`` is a terminal, else plain. ``budget``: the memory budget per
    rank; ``knobs``: the knobs shown on a line (those the space varies). Use as a context manager:
    the live display ends with it."""

    def __init__(self, mode: str, budget: int, knobs: list[str] | None = None, stream: IO[str] | None = None):
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)
        if mode == "auto":
            mode = "live" if self.console.is_terminal else "plain"
        self.mode, self.budget, self.knobs = mode, budget, knobs
        self.width = min(WIDTH, self.console.width)
        self.in_flight: dict[int, tuple[dict[str, Any], float]] = {}  # trial -> (knobs, when it was launched)
        self.last: dict[str, Any] | None = None  # the latest event: the counts the bar shows
        self.best_trial: int | None = None
        self.baseline: dict[str, Any] | None = None  # the baseline's point (its trial is named so)
        self.made_to_fit = False
        self.confirming: dict[str, Any] | None = None  # the confirmation phase: its runs, their pace
        self.warned: set[str] = set()  # warning kinds already shown
        self._live: Live | None = None
        self._last_at = time.monotonic()

    def __enter__(self) -> TuneView:
        if self.mode == "live":
            self._live = Live(get_renderable=self.frame, console=self.console, refresh_per_second=2,
                              transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ------------------------------------------------------------------ events
    def __call__(self, event: dict[str, Any]) -> None:
        if self.mode == "quiet":
            return
        if self.mode == "json":
            print(json.dumps(event, default=str), flush=True)
            return
        self.last, self._last_at = event, time.monotonic()
        kind = event["event"]
        if kind == "start":
            self.baseline, self.made_to_fit = event.get("baseline_point"), event.get("made_to_fit", False)
            if event["resumed"] or event["pruned"]:
                self._print(f"resuming the study: {event['resumed']} of {event['target']} trial(s) launched before "
                            f"({event['pruned']} pruned, {event['failed']} failed); the ETA counts this run's pace; "
                            f"trials in flight when it stopped are run again (interrupted)")
        elif kind == "launched":
            self.in_flight[event["trial"]] = (event["knobs"], time.monotonic())
        elif kind == "confirming":
            self._confirming(event)
        elif kind == "confirm_launched":
            self.confirming["running"] = (event, time.monotonic())
        elif kind in ("confirm", "confirmed"):
            if kind == "confirm":
                self.confirming.update(done=event["run"], running=None)
            self._print(confirm_line(event, self.width), STYLES.get(event.get("status")) if kind == "confirm" else None)
        elif kind == TrialStatus.PRUNED:
            pass  # never launched: counted, not listed (see the module's docstring), the bar says why
        else:
            self.in_flight.pop(event.get("trial"), None)
            result = event.get("result") or {}
            if kind == "ok" and event["best"] == result.get("samples_per_s"):
                self.best_trial = event["trial"]
            self._print(self.trial_lines(event), STYLES.get(kind))
            for warning in result.get("warnings") or []:
                kind = warning_kind(warning)
                if kind not in self.warned:  # once: the same warning on every trial says nothing more
                    self.warned.add(kind)
                    self._print(f"warning (trial {event['trial']}; not repeated for later trials): {warning}",
                                "yellow")

    def _confirming(self, event: dict[str, Any]) -> None:
        """The confirmation phase begins: why each trial is measured again, said once."""
        self.in_flight.clear()
        self.confirming = {"runs": event["runs"], "done": 0, "started": time.monotonic(),
                           "estimate": event.get("estimate_s") or 0.0, "running": None}
        estimate = f", about {clock(event['runs'] * event['estimate_s'])}" if event.get("estimate_s") else ""
        what = ("[confirm] the crowned trial confirmed below other trials' figures: measured again beside them"
                if event.get("widened") else "[confirm] measured again side by side")
        lines = fit([f"{what}, {event['rounds']} alternating round(s) ({event['runs']} runs{estimate}); "
                     f"the fastest candidate is crowned:"], self.width)
        for t in event["trials"]:
            lines += fit([" " * INDENT + f"#{t['trial']} ({t['samples_per_s']:.2f} samples/s as a trial): {t['why']}"],
                         self.width, indent=INDENT + 2)
        self._print(lines)

    def _print(self, lines: str | list[str], style: str | None = None) -> None:
        for line in [lines] if isinstance(lines, str) else lines:
            for part in fit([line], self.width) if len(line) > self.width else [line]:
                self.console.print(Text(part, style=style or ""), soft_wrap=self.mode == "plain")

    # ------------------------------------------------------------------ lines
    def trial_lines(self, event: dict[str, Any]) -> list[str]:
        """One finished trial, within the view's width: ``[ 5/12] #7 ok  158.2 samples/s  peak 7.9 MiB
        / 9.1 MiB  step 0.101 s, predicted 0.058  | best 162.8 samples/s (#3)``, wrapped, and its
        knobs on the lines below (indented)."""
        kind, result, predicted = event["event"], event.get("result") or {}, event.get("predicted") or {}
        budget = format_size(self.budget)
        # (the live display's bar counts the trials: a plain line says where it stands itself)
        parts = [f"[{event['launched']:>3}/{event['target']}] " * (self.mode == "plain") + f"#{event['trial']:<3} {kind:<6}"]
        if self.baseline is not None and event.get("knobs") == self.baseline:
            parts.append("(out of the box, made to fit)" if self.made_to_fit else "(out of the box)")
        if kind == TrialStatus.OK:
            parts.append(f"{result['samples_per_s']:.1f} samples/s")
            parts.append(f"peak {format_size(max(result['peak_memory']))} / {budget}")
            steps = sorted(result.get("step_times") or [])
            if steps and predicted.get("step_s"):
                parts.append(f"step {steps[len(steps) // 2]:.3g} s, predicted {predicted['step_s']:.3g}")
        elif kind == TrialStatus.OOM:
            peaks = result.get("peak_memory") or []
            parts.append(f"out of memory (peak {format_size(max(peaks))} > {budget})" if peaks else "out of memory")
        else:
            parts.append(outcome(kind, result.get("error"), retried=True).removeprefix(f"{kind}: "))
        best = "-" if event["best"] is None else f"{event['best']:.1f} samples/s" + (
            f" (#{self.best_trial})" if self.best_trial is not None else "")
        parts.append(f"| best {best}")
        return fit(parts, self.width) + knob_lines(readable(event["knobs"], self.knobs), self.width)

    # ------------------------------------------------------------------ the live display
    def frame(self) -> Group:
        """The live display now: the bar of the phase under way (trials, then the confirmation's
        runs) with its count, elapsed time and ETA, the counts below it, and what is in flight."""
        event = dict(self.last or {"launched": 0, "pruned": 0, "failed": 0, "duplicates": 0, "elapsed": 0.0,
                                   "target": 0, "resumed": 0})
        now = time.monotonic()
        event["elapsed"] += now - self._last_at  # the clock runs between events too
        # each count with why, once there is one (a count and its why never split across lines)
        counts = [f"{word} {n}" + (f" ({why})" if n else "") for word, n, why in (
            ("pruned", event["pruned"], COUNTED["pruned"]), ("failed", event["failed"], COUNTED["failed"]),
            ("repeats", event["duplicates"], COUNTED["repeats"]))]
        rows: list[Any] = []
        if self.confirming is None:
            left, done, total = eta(event), event["launched"], event["target"]
            label = f"trials {done}/{total}"
            rows += [Text(line, style="dim") for line in wrapped(counts, "", " " * INDENT, width=self.width)]
            for trial, (knobs, since) in sorted(self.in_flight.items()):
                rows += [Text(line) for line in fit([f"  #{trial} running for {clock(now - since)}:", readable(
                    knobs, self.knobs)], self.width, indent=INDENT)]
        else:
            c = self.confirming
            done, total = c["done"], c["runs"]
            pace = (now - c["started"]) / done if done else c["estimate"]
            left = (total - done) * pace if pace else None
            label = f"confirming {done}/{total} runs"
            counts[0] = f"after {event['launched']}/{event['target']} trials: {counts[0]}"
            rows += [Text(line, style="dim") for line in wrapped(counts, "", " " * INDENT, width=self.width)]
            if c["running"] is not None:
                run, since = c["running"]
                rows.append(Text(f"  #{run['trial']} round {run['round']}/{run['rounds']} running for "
                                 f"{clock(now - since)}"))
        text = f"{label}  {clock(event['elapsed'])} elapsed  " + ("ETA -" if left is None else f"ETA {clock(left)}")
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=max(1, total), completed=done, width=max(5, min(BAR, self.width - len(text) - 1))),
                    text)
        return Group(bar, *rows)


def confirm_line(event: dict[str, Any], width: int = WIDTH) -> list[str]:
    """A confirmation run's lines (``confirm``: its figure, or its outcome with the reason) or the
    crowning's (``confirmed``: the confirmed figure and the gain over the baseline measured beside it)."""
    if event["event"] == "confirm":
        head = f"[confirm {event['run']}/{event['runs']}] #{event['trial']} round {event['round']}/{event['rounds']}:"
        if event.get("status") == TrialStatus.OK and event.get("samples_per_s"):
            return fit([f"{head} {event['samples_per_s']:.2f} samples/s (as a trial "
                        f"{event['trial_samples_per_s']:.2f})"], width)
        return fit([f"{head} {outcome(event.get('status'), event.get('error'))}",
                    "(this round is left out of its figure)"], width)
    parts = [f"[confirm] crowned #{event['trial']}: {event['samples_per_s']:.2f} samples/s (median of "
             f"{event.get('steps', '?')} steps, spread {event['spread']:.1%}; {event['candidates']} candidate(s))"]
    gain = event.get("gain")
    if event.get("baseline") == event["trial"]:
        parts.append("it is the baseline (out of the box) itself: 1.00x")
    elif gain is not None:
        parts.append(f"{gain['gain']:.2f}x the baseline #{event['baseline']} side by side (per round "
                     f"{gain['low']:.2f}-{gain['high']:.2f}x)")
    return fit(parts, width)


def print_summary(summary: dict[str, Any], budget: int, knobs: list[str] | None = None,
                  stream: IO[str] | None = None) -> None:
    """The final table: the best point, its throughput and memory, the gain over the
    out-of-the-box schedule, the trials by status, why the search stopped."""
    console = Console(file=stream or sys.stdout, highlight=False)
    if stream is None and not console.is_terminal:  # a terminal's own width; a log, 100 columns
        console = Console(file=sys.stdout, highlight=False, width=100)
    table = Table(title="slapo-tune: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    best = summary["best_point"]
    if best is not None:
        table.add_row("best point", readable(best, knobs))
        throughput = f"{summary['best']:.2f} samples/s"
        if summary["confirmed"]:
            c = summary["confirmed"]
            throughput += (f", confirmed (median of {len(c['step_times'])} steps, spread {c['spread']:.1%}; "
                           f"its trial measured {c['trial_samples_per_s']:.2f})")
        table.add_row("throughput", throughput)
        if summary.get("best_peak"):
            table.add_row("peak memory", f"{format_size(summary['best_peak'])} of {format_size(budget)} per rank")
        table.add_row("over out of the box", gain_text(summary.get("out_of_the_box"), knobs))
    else:
        table.add_row("best point", "none ran ok: loosen --memory-budget or check the failures in trials.csv")
    counts = summary.get("by_status") or {}
    launched = sum(n for s, n in counts.items() if TrialStatus(s).launched)
    others = ", ".join(f"{n} {s}" for s, n in counts.items() if not TrialStatus(s).launched)
    table.add_row("trials", f"{launched} launched ("
                  + ", ".join(f"{n} {s}" for s, n in counts.items() if TrialStatus(s).launched) + ")"
                  + (f"; {others}" if others else "")
                  + (f"; {summary['duplicates']} repeat(s)" if summary["duplicates"] else ""))
    words = [s for s in counts if s in MEANINGS] + ["repeat"] * bool(summary["duplicates"])
    if words:  # every outcome word with what it means
        table.add_row("outcomes", "; ".join(f"{word}: {MEANINGS[word]}" + (RETRIED if word in ("lost", "placement_timeout")
                                                                            else "") for word in words))
    confirming = (f" ({clock(summary['confirm_seconds'])} of it confirming)"
                  if summary.get("confirm_seconds", 0) >= 1 else "")
    table.add_row("stopped", f"{STOPS.get(summary['stop'], summary['stop'])}, after {clock(summary['elapsed'])}"
                  + confirming)
    console.print(table)
