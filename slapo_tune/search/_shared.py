"""Several drivers on one study (``tune`` started more than once on shared storage): each names
itself in the study, leaves the running trials of the others alone, and launches a point only
when it holds it (no trial asked before its own names the same point)."""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from ..space import point_key
from ._known import settled_status

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

# how long a driver waits for an earlier-asked trial of another driver to name its point before
# deciding a reservation without it (a driver killed between ask and naming leaves one for good)
RESERVATION_WAIT = 10.0
DRIVER_PREFIX = "driver:"  # the study's user attribute a driver registers under, with its start time


def driver_name() -> str:
    """A new driver's name in the study (``host:pid:tag``): other drivers on it leave its running
    trials alone."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def driver_alive(driver: str) -> bool | None:
    """Whether the driver named ``driver`` (``host:pid:tag``) still runs: True or False on this
    host (its process exists or not), None on another (it cannot be told from here)."""
    host, _, rest = driver.partition(":")
    if host != socket.gethostname():
        return None
    try:
        os.kill(int(rest.split(":")[0]), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def register(study: Study, driver: str) -> None:
    """Name ``driver`` in the study, before its first ask: another driver starting meanwhile
    leaves this one's trials alone, even one asked but not yet named (:func:`held_elsewhere`)."""
    study.set_user_attr(f"{DRIVER_PREFIX}{driver}", time.time())


def other_driver_live(study: Study, driver: str, recent: float) -> bool:
    """Whether another driver registered on the study is alive: its process exists (this host), or
    it registered less than ``recent`` seconds ago (another host)."""
    return any(name != driver and (driver_alive(name) or (driver_alive(name) is None and time.time() - since < recent))
               for name, since in ((k.removeprefix(DRIVER_PREFIX), v) for k, v in study.user_attrs.items()
                                   if k.startswith(DRIVER_PREFIX)))


def held_elsewhere(trial: FrozenTrial, driver: str, other_live: bool, recent: float) -> bool:
    """A RUNNING ``trial`` another live driver runs: its driver's process exists (this host) or the
    trial started less than ``recent`` seconds ago (another host). A trial not named yet (asked a
    moment ago) is another's while ``other_live`` (:func:`other_driver_live`)."""
    owner = trial.user_attrs.get("driver")
    if owner is None:
        return other_live
    if owner == driver:
        return False
    alive = driver_alive(owner)
    if alive is None and trial.datetime_start is not None:
        alive = (datetime.datetime.now() - trial.datetime_start).total_seconds() < recent
    return bool(alive)


def holds(study: Study, number: int, key: str) -> bool:
    """Whether trial ``number``, just named point ``key``, holds it: no trial asked before it
    names the same point. Every trial names its point right after it is asked, so once each
    earlier running trial has one (waiting up to RESERVATION_WAIT for another driver's) the
    earliest-asked holder is known to every driver alike, and only it launches the point."""
    from optuna.trial import TrialState  # (optuna is loaded by a tuner's first study, not by --help)

    deadline = time.monotonic() + RESERVATION_WAIT
    while True:
        earlier = [t for t in study.get_trials(deepcopy=False) if t.number < number]
        unnamed = [t for t in earlier if t.state == TrialState.RUNNING and "point" not in t.user_attrs]
        if not unnamed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for t in earlier:
        point = t.user_attrs.get("point")
        if point is None or point_key(point) != key:
            continue
        # a repeat, or a trial whose point is queued again (interrupted, an infrastructure failure), holds nothing
        if t.state == TrialState.RUNNING or settled_status(t) is not None:
            return False
    return True
