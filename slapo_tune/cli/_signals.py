"""SIGTERM taken the way Ctrl-C is taken.

``kill``, systemd and Slurm stop a process with SIGTERM, whose default action ends it at once:
no trial or rank stopped by the tuner itself, no Ray head it started stopped, no message, and
multiprocessing's temp folder left behind. While a command runs, SIGTERM instead raises
:class:`~slapo_tune.errors.Terminated` (a ``KeyboardInterrupt``) in the main thread, so that every
path that cleans up after Ctrl-C cleans up after it too, and the command exits ``128 + 15``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from ..errors import Terminated


class _State:
    terminating = False  # a SIGTERM was raised: later ones would break off the cleanup it started
    deferring = 0  # inside termination_deferred (nested)
    pending = False  # a SIGTERM arrived while deferring


def _on_sigterm(signum: int, _frame) -> None:
    if _State.terminating:
        return
    if _State.deferring:
        _State.pending = True
        return
    _State.terminating = True
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (once: the cleanup it
    starts is not broken off by another); the previous handler is restored at the end. Elsewhere
    than in the main thread (where Python runs signal handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _State.terminating, _State.deferring, _State.pending = False, 0, False


@contextlib.contextmanager
def termination_deferred() -> Iterator[None]:
    """A SIGTERM arriving inside takes effect at the end of the block: for cleanup that must not
    stop half-way (a Ray head stopped by PID, then its temp folder removed)."""
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
    if not _State.deferring and _State.pending:
        _State.pending = False
        _on_sigterm(signal.SIGTERM, None)
