"""Run a function on N local ranks, each in its own process, and always clean up.

The ranks rendezvous through a file store in a private temp folder (mode 0700, removed when the
launch ends): no listening socket, and no other user of the machine can join or read it. gloo's
and NCCL's own connections use the loopback interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
unless already set): without it gloo listens on the address the hostname resolves to, often one
other hosts reach. Each rank runs in its own process group (so a rank's own children die with
it), and the parent kills every rank it started, by PID, on timeout or as soon as one rank fails.
Results come back over one pipe per rank, so a rank killed mid-write cannot corrupt the others'
results.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_all_start_methods, get_context
from typing import Any

from ._owned import remove_orphans, tag_as_mine
from .device import auto_setup, collective_timeout, device_setup, rank_environment, split_gpus, usable_cores
from .errors import SlapoTuneError


class RankFailure(SlapoTuneError, RuntimeError):
    """A rank raised, died, or the ranks ran out of time. ``kind`` is the trial status it amounts
    to (a :class:`slapo_tune.plan.TrialStatus` value): ``crash``, ``timeout``, or, where a cluster
    failed rather than the schedule, ``lost`` or ``placement_timeout``."""

    def __init__(self, message: str, *, rank: int | None = None, kind: str = "crash",
                 exc_type: str = "", details: str = ""):
        super().__init__(message)
        self.rank, self.kind, self.exc_type, self.details = rank, kind, exc_type, details
        self.when = time.time()  # when it happened (a rank's report carries its own clock)


@dataclass
class RankContext:
    """What a rank function receives besides its arguments."""

    rank: int
    world_size: int
    device: str


def default_backend(world_size: int) -> str:
    """nccl when CUDA gives each of ``world_size`` local ranks a GPU of its own, else gloo
    (:func:`slapo_tune.device.auto_setup`)."""
    return auto_setup(world_size).backend


# A rank's CUDA_VISIBLE_DEVICES must be in its environment when the process starts: CUDA reads it
# once, at its first call, and importing the rank's modules (transformers) may make that call
# before the rank function runs. Spawned children inherit this process's environment, so it is
# set around each start, one start at a time (trials start from several threads at once).
_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _started_with(env: dict[str, str]):
    with _START_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# Rank processes on CPU fork from a server that imported torch, transformers and the rank
# function's module once per launching process: a spawned rank imports them again (6-9 s for two
# ranks on a 2-core machine), a forked one is running in about 0.05 s. nccl ranks are spawned: each
# must see only its own GPU before CUDA is first asked, and the server's imports may have asked it.
_PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils")


UNIX_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, its NUL excluded)


_TAGGED: set[str] = set()  # multiprocessing temp dirs of this process tagged as its own
_TAG_LOCK = threading.Lock()  # (trials launch from several threads)


def multiprocessing_temp_dir() -> str:
    """multiprocessing's temp dir of this process (``pymp-*``, the fork server's socket), tagged as
    this process's; the first time, those of slapo-tune processes that ended without removing
    theirs (a SIGKILLed driver's: multiprocessing removes its own at a normal exit, SIGTERM
    included, see ``cli._signals``) are removed from beside it (:mod:`slapo_tune._owned`)."""
    from multiprocessing import util

    tempdir = util.get_temp_dir()
    with _TAG_LOCK:
        if tempdir not in _TAGGED:
            with contextlib.suppress(OSError):  # (untagged, it is only not removed after a SIGKILL)
                tag_as_mine(tempdir)
            remove_orphans(os.path.dirname(tempdir), "pymp-")
            _TAGGED.add(tempdir)
    return tempdir


def _start_method(backend: str, fn: Callable[..., Any]):
    # the server listens on a Unix socket named "listener-XXXXXXXX" in multiprocessing's temp dir:
    # under a deep $TMPDIR that path is too long for AF_UNIX, and ranks are spawned instead
    socket_path_length = len(os.path.join(multiprocessing_temp_dir(), "listener-XXXXXXXX"))
    if backend == "nccl" or "forkserver" not in get_all_start_methods() or socket_path_length > UNIX_SOCKET_PATH_MAX:
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, __name__, fn.__module__])  # read when the server starts
    return ctx


# the variables that name the network interface of gloo's and NCCL's connections
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
IFF_LOOPBACK = 0x8  # the loopback flag of an interface (Linux: /sys/class/net/NAME/flags)


def loopback_interface() -> str:
    """The name of this host's loopback interface: ``lo`` on Linux, ``lo0`` on macOS and BSD."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        with contextlib.suppress(OSError, ValueError), open(f"/sys/class/net/{name}/flags") as f:
            if int(f.read(), 16) & IFF_LOOPBACK:
                return name
    return next((name for name in names if name.startswith("lo")), "lo")  # no sysfs (not Linux): by name


def loopback_environment(environ=os.environ) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the loopback, for those ``environ`` leaves
    unset (one the user set wins): ranks on one host need no other interface."""
    unset = [variable for variable in INTERFACE_VARIABLES if not environ.get(variable)]
    return dict.fromkeys(unset, loopback_interface()) if unset else {}


def _rank_main(fn, rank, world_size, store_path, backend, args, conn, threads, env, timeout_s, cores=None):
    os.setpgrp()  # our own process group: killing it takes any helper processes with it
    _die_with_parent()
    _exit_with_launcher(conn)
    if cores:
        os.sched_setaffinity(0, cores)
    # the launcher's environment at this launch, not the fork server's from its first launch
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    reported = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        device = "cpu"
        collectives = timeout_s
        if backend == "nccl":  # this rank sees only its own GPU (CUDA_VISIBLE_DEVICES)
            device = device_setup("cuda").rank_device()
            torch.cuda.set_device(device)
            collectives = collective_timeout(timeout_s)  # a hung collective ends the rank, via NCCL's watchdog
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collectives))
        conn.send(("ok", rank, fn(RankContext(rank, world_size, device), *args)))
        reported = True
        # after reporting: a failed rank never tears its group down (NCCL's teardown can wait for the
        # peers' pending collectives, which would hold its report back); the launcher kills it
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        if not reported:
            conn.send(("error", rank, *describe_exception(exc), time.time()))
    finally:
        conn.close()


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the launching process dies (a SIGKILLed tuner must
    not leave ranks behind)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the parent's cleanup still applies
        pass


def _exit_with_launcher(conn) -> None:
    """End this rank (its process group) once the launcher's end of the result pipe is closed: the
    launcher died (or is done and kills its ranks anyway). A forked rank's parent is the fork
    server, which outlives a SIGKILLed launcher while any rank holds its lifeline, so the kernel's
    parent-death signal alone would leave the ranks running."""
    import select

    def watch() -> None:
        gone = select.poll()
        gone.register(conn.fileno(), select.POLLERR | select.POLLHUP)  # a pipe's write end: no reader left
        while True:
            events = [event for _, event in gone.poll()]
            if any(event & select.POLLNVAL for event in events):  # this rank closed it: it is ending
                return
            if events:
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="slapo-launcher-watch", daemon=True).start()


OOM_TYPES = ("OutOfMemoryError", "MemoryBudgetExceeded")  # what a trial records as ``oom``


def root_cause(exc: BaseException) -> BaseException:
    """The exception at the bottom of a chain: torch's pipeline schedules wrap whatever a stage
    raised (an out-of-memory error included) in a generic RuntimeError (``raise ... from``). An
    out-of-memory error anywhere in the chain, also as the context of an error raised while
    handling it (a cleanup that failed for want of memory), is the cause."""
    chain, seen = [exc], {id(exc)}
    while True:
        last = chain[-1]
        nxt = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if nxt is None or id(nxt) in seen:
            break
        chain.append(nxt)
        seen.add(id(nxt))
    oom = [e for e in chain if type(e).__name__ in OOM_TYPES]
    if oom:
        return oom[-1]
    root, visited = exc, {id(exc)}
    while root.__cause__ is not None and id(root.__cause__) not in visited:  # the explicit causes only
        root = root.__cause__
        visited.add(id(root))
    return root


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(type name, first line of the message, traceback) of the root cause of ``exc``."""
    root = root_cause(exc)
    text = next((line.strip() for line in str(root).splitlines() if line.strip()), "")
    return type(root).__name__, text, "".join(traceback.format_exception(root))


def kill_processes(procs) -> None:
    """SIGKILL each rank's process group, by PID, and reap the ranks."""
    for p in procs:
        if p.is_alive():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.join(timeout=10)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 300.0,
    backend: str | None = None,
    gpus: Sequence[str] | None = None,
    threads_per_rank: int | None = None,
    env: dict[str, str] | None = None,
    cores: Sequence[Sequence[int]] | None = None,
    running: set | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; returns each rank's result, by rank.

    ``fn`` must be importable by name (a module-level function). Raises :class:`RankFailure`
    naming the first rank that failed, with its exception type and traceback, or ``kind="timeout"``
    after ``timeout`` seconds. No rank process outlives this call. ``backend``: gloo (ranks on
    CPU) or nccl (one GPU per rank); default :func:`default_backend`. ``gpus``: with nccl, the GPUs
    the ranks get, one each, as ``CUDA_VISIBLE_DEVICES`` names them (default: the first
    ``world_size`` visible here); each rank sees only its own, as ``cuda:0``. ``cores``: the CPU cores
    each rank is pinned to (one list per rank), so that concurrent launches never share a core.
    ``running``: a set the rank processes are added to while they live (so another thread can
    :func:`kill_processes` them, e.g. on Ctrl-C). The ranks open no socket beyond the loopback
    (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name another interface).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or default_backend(world_size)
    if backend == "nccl":
        gpus = split_gpus(device_setup("cuda").gpu_ids if gpus is None else gpus, world_size)
    elif gpus:
        raise ValueError(f"gpus are given to nccl ranks only, not {backend}")
    if cores is not None and len(cores) != world_size:
        raise ValueError(f"cores: expected one core list per rank ({world_size}), got {len(cores)}")
    available = len(usable_cores())
    threads = threads_per_rank or max(1, min(len(c) for c in cores) if cores else available // world_size)
    child_env = {**os.environ, **loopback_environment(), "OMP_NUM_THREADS": str(threads),
                 "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    ctx = _start_method(backend, fn)
    procs, conns = [], []
    # the rendezvous store: a file only this user can reach (mkdtemp makes the folder 0700), not a
    # TCPStore, which listens on every interface whatever host it is given, unauthenticated; inside
    # the tagged multiprocessing temp dir, which the next run removes if this process is SIGKILLed
    rendezvous = tempfile.mkdtemp(prefix="slapo-rendezvous-", dir=multiprocessing_temp_dir())
    store_path = os.path.join(rendezvous, "store")
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            device_env = rank_environment(backend, gpus[rank] if gpus else None)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store_path, backend, tuple(args), child_end, threads,
                      {**child_env, **device_env}, timeout, list(cores[rank]) if cores else None),
                name=f"slapo-rank-{rank}",
            )
            with _started_with(device_env):
                proc.start()
            child_end.close()
            procs.append(proc)
            if running is not None:
                running.add(proc)
            conns.append(parent_end)
        return _collect(procs, conns, timeout)
    finally:
        kill_processes(procs)
        if running is not None:
            running.difference_update(procs)
        for c in conns:
            c.close()
        shutil.rmtree(rendezvous, ignore_errors=True)


def _collect(procs, conns, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending = {c: i for i, c in enumerate(conns)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(pending.values())
            raise RankFailure(f"timed out after {timeout:.0f} s waiting for rank(s) {ranks}", rank=ranks[0], kind="timeout")
        ready = connection.wait(list(pending) + [procs[i].sentinel for i in pending.values()], timeout=remaining)
        failures = _receive(ready, pending, procs, results)
        if failures:
            raise _root_failure(failures, pending, procs, results)
    return [results[i] for i in range(len(procs))]


FAILURE_GRACE = 1.0  # seconds to hear from the other ranks once one failed, to name the first cause


def _receive(ready, pending, procs, results) -> list[RankFailure]:
    """Take the messages of ready ranks into ``results``; return the failures seen, timed."""
    failures = []
    for obj in ready:
        if obj not in pending:
            continue
        rank = pending.pop(obj)
        try:
            msg = obj.recv()
        except EOFError:
            msg = None
        if msg is None:
            failures.append(RankFailure(_death_message(procs[rank], rank), rank=rank))
        elif msg[0] == "error":
            _, r, exc_type, text, tb, when = msg
            failure = RankFailure(f"rank {r} raised {exc_type}: {text}", rank=r, exc_type=exc_type, details=tb)
            failure.when = when
            failures.append(failure)
        else:
            results[rank] = msg[2]
    for conn, rank in list(pending.items()):
        if not procs[rank].is_alive() and not conn.poll():
            del pending[conn]
            failures.append(RankFailure(_death_message(procs[rank], rank), rank=rank))
    return failures


def is_peer_error(failure: RankFailure) -> bool:
    """A rank that failed only because another one went away first."""
    text = str(failure)
    return failure.exc_type in ("DistBackendError", "DistNetworkError") or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def _root_failure(failures, pending, procs, results) -> RankFailure:
    """The failure that came first, preferring a rank's own error or death over the peer errors
    it causes on the others (whose reports can reach us first)."""
    deadline = time.monotonic() + FAILURE_GRACE
    while pending and time.monotonic() < deadline:
        ready = connection.wait(list(pending) + [procs[i].sentinel for i in pending.values()],
                                timeout=max(0.0, deadline - time.monotonic()))
        failures += _receive(ready, pending, procs, results)
    return first_failure(failures)


def first_failure(failures: list[RankFailure]) -> RankFailure:
    """The failure that names the trial's cause: an out-of-memory error on any rank (its peers'
    failures follow from it, whatever they say: a gloo "connection closed", a timeout of a
    collective, an error text no rule knows), else the earliest of the ranks' own errors or deaths
    before peer errors."""
    oom = [f for f in failures if f.exc_type in OOM_TYPES]
    if oom:
        return min(oom, key=lambda f: f.when)
    own = [f for f in failures if not is_peer_error(f)]
    return min(own or failures, key=lambda f: f.when)


def _death_message(proc, rank: int) -> str:
    proc.join(timeout=5)
    code = proc.exitcode
    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"rank {rank} died ({how}) before reporting"


def run_queue_wait() -> float:
    """Seconds this process's threads have spent runnable but waiting for a core, so far."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except FileNotFoundError:  # not Linux: no figure, never a flag
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux: ``VmHWM``, the high-water mark of the process's
    own memory map; ``ru_maxrss`` would do elsewhere, but on Linux it survives ``exec`` and a rank
    spawned by a large launcher reports the launcher's peak (seen: two trials, one leaking 128 MiB
    per rank, both reporting the test runner's 665 MiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
