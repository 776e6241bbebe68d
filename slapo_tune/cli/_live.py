"""What ``tune`` shows while it runs, built on rich: the tuner's events (its ``report``) for a person.

On a terminal, a live display: a progress bar of the trials launched (of ``--trials``) with the
pruned, failed and repeated ones, elapsed time and an ETA, and the trials in flight with their
knobs and how long they have run; above it one line per finished trial (its throughput, peak
memory against the budget, predicted against measured step time, the best so far) and each
warning once. Pruned points, never launched, are counted, not listed (a budget that nothing fits
would list the whole space): trials.csv and ``json`` list them. Elsewhere (a log file, a pipe) the
same lines, plain. ``json``: one object per event on stdout; ``quiet``: nothing until the summary
(:func:`print_summary`).
"""

from __future__ import annotations

import json
import sys
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

STYLES = {"ok": "green", "oom": "yellow", "crash": "red", "timeout": "red", "invalid": "red",
          "lost": "magenta", "placement_timeout": "magenta"}
STOPS = {"trials": "--trials spent", "time budget": "--time-budget spent", "no improvement": "--patience spent"}
ERROR_ROOM = 80  # characters of a failed trial's error on its line


def clock(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


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
        self.in_flight: dict[int, tuple[dict[str, Any], float]] = {}  # trial -> (knobs, when it was launched)
        self.last: dict[str, Any] | None = None  # the latest event: the counts the bar shows
        self.best_trial: int | None = None
        self.warned: set[str] = set()
        self._live: Live | None = None
        self._last_at = time.monotonic()

    def __enter__(self) -> TuneView:
        if self.mode == "live":
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=2,
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
            if event["resumed"] or event["pruned"]:
                self._print(f"resuming the study: {event['resumed']} of {event['target']} trial(s) launched before "
                            f"({event['pruned']} pruned, {event['failed']} failed); the ETA counts this run's pace")
        elif kind == "launched":
            self.in_flight[event["trial"]] = (event["knobs"], time.monotonic())
        elif kind in ("confirm", "confirmed"):
            self._print(confirm_line(event))
        elif kind in ("confirming", "confirm_launched"):
            pass
        elif kind == TrialStatus.PRUNED:
            pass  # never launched: counted, not listed (see the module's docstring)
        else:
            self.in_flight.pop(event.get("trial"), None)
            result = event.get("result") or {}
            if kind == "ok" and event["best"] == result.get("samples_per_s"):
                self.best_trial = event["trial"]
            self._print(self.trial_line(event), STYLES.get(kind))
            for warning in result.get("warnings") or []:
                kind = warning_kind(warning)
                if kind not in self.warned:  # once: the same warning on every trial says nothing more
                    self.warned.add(kind)
                    self._print(f"warning (trial {event['trial']}; not repeated for later trials): {warning}",
                                "yellow")

    def _print(self, line: str, style: str | None = None) -> None:
        self.console.print(Text(line, style=style or ""), soft_wrap=self.mode == "plain")

    # ------------------------------------------------------------------ lines
    def trial_line(self, event: dict[str, Any]) -> str:
        """One finished trial: ``[ 5/12] #7 ok  tp=2 mb=4  158.2 samples/s  peak 7.9 MiB of 9.1 MiB
        step 0.101 s (predicted 0.058 s) | best 162.8 samples/s (#3)``."""
        kind, result, predicted = event["event"], event.get("result") or {}, event.get("predicted") or {}
        budget = format_size(self.budget)
        # (the live display's bar counts the trials: a plain line says where it stands itself)
        parts = [f"[{event['launched']:>3}/{event['target']}] " * (self.mode == "plain") + f"#{event['trial']:<3} {kind:<6}",
                 readable(event["knobs"], self.knobs)]
        if kind == TrialStatus.OK:
            parts.append(f"{result['samples_per_s']:.1f} samples/s")
            parts.append(f"peak {format_size(max(result['peak_memory']))} / {budget}")
            steps = sorted(result.get("step_times") or [])
            if steps and predicted.get("step_s"):
                parts.append(f"step {steps[len(steps) // 2]:.3g} s, predicted {predicted['step_s']:.3g}")
        elif kind == TrialStatus.OOM:
            peaks = result.get("peak_memory") or []
            parts.append(f"out of memory (peak {format_size(max(peaks))} > {budget})" if peaks else "out of memory")
        elif TrialStatus(kind).infrastructure:
            parts.append("the cluster failed, not the point: queued again once")
        else:
            error = (result.get("error") or "").strip().splitlines()
            parts.append(error[-1][:ERROR_ROOM] if error else "")
        best = "-" if event["best"] is None else f"{event['best']:.1f} samples/s" + (
            f" (#{self.best_trial})" if self.best_trial is not None else "")
        return "  ".join(p for p in parts if p) + f" | best {best}"

    # ------------------------------------------------------------------ the live display
    def _render(self) -> Group:
        event = dict(self.last or {"launched": 0, "pruned": 0, "failed": 0, "duplicates": 0, "elapsed": 0.0,
                                   "target": 0, "resumed": 0})
        event["elapsed"] += time.monotonic() - self._last_at  # the clock runs between events too
        left = eta(event)
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=max(1, event["target"]), completed=event["launched"], width=30),
                    f"{event['launched']}/{event['target']} trials",
                    f"pruned {event['pruned']}, failed {event['failed']}, repeats {event['duplicates']}",
                    f"{clock(event['elapsed'])} elapsed",
                    "ETA -" if left is None else f"ETA {clock(left)}")
        if not self.in_flight:
            return Group(bar)
        running = Table(box=None, padding=(0, 1), show_edge=False)
        for column in ("in flight", "knobs", "running for"):
            running.add_column(column, style="dim" if column == "in flight" else None)
        now = time.monotonic()
        for trial, (knobs, since) in sorted(self.in_flight.items()):
            running.add_row(f"#{trial}", readable(knobs, self.knobs), clock(now - since))
        return Group(bar, running)


def confirm_line(event: dict[str, Any]) -> str:
    figure = f"{event['samples_per_s']:.2f} samples/s" if event.get("samples_per_s") else event.get("status")
    what = (f"confirming trial {event['trial']}, round {event['round']}/{event['rounds']}"
            if event["event"] == "confirm" else
            f"crowned trial {event['trial']} of {event['candidates']} confirmed (spread {event['spread']:.1%})")
    return f"[confirm] {what} | {event['point']}: {figure}"


def print_summary(summary: dict[str, Any], budget: int, knobs: list[str] | None = None,
                  stream: IO[str] | None = None) -> None:
    """The final table: the best point, its throughput and memory, the gain over the
    out-of-the-box schedule, the trials by status, why the search stopped."""
    console = Console(file=stream or sys.stdout, highlight=False, width=100 if stream is None else None)
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
                  + (f"; {summary['duplicates']} repeat(s) answered from the study" if summary["duplicates"] else ""))
    table.add_row("stopped", f"{STOPS.get(summary['stop'], summary['stop'])}, after {clock(summary['elapsed'])}")
    console.print(table)
