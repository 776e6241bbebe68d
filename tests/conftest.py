"""Test-session setup: offline Hugging Face, per-session temp dirs, and leak checks."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, urlsplit

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))  # tests/: the suite's root, above its kinds
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# under /tmp itself, not $TMPDIR: a pytest-xdist worker inherits the controller's session dir as
# $TMPDIR, and Ray's socket paths under a nested dir exceed the 107 bytes AF_UNIX allows
_SESSION_TMP = tempfile.mkdtemp(prefix="slapo-tune-tests-", dir="/tmp")
# multiprocessing's own temp dir (the rank fork server's socket) is made now, outside the session
# dir, so that multiprocessing removes it at exit after the session dir is gone
multiprocessing.util.get_temp_dir()
os.environ["TMPDIR"] = _SESSION_TMP  # children (ranks, Ray) inherit a private temp dir
tempfile.tempdir = _SESSION_TMP
# Nothing from the user's cache (calibrations, layouts, the measured CPU) reaches the tests: a
# session cache holding only the description of the CPU the recorded grids were measured on, so
# that cost-model rankings do not depend on this machine's load while it measures itself.
# One such cache for the whole run, pytest-xdist's workers included (they inherit the controller's
# environment): a model's layout, measured by a probe of several seconds, is the same in every
# process (written atomically), so it is measured once, not once per worker.
_SHARED_CACHE = "SLAPO_TUNE_TESTS_CACHE"
if os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(os.environ.get(_SHARED_CACHE, "")):
    _CACHE = os.environ[_SHARED_CACHE]  # in the controller's session dir, removed when the controller ends
else:
    _CACHE = os.path.join(_SESSION_TMP, "cache")
    os.makedirs(_CACHE)
    shutil.copy(os.path.join(_HERE, os.pardir, "benchmarks", "data", "cpu.json"), _CACHE)
    os.environ[_SHARED_CACHE] = _CACHE
os.environ["SLAPO_TUNE_CACHE"] = _CACHE

# Helpers every kind shares (_helpers, _fault_templates) live in this folder, the rank functions
# beside the tests that launch them (multirank/, e2e/): all on the path now, before the rank fork
# server starts (it keeps the path it starts with), so that spawned ranks import them by name
# whichever test, of whatever kind, launched them first.
_SUPPORT = (_HERE, os.path.join(_HERE, "multirank"), os.path.join(_HERE, "e2e"))
sys.path[:0] = _SUPPORT


# The slowest files first, longest first (each file alone on an idle 2-core machine: from 146 s for
# test_search down to 12 s; the files not named take less), so that the two xdist workers, which
# take whole files in this order, finish at about the same time. (xdist's own order, the files of
# most tests first, is turned off in pytest_configure.)
_SLOWEST_FIRST = ("test_search.py", "test_ray_runner.py", "test_train.py", "test_templates_verify.py",
                  "test_cost_model.py", "test_faults.py", "test_tune.py", "test_signals.py", "test_gpu_check.py", "test_zero.py",
                  "test_postgres.py", "test_shared_study.py", "test_cost_model_techniques.py", "test_time_model.py",
                  "test_sequence_parallel.py", "test_tensor_parallel.py", "test_launch.py", "test_runners.py",
                  "test_selective_checkpoint.py", "test_parallel_3d.py", "test_user_space.py", "test_interleaved.py",
                  "test_paper_tables.py", "test_probe_precision.py", "test_plan_speed.py", "test_what_a_user_sees.py",
                  "test_cli.py", "test_device.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


def pytest_configure(config):
    # --dist loadfile deals the files out by their number of tests, most first, unless told not to:
    # a long file of few tests (a Ray cluster's, the GPU check's one) then started last and ran alone
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems above
    # The multiprocessing resource tracker is a long-lived helper of this process, started by the
    # first spawned rank; start it now so that it never counts as a process left behind by a test.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry))
    except FileNotFoundError:  # pragma: no cover - not Linux
        pass
    return found


@pytest.fixture
def no_leftover_children():
    """Fails the test if it leaves a child process of the test runner behind."""
    before = _children(os.getpid())
    yield
    # the rank fork server lives as long as this process, to start the next test's ranks
    before.add(multiprocessing.forkserver._forkserver._forkserver_pid)
    import time

    deadline = time.monotonic() + 5
    left = _children(os.getpid()) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if os.path.exists(f"/proc/{p}")} - before
    assert not left, f"child processes left behind: {sorted(left)}"


@pytest.fixture
def fake_group():
    """An in-process 'fake' process group of 2 ranks: shapes and errors, no communication."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int = 0, world_size: int = 2):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    init()
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_cluster():
    """A two-node local Ray cluster (2 logical CPUs each, dashboard on 127.0.0.1) with token
    authentication (the token in its HOME's ~/.ray/auth_token), as Ray 2.60 clusters run, for
    the tests of one file: its own temp dir and HOME, shut down after the file's last test (not
    at the end of the session: idle, its nodes still took 7 % of a core from the files after it).
    Its health checks declare a dead node in about 10 s (Ray's default: about 30 s)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    ray_tmp = os.path.join(_SESSION_TMP, "r")
    os.makedirs(os.path.join(ray_tmp, "ray"), exist_ok=True)  # Cluster() expects it under RAY_TMPDIR
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "HOME", "RAY_AUTH_MODE")}
    os.environ.update(RAY_TMPDIR=ray_tmp, HOME=ray_tmp, RAY_AUTH_MODE="token")
    from runners.ray_cluster import _free_port, ensure_auth_token

    ensure_auth_token()  # the nodes and every client of the session read it
    # this process imported Ray already: its cached configuration re-read, so that it sends the token
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()
    # free ports for the dashboard and each node's dashboard agent: fixed ones (8265, 52365) are
    # taken while another Ray runs on this machine (a head without its agent takes no Ray Jobs)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": _free_port(),
        "dashboard_agent_listen_port": _free_port(),
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 10}})
    cluster.add_node(num_cpus=2, dashboard_agent_listen_port=_free_port())
    cluster.wait_for_nodes()
    # workers import test helpers (fault-injecting templates) from this folder, as ranks do locally
    ray.init(address=cluster.address, namespace="slapo-tune-tests", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_SUPPORT)}})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Postgres:
    """A running PostgreSQL server: the role ``tuner`` logs in with ``password`` (scram-sha-256);
    the superuser ``postgres`` is trusted over the server's socket, for set-up only."""

    socket_dir: str
    password: str
    superuser_url: str

    def url(self, database: str, password: str | None = None) -> str:
        """A storage URL of ``database`` as the README writes it (the password URL-encoded)."""
        return f"postgresql://tuner:{quote(password or self.password, safe='')}@/{database}?host={self.socket_dir}"

    def create_database(self, name: str) -> str:
        """A new empty database owned by ``tuner``; returns its URL."""
        import psycopg

        with psycopg.connect(self.superuser_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" OWNER tuner')
        return self.url(name)


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for this test session (pgserver: its own binaries, no root needed;
    as root they run as a user of their own), its data and Unix socket in the session's temp dir,
    no TCP port; stopped by its postmaster's PID at the end and its data removed."""
    # pgserver keeps a lock in the runtime dir it reads at import: this session's, not the user's
    os.environ["XDG_RUNTIME_DIR"] = os.path.join(_SESSION_TMP, "run")
    os.makedirs(os.environ["XDG_RUNTIME_DIR"], mode=0o700, exist_ok=True)
    import atexit
    import secrets

    import pgserver
    import psycopg

    data = os.path.join(_SESSION_TMP, "pg")
    os.makedirs(data)
    server = pgserver.get_server(data, cleanup_mode=None)  # stopped here, by PID, not at exit
    pid = server.get_pid()
    try:
        # characters a URL must encode ('/', '@'), so redaction is tested on both forms
        password = f"pw-{secrets.token_hex(8)}/@x"
        superuser = server.get_uri()
        with psycopg.connect(superuser, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE tuner LOGIN PASSWORD '{password}'")
            with open(os.path.join(data, "pg_hba.conf"), "w") as f:  # the superuser alone is trusted
                f.write("local all postgres trust\nlocal all all scram-sha-256\n")
            conn.execute("SELECT pg_reload_conf()")
        socket_dir = parse_qs(urlsplit(superuser).query)["host"][0]
        yield Postgres(socket_dir=socket_dir, password=password, superuser_url=superuser)
    finally:
        _stop_by_pid(pid)
        atexit.unregister(server._cleanup)  # pgserver's own exit hook: nothing left for it to stop
        shutil.rmtree(data, ignore_errors=True)


def _stop_by_pid(pid: int, grace: float = 30.0) -> None:
    """SIGQUIT (PostgreSQL's immediate shutdown: its data is thrown away next, so nothing is
    flushed), SIGKILL after ``grace``."""
    try:
        os.kill(pid, signal.SIGQUIT)
    except ProcessLookupError:
        return
    from runners.ray_cluster import _alive  # (a zombie left to a parent that does not reap is not)

    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
