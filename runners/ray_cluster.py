"""Where trials run: a Ray cluster the tuner starts, one it attaches to, or local processes.

``local`` starts a Ray head as its own process (``ray start --head --block`` in a new session),
not a ``ray.init()`` owned by the driver: a driver killed with SIGKILL then leaves the head
running instead of orphaning Ray's agents, the re-run command re-attaches to it (its PID and
address are recorded in the output folder), and the head is stopped, by PID, when the study
finishes. Every port of that head (GCS, raylet, object manager, client server, dashboard and its
agent, metrics exporter, runtime-env agent, workers) listens on 127.0.0.1 only, and its temp
folder is removed when it stops (unless kept for inspection: ``--keep-dashboard``).

Attaching to a running cluster checks its token authentication first (one line saying what is
missing, instead of Ray's retries and log lines), and keeps Ray's own messages (its C++ clients'
log lines, the raylet dumps it publishes when a node dies) out of the console: they go to the
results folder's ``ray.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from slapo_tune._atomic import atomic_write_text
from slapo_tune._inputs import parse_json
from slapo_tune.device import DeviceSetup, default_concurrency, device_setup
from slapo_tune.errors import InfrastructureError, UsageError
from slapo_tune.launch import INTERFACE_VARIABLES, usable_cores

from .local import LocalRunner
from .ray_runner import RayRunner

HEAD_FILE = ".ray_head.json"
HEAD_TEMP_PREFIX = "slapo-ray-"  # a local head's temp folder: /tmp/slapo-ray-PORT
# what a line about a local head that failed suggests: its trials need no Ray
WITHOUT_RAY = "--ray-address none runs the trials as local processes, without Ray"
HEAD_START_TIMEOUT = 90.0  # seconds for a local head to answer (5-10 s on an idle 2-core machine; more under load)
RAY_LOG = "ray.log"  # Ray's own messages to this driver, in the results folder
LOOPBACK = "127.0.0.1"
# A local head is Ray's single-machine mode: Ray then takes 127.0.0.1 as the node's address (as it
# does on macOS and Windows) instead of the address other hosts reach, so that every server
# binds to the loopback (given --node-ip-address=127.0.0.1 alone, Ray swaps in the address other
# hosts reach and binds the GCS, raylet and agents to all interfaces). Read by Ray at import: set in the head's environment and in this
# driver's before Ray is imported. Token authentication stays on (the dashboard and GCS refuse
# callers without ~/.ray/auth_token); the head is stopped only once its trials have ended, so
# it need not drain (Ray's default waits up to 30 s on SIGTERM).
LOCAL_HEAD_ENV = {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                  "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


@dataclass
class Cluster:
    runner: object
    kind: str  # local-ray | ray | none
    address: str | None = None
    dashboard: str | None = None
    head_pid: int | None = None
    head_file: Path | None = None
    head_temp: Path | None = None  # the local head's temp folder (sessions, logs, sockets)

    def describe(self) -> str:
        if self.kind == "none":
            return "trials run as local processes (no Ray)"
        where = f"Ray cluster at {self.address}"
        if self.dashboard:
            where += f"; dashboard {self.dashboard}"
            if self.kind == "local-ray" or os.environ.get("RAY_AUTH_MODE") == "token":
                where += " (token auth: header 'Authorization: Bearer <token>', token in ~/.ray/auth_token)"
        return where

    def stop(self, keep_head: bool = False) -> str | None:
        """Disconnect; stop the head this tuner started (by its PID), so nothing is left running,
        unless ``keep_head``: then the head (and its dashboard) stays up, a re-run re-attaches to
        it, and the returned line says how to stop it."""
        if self.runner is not None:  # None: given up before it had a runner
            self.runner.close()
        if self.kind == "none":
            return None
        import ray

        ray.shutdown()
        if keep_head and self.head_pid:
            return (f"the Ray head stays up (dashboard {self.dashboard}); stop it with: "
                    f"{stop_head_command(self.head_pid, self.head_temp)}")
        if self.head_pid:
            stop_head(self.head_pid, self.head_temp)
        if self.head_file:
            self.head_file.unlink(missing_ok=True)
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def remove_stale_head(out: Path) -> bool:
    """Remove ``out``'s head file when the head it records has ended (it died, or was killed with
    its tuner), so nothing re-attaches to a dead PID, and that head's temp folder unless a running
    process names it (a head started since on the same port). An unreadable file records no head
    that could be reached: removed too. Returns whether a file was removed."""
    head_file = out / HEAD_FILE
    try:
        recorded = json.loads(head_file.read_text())
        pid = int(recorded["pid"])
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        recorded, pid = {}, None
    if pid is not None and _alive(pid):
        return False
    head_file.unlink(missing_ok=True)
    temp = recorded.get("temp") if isinstance(recorded, dict) else None
    if temp and Path(temp).name.startswith(HEAD_TEMP_PREFIX) and not _named_by_a_process(Path(temp)):
        shutil.rmtree(temp, ignore_errors=True)
    return True


def _named_by_a_process(path: Path) -> bool:
    """Whether a running process's command line names ``path`` or a file in it (a head's processes
    name its temp folder); True where ``/proc`` cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "cmdline").is_file():
        return True
    name = os.fsencode(str(path))
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes() + b"\0"
        except OSError:  # ended meanwhile, or another user's
            continue
        if name + b"\0" in cmdline or name + b"/" in cmdline:
            return True
    return False


# what a line of a head's log that says why it failed looks like: a Python exception, or Ray's own
# words for a failure (its "Remaining processes will be killed." follows the reason, not is one)
_EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b:?")
_FAILURE_LINE = re.compile(r"error|fail|exited unexpectedly|cannot|could not|refused|denied|abort", re.IGNORECASE)
_NOT_A_REASON = re.compile(r"^-+ (BEGIN|END) |^Remaining processes will be killed")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
HEAD_LOG_MARK = "slapo-tune: starting a Ray head"  # the line before each head's own in ray_head.log
REASON_CHARS = 200  # a reason longer than this is cut: it is one line of a one-line message


def head_log_reason(log: Path | None) -> str:
    """Why a local head failed, as its log says in one line: the last Python exception the head
    wrote there, else its last line naming a failure, else its last line (cut to :data:`REASON_CHARS`)."""
    try:
        text = log.read_text(errors="replace") if log is not None else ""
    except OSError:
        text = ""
    if HEAD_LOG_MARK in text:  # this head's lines, after its mark's: the log keeps earlier heads' too
        text = text.rpartition(HEAD_LOG_MARK)[2].partition("\n")[2]
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines()]
    lines = [line for line in lines if line and not _NOT_A_REASON.search(line)]
    if not lines:
        return "nothing in its log"
    reason = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)),
                  next((line for line in reversed(lines) if _FAILURE_LINE.search(line)), lines[-1]))
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."


def stop_head(pid: int, temp: Path | None = None, grace: float = 20.0) -> None:
    """SIGTERM the head's session (``ray start --block`` then stops what it started), SIGKILL
    what is left after ``grace`` seconds; then remove its temp folder ``temp``."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    else:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)


def stop_head_command(pid: int, temp: Path | None) -> str:
    """The shell command that does what :func:`stop_head` does: SIGTERM to the head's process
    group (``ray start --block`` stops what it started; not ``ray stop``, which stops every Ray
    of this user on the machine), then its temp folder removed."""
    command = f"kill -TERM -{pid}"
    if temp is not None:
        command += f"; while kill -0 {pid} 2>/dev/null; do sleep 0.2; done; rm -rf {shlex.quote(str(temp))}"
    return command


def ensure_auth_token() -> Path:
    """The token the local head and this driver share (created, private to the user, if missing)."""
    import secrets

    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def start_head(out: Path, num_cpus: int, withheld: Collection[str] = ()) -> tuple[int, str, str, Path]:
    """Start a local Ray head on the loopback; returns (pid, GCS address, dashboard URL, temp folder).
    ``withheld``: environment variables of this process the head must not see (the caller's secrets)."""
    ray_exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_exe is None:
        raise UsageError("Ray is not installed: pip install 'ray[default]', or use --ray-address none")
    port, dash = _free_port(), _free_port()
    # Ray's Unix sockets live under the temp dir and their paths may not exceed ~107 bytes
    base = Path(os.environ.get("SLAPO_RAY_TMPDIR", "/tmp"))
    temp = (base if len(str(base)) <= 40 else Path("/tmp")) / f"{HEAD_TEMP_PREFIX}{port}"
    log = open(out / "ray_head.log", "ab")  # noqa: SIM115 - handed to the head process
    cmd = [ray_exe, "start", "--head", "--block", f"--node-ip-address={LOOPBACK}", f"--port={port}",
           f"--num-cpus={num_cpus}", "--include-dashboard=true", f"--dashboard-host={LOOPBACK}",
           f"--dashboard-port={dash}", f"--temp-dir={temp}", "--disable-usage-stats"]
    ensure_auth_token()  # the head reads it; this driver too
    log.write(f"{HEAD_LOG_MARK}: {shlex.join(cmd)}\n".encode())
    log.flush()
    # (the caller's secrets, such as the study's storage URL, password and all, are none of Ray's business)
    env = {**{k: v for k, v in os.environ.items() if k not in withheld}, **LOCAL_HEAD_ENV}
    # the temp files of the head's processes and trials in its own folder, removed with it: its
    # dashboard's multiprocessing folder (pymp-*) outlived every stopped head in $TMPDIR
    head_tmp = temp / "tmp"
    head_tmp.mkdir(parents=True)
    env["TMPDIR"] = str(head_tmp)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    return proc.pid, f"{LOOPBACK}:{port}", f"http://{LOOPBACK}:{dash}", temp


def _connect(address: str, timeout: float, namespace: str, head_pid: int | None = None,
             log: Path | None = None, ray_log: Path | None = None, runtime_env: dict | None = None) -> None:
    """Wait until the GCS port answers (a head still booting), check the token, then attach
    once: ``ray.init`` on a dead address retries for minutes, so it is only called on a live one.
    Ray's messages while attaching and after go to ``ray_log`` (None: where Ray puts them)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        if head_pid is not None and not _alive(head_pid):
            raise InfrastructureError(f"the local Ray head exited while starting: {head_log_reason(log)}; "
                                      f"{WITHOUT_RAY} (log: {log})")
        try:
            check_reachable(address, timeout=2.0)
            break
        except UsageError:
            if time.monotonic() < deadline:
                time.sleep(0.5)
            elif head_pid is not None:  # a head this tuner started, slow under load: not the user's input
                raise InfrastructureError(f"the local Ray head did not answer at {address} within {timeout:.0f} s "
                                          f"({head_log_reason(log)}); {WITHOUT_RAY} "
                                          f"(log: {log})") from None
            else:
                raise
    with _stderr_to(ray_log), _sigterm_handler_kept():
        _check_token(address)
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR",
                     runtime_env=runtime_env)
        except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
            _raise_if_token(address, exc)
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            if head_pid is None:
                raise UsageError(f"cannot attach to the Ray cluster at {address}: {first}") from None
            # the head this tuner started: not the user's input
            raise InfrastructureError(f"cannot attach to the local Ray head at {address}: {first}; {WITHOUT_RAY} "
                                      f"(log: {log})") from None
    if ray_log is not None:
        route_ray_messages(ray_log)


@contextlib.contextmanager
def _sigterm_handler_kept():
    """This process's SIGTERM handler put back afterwards: ``ray.init`` replaces it with one that
    calls ``sys.exit`` and Ray's core worker adds a C handler that dumps a stack trace (seen: no
    message, the driver aborted by SIGABRT, ``pymp-*`` left); the command line's (``cli._signals``)
    stops trials and the head as Ctrl-C does."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        # (None: a handler installed outside Python, which cannot be put back from here)
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


TOKEN_HELP = ("copy the cluster's token (on the head: ray get-auth-token) to ~/.ray/auth_token here, or name its "
              "file in RAY_AUTH_TOKEN_PATH (see docs/ray-clusters.md)")


def _check_token(address: str) -> None:
    """One GCS request with this process's token settings (``ray.init`` would retry a refused
    token for about 20 s, printing Ray's InvalidAuthToken lines)."""
    if address == "auto":  # (a Ray Job's driver: it runs with the cluster's own settings)
        return
    try:
        from ray._raylet import GcsClient
    except ImportError:  # a Ray without it: ray.init tells, more slowly
        return
    try:
        GcsClient(address=address)
    except Exception as exc:  # noqa: BLE001 - only an authentication failure is this check's to report
        _raise_if_token(address, exc)


def _raise_if_token(address: str, exc: BaseException) -> None:
    """A UsageError saying what token setting is missing, when ``exc`` (or its cause) is Ray's
    authentication failure."""
    chain = [exc, exc.__cause__, exc.__context__]
    if not any(e is not None and (type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e))
               for e in chain):
        return
    if os.environ.get("RAY_AUTH_MODE") != "token":
        raise UsageError(f"the Ray cluster at {address} uses token authentication: set RAY_AUTH_MODE=token and "
                         f"{TOKEN_HELP}") from None
    raise UsageError(f"the Ray cluster at {address} refused this machine's token (or found none): "
                     f"{TOKEN_HELP}") from None


@contextlib.contextmanager
def _stderr_to(path: Path | None):
    """File descriptor 2 appended to ``path`` meanwhile (Ray's C++ clients write there directly)."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as target:
            os.dup2(target.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def route_ray_messages(path: Path) -> None:
    """The error messages Ray publishes to every driver (a dead node's raylet log tail, sent by
    each of its agents: twice) appended to ``path``, each once, instead of printed on the
    console; with ``log_to_driver=False`` they are all this driver's message thread prints."""
    import ray._private.worker as ray_worker

    if not hasattr(ray_worker, "print_to_stdstream"):  # another Ray: its messages stay where they are
        return
    seen: set[str] = set()

    def to_log(data: dict, *_args, **_kwargs) -> None:
        lines = [line for line in data.get("lines", []) if line not in seen]
        seen.update(lines)
        if lines:
            with open(path, "a", encoding="utf-8") as f:
                f.write("".join(f"({data.get('pid', 'ray')}) {line}\n" for line in lines))

    ray_worker.print_to_stdstream = to_log


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast on an address nobody listens on (``ray.init`` would retry for minutes)."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"bad Ray address '{address}': expected HOST:PORT (or local / none)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None


def connect(ray_address: str, out: Path, world_size: int, concurrency: int | None,
            device: DeviceSetup | None = None, runtime_env: dict | None = None,
            net_if: str | None = None, withheld: Collection[str] = ()) -> Cluster:
    """A runner for ``--ray-address``: ``none`` (local processes), ``local`` (a head this tuner
    starts or re-attaches to), or the address of a running cluster. ``device``: where the ranks run
    (default: this machine's CPU); trials in flight default to what its devices hold
    (:func:`slapo_tune.device.default_concurrency`: GPUs // world size on CUDA, cores on CPU).
    ``runtime_env``: Ray's runtime environment for the trials (:func:`runtime_env_of`);
    ``net_if``: the network interface of the ranks' rendezvous and collectives (default: the one
    holding the node's Ray address, see :func:`runners.ray_runner.rendezvous_interface`);
    ``withheld``: environment variables a head this tuner starts must not see (:func:`start_head`)."""
    device = device or device_setup("cpu")
    cores = len(usable_cores())
    if out is not None:  # whichever --ray-address: a user told to use `none` leaves a dead head's file behind
        remove_stale_head(out)
    if ray_address == "none":
        return Cluster(LocalRunner.for_device(device, world_size, concurrency), "none")
    if ray_address == "local":
        os.environ.update(LOCAL_HEAD_ENV)  # before Ray reads its configuration
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("Ray is not installed: pip install 'ray[default]', or use --ray-address none") from None
    namespace = "slapo-tune"
    runtime_env = with_interface(runtime_env, net_if)
    if ray_address == "local":
        head_file = out / HEAD_FILE
        recorded = json.loads(head_file.read_text()) if head_file.is_file() else None
        if recorded and _alive(recorded["pid"]):
            pid, address, dashboard = recorded["pid"], recorded["address"], recorded["dashboard"]
            temp = Path(recorded["temp"]) if recorded.get("temp") else None  # (heads started before it was kept)
        else:
            pid, address, dashboard, temp = start_head(out, cores, withheld)
            atomic_write_text(head_file, json.dumps({"pid": pid, "address": address, "dashboard": dashboard,
                                                     "temp": str(temp)}))
        try:
            _connect(address, HEAD_START_TIMEOUT, namespace, head_pid=pid, log=out / "ray_head.log",
                     ray_log=out / RAY_LOG, runtime_env=runtime_env)
        except BaseException:  # an error, Ctrl-C or SIGTERM while it boots: nothing left running
            stop_head(pid, temp)
            head_file.unlink(missing_ok=True)
            raise
        cluster = Cluster(None, "local-ray", address, dashboard, pid, head_file, temp)
    else:
        _connect(ray_address, 3.0, namespace, ray_log=out / RAY_LOG, runtime_env=runtime_env)
        cluster = Cluster(None, "ray", ray_address, None)
    try:
        cluster.runner = RayRunner(concurrency=_fit(concurrency, world_size, device))
    except BaseException:  # a world the cluster's GPUs cannot hold, or interrupted: leave nothing running
        cluster.stop()
        raise
    return cluster


def with_interface(runtime_env: dict | None, net_if: str | None) -> dict | None:
    """``runtime_env`` with GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME set to ``net_if`` (``tune
    --net-if``), which every rank actor of this driver's job then reads."""
    if not net_if:
        return runtime_env
    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **dict.fromkeys(INTERFACE_VARIABLES, net_if)}
    return runtime_env


def _fit(concurrency: int | None, world_size: int, device: DeviceSetup) -> int:
    """Trials in flight: as asked, else as many as the cluster holds: on CUDA at one GPU per rank
    (a world larger than its GPUs is a UsageError, also with ``concurrency`` given), on CPU at one
    CPU per rank."""
    import ray

    resources = ray.cluster_resources()
    if device.cuda:
        fit = default_concurrency("cuda", world_size, int(resources.get("GPU", 0)))
    else:
        fit = default_concurrency("cpu", world_size, int(resources.get("CPU", 1)))
    return concurrency or fit


# the packages a trial's rank imports: shipped to the nodes by ``--runtime-env package``
SHIPPED_PACKAGES = ("slapo_tune", "runners", "search_spaces")


def runtime_env_of(value: str | None) -> dict | None:
    """Ray's runtime environment for ``--runtime-env``: ``package`` (this installation's
    packages, uploaded to the cluster, so that nodes need only Ray, torch and transformers), a
    ``.whl`` file (installed by pip on each node), or a JSON object as Ray takes it; None: none
    (every node has slapo-tune installed)."""
    import importlib

    if not value or value == "none":
        return None
    if value == "package":
        return {"py_modules": [str(Path(importlib.import_module(name).__file__).parent) for name in SHIPPED_PACKAGES],
                "excludes": ["__pycache__", "*.pyc"]}
    if value.endswith(".whl"):
        wheel = Path(value)
        if not wheel.is_file():
            raise UsageError(f"--runtime-env: no wheel at {value}")
        return {"py_modules": [str(wheel.resolve())]}
    try:
        env = parse_json(value, "--runtime-env")
    except UsageError:
        env = None
    if not isinstance(env, dict):
        shown = value if len(value) <= 60 else f"{value[:60]}..."
        raise UsageError(f"--runtime-env '{shown}': expected package, a .whl file or a JSON object")
    return env
