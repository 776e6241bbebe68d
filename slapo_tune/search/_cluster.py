"""Where trials run: a Ray cluster the tuner starts, one it attaches to, or local processes.

``local`` starts a Ray head as its own process (``ray start --head --block`` in a new session),
not a ``ray.init()`` owned by the driver: a driver killed with SIGKILL then leaves the head
running instead of orphaning Ray's agents, the re-run command re-attaches to it (its PID and
address are recorded in the output folder), and the head is stopped, by PID, when the study
finishes. Every port of that head (GCS, raylet, object manager, client server, dashboard and its
agent, metrics exporter, runtime-env agent, workers) listens on 127.0.0.1 only, and its temp
folder is removed when it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .._atomic import atomic_write_text
from ..device import DeviceSetup, default_concurrency, device_setup
from ..errors import UsageError
from ._storage import STORAGE_ENV

HEAD_FILE = ".ray_head.json"
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

    def stop(self) -> None:
        """Disconnect; stop the head this tuner started (by its PID), so nothing is left running."""
        if self.runner is not None:  # None: given up before it had a runner
            self.runner.close()
        if self.kind == "none":
            return
        import ray

        ray.shutdown()
        if self.head_pid:
            stop_head(self.head_pid, self.head_temp)
        if self.head_file:
            self.head_file.unlink(missing_ok=True)


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


def start_head(out: Path, num_cpus: int) -> tuple[int, str, str, Path]:
    """Start a local Ray head on the loopback; returns (pid, GCS address, dashboard URL, temp folder)."""
    ray_exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_exe is None:
        raise UsageError("Ray is not installed: pip install 'ray[default]', or use --ray-address none")
    port, dash = _free_port(), _free_port()
    # Ray's Unix sockets live under the temp dir and their paths may not exceed ~107 bytes
    base = Path(os.environ.get("SLAPO_RAY_TMPDIR", "/tmp"))
    temp = (base if len(str(base)) <= 40 else Path("/tmp")) / f"slapo-ray-{port}"
    log = open(out / "ray_head.log", "ab")  # noqa: SIM115 - handed to the head process
    cmd = [ray_exe, "start", "--head", "--block", f"--node-ip-address={LOOPBACK}", f"--port={port}",
           f"--num-cpus={num_cpus}", "--include-dashboard=true", f"--dashboard-host={LOOPBACK}",
           f"--dashboard-port={dash}", f"--temp-dir={temp}", "--disable-usage-stats"]
    ensure_auth_token()  # the head reads it; this driver too
    # (the study's storage URL, password and all, is none of Ray's business: it is not passed on)
    env = {**{k: v for k, v in os.environ.items() if k != STORAGE_ENV}, **LOCAL_HEAD_ENV}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    return proc.pid, f"{LOOPBACK}:{port}", f"http://{LOOPBACK}:{dash}", temp


def _connect(address: str, timeout: float, namespace: str, head_pid: int | None = None,
             log: Path | None = None) -> None:
    """Wait until the GCS port answers (a head still booting), then attach once: ``ray.init`` on a
    dead address retries for minutes, so it is only called on a live one."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        if head_pid is not None and not _alive(head_pid):
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log and log.is_file() else []
            raise UsageError(f"the local Ray head exited while starting: {tail[0] if tail else 'no log'} "
                             f"(log: {log})")
        try:
            check_reachable(address, timeout=2.0)
            break
        except UsageError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise UsageError(f"cannot attach to the Ray cluster at {address}: {first}") from None


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
            device: DeviceSetup | None = None) -> Cluster:
    """A runner for ``--ray-address``: ``none`` (local processes), ``local`` (a head this tuner
    starts or re-attaches to), or the address of a running cluster. ``device``: where the ranks run
    (default: this machine's CPU); trials in flight default to what its devices hold
    (:func:`slapo_tune.device.default_concurrency`: GPUs // world size on CUDA, cores on CPU)."""
    from runners import LocalRunner

    from ..launch import usable_cores

    device = device or device_setup("cpu")
    cores = len(usable_cores())
    if ray_address == "none":
        return Cluster(LocalRunner.for_device(device, world_size, concurrency), "none")
    if ray_address == "local":
        os.environ.update(LOCAL_HEAD_ENV)  # before Ray reads its configuration
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("Ray is not installed: pip install 'ray[default]', or use --ray-address none") from None
    from runners.ray_runner import RayRunner

    namespace = "slapo-tune"
    if ray_address == "local":
        head_file = out / HEAD_FILE
        recorded = json.loads(head_file.read_text()) if head_file.is_file() else None
        if recorded and _alive(recorded["pid"]):
            pid, address, dashboard = recorded["pid"], recorded["address"], recorded["dashboard"]
            temp = Path(recorded["temp"]) if recorded.get("temp") else None  # (heads started before it was kept)
        else:
            pid, address, dashboard, temp = start_head(out, cores)
            atomic_write_text(head_file, json.dumps({"pid": pid, "address": address, "dashboard": dashboard,
                                                     "temp": str(temp)}))
        try:
            _connect(address, 90.0, namespace, head_pid=pid, log=out / "ray_head.log")
        except UsageError:
            stop_head(pid, temp)
            head_file.unlink(missing_ok=True)
            raise
        cluster = Cluster(None, "local-ray", address, dashboard, pid, head_file, temp)
    else:
        _connect(ray_address, 3.0, namespace)
        cluster = Cluster(None, "ray", ray_address, None)
    try:
        cluster.runner = RayRunner(concurrency=_fit(concurrency, world_size, device))
    except UsageError:  # a world the cluster's GPUs cannot hold: leave nothing running
        cluster.stop()
        raise
    return cluster


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
