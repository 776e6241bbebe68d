"""Trials on a Ray cluster: one actor per rank, in a placement group, so a trial can span nodes.

Each trial gets fresh actors (a crashed or poisoned rank never carries over into the next trial)
in a placement group of ``world_size`` bundles: GPU bundles when the trial runs on CUDA,
(fractional) CPU bundles otherwise. Rank 0 hosts the rendezvous store on a port its OS picks, at
its node's address (listening there only: the loopback under a local head); gloo and NCCL use the
network interface that holds that address. Where GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name an
interface (``tune --net-if``), the store listens at that interface's address and gloo and NCCL
use it. The store has no authentication of its own: on an attached cluster, whoever reaches that
address and port can join a trial's rendezvous while it lasts. Actors are named after
the trial and its knobs, so the Ray dashboard shows what runs. On the first failure, or when the
time limit passes, every actor is killed and the group removed, which frees the bundles at once.
Each result names the node and device of every rank (``TrialResult.nodes``). After a trial lost a
node, the next is sized from the nodes the cluster still has (once Ray has declared the lost one
dead), not from the CPUs it had.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from typing import Any

from slapo_tune.device import NCCL_ENV, collective_timeout, default_concurrency, device_setup
from slapo_tune.errors import UsageError
from slapo_tune.launch import (
    FAILURE_GRACE,
    INTERFACE_VARIABLES,
    RankContext,
    RankFailure,
    describe_exception,
    first_failure,
    is_peer_error,
)
from slapo_tune.plan import TrialStatus, short_name

from ._base import Runner
from .trial import TrialSpec, trial_rank

# how long the other ranks are heard after a rank failed with only a peer's error: Ray's health
# checks declare a node dead after about 30 s (a rank that simply died is reported in a second)
LOST_RANK_GRACE = 60.0
# how long, after a trial lost a node, the runner waits for Ray to declare that node dead before it
# sizes the next trial's bundles (Ray's health checks take about 30 s)
NODE_DEATH_WAIT = 60.0


def host_interfaces() -> dict[str, list[str]]:
    """This host's network interfaces: name -> IP addresses (by psutil, which Ray ships)."""
    import psutil

    return {name: [a.address for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addresses in psutil.net_if_addrs().items()}


def rendezvous_interface(ip: str, interfaces: dict[str, list[str]] | None = None) -> str | None:
    """The network interface holding address ``ip`` (the node's Ray address), for gloo and NCCL:
    on a host with several interfaces they would otherwise take the one the hostname resolves to,
    which the other nodes may not reach. ``interfaces``: name -> addresses (default:
    :func:`host_interfaces`). None when no interface holds it."""
    interfaces = host_interfaces() if interfaces is None else interfaces
    return next((name for name, addresses in interfaces.items() if ip in addresses), None)


def named_interface(environ=os.environ) -> str | None:
    """The interface GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names (``tune --net-if``, or the
    user's), if any."""
    return next((environ[v] for v in INTERFACE_VARIABLES if environ.get(v)), None)


def store_address(node_ip: str, environ=os.environ, interfaces: dict[str, list[str]] | None = None) -> str:
    """Where rank 0's rendezvous store listens: ``node_ip`` (the node's Ray address) unless an
    interface is named (:func:`named_interface`); then ``node_ip`` if that interface holds it, else
    its first IPv4 address, else its first IPv6 one (a link-local one needs a scope the other nodes
    cannot know). A named interface without such an address on this node: ``node_ip`` (gloo or
    NCCL then fails the trial, naming the interface)."""
    named = named_interface(environ)
    if not named:
        return node_ip
    interfaces = host_interfaces() if interfaces is None else interfaces
    addresses = [a for a in interfaces.get(named, []) if not ipaddress.ip_address(a.split("%")[0]).is_link_local]
    if not addresses or node_ip in addresses:
        return node_ip
    return sorted(addresses, key=lambda a: ":" in a)[0]  # IPv4 first


def choose_interface(ip: str, environ=os.environ, interfaces: dict[str, list[str]] | None = None) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (where unset) in ``environ`` to the interface
    holding ``ip``; one already set (``tune --net-if``, or the user's) wins for both. Returns the
    interface used (None: left to gloo and NCCL)."""
    chosen = named_interface(environ) or rendezvous_interface(ip, interfaces)
    for variable in INTERFACE_VARIABLES:
        if chosen and not environ.get(variable):
            environ[variable] = chosen
    return chosen


def actor_name(spec: TrialSpec, point: dict[str, Any], rank: int) -> str:
    """``trial-17 tp=2 pp=1 dp=2 zero=0 mb=4 ckpt=0.5 ... rank 0``: readable in the dashboard."""
    return f"{spec.name} {short_name(point)} rank {rank}"


class _RankActor:
    """One rank of one trial (a Ray actor: ``ray.remote`` is applied lazily, Ray being optional
    for local use)."""

    def __init__(self, rank: int, world_size: int, threads: int):
        import torch

        self.rank, self.world_size = rank, world_size
        os.environ.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                           "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")})
        torch.set_num_threads(threads)
        self._store = None

    def host_store(self) -> tuple[str, int]:
        """Rank 0: start the rendezvous store on a free port; return where the others find it."""
        from datetime import timedelta

        import ray
        import torch.distributed as dist

        # a TCPStore given a host still listens on every interface: it is handed a socket bound to
        # one address instead (:func:`store_address`: the loopback under a local head)
        host = store_address(ray.util.get_node_ip_address())
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._store = dist.TCPStore(host, listener.getsockname()[1], self.world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=300),
                                    master_listen_fd=listener.detach())  # the store's socket from now on
        return host, self._store.port

    def placement(self) -> tuple[str, str]:
        """(node id, ``ADDRESS/NODE:DEVICE``): where this rank runs, as trials.csv records it."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        gpus = ray.get_gpu_ids()
        device = f"gpu{gpus[0]}" if gpus else "cpu"
        return node, f"{ray.util.get_node_ip_address()}/{node[:8]}:{device}"

    def run(self, host: str, port: int, spec: TrialSpec, point: dict[str, Any], timeout: float):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        try:
            import ray

            choose_interface(ray.util.get_node_ip_address())  # this node's address: what the other nodes reach
            setup = device_setup(spec.device)  # on this actor's node: a GPU bundle's node has CUDA
            device = setup.rank_device()  # Ray shows the actor only its own GPU: cuda:0
            collectives = timeout
            if setup.cuda:
                torch.cuda.set_device(device)
                os.environ.update(NCCL_ENV)  # read when the process group is made, below
                collectives = collective_timeout(timeout)  # a hung collective ends the actor, via NCCL's watchdog
            store = self._store or dist.TCPStore(host, port, self.world_size, is_master=False,
                                                 timeout=timedelta(seconds=timeout))
            dist.init_process_group(setup.backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=collectives))
            result = trial_rank(RankContext(self.rank, self.world_size, device), spec, point)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver as the trial's failure
            # no teardown after a failure (NCCL's can wait for the peers' pending collectives and
            # hold the report back): the runner kills this actor
            return ("error", *describe_exception(exc), time.time())
        with contextlib.suppress(Exception):  # measured already; a teardown error changes nothing
            dist.destroy_process_group()
        return ("ok", result)


class RayRunner(Runner):
    """Runs each trial as ``world_size`` rank actors on a Ray cluster.

    Connects to ``address`` (``None``: the cluster this process is already connected to, else a
    new local one). ``cpus_per_rank``: CPU share of each rank's bundle (default: on CPU the
    cluster's CPUs divided among ``concurrency`` trials of this world size, at most 1; fractional
    shares let a small cluster run wide trials. On CUDA, where each rank's bundle also holds one
    GPU, the cluster's CPUs divided among the ranks of the trials its GPUs hold, and no more than a
    GPU node's CPUs per GPU, so that every GPU can be placed). Placement ``strategy`` ``PACK`` fills
    nodes first and spills over, ``SPREAD`` spreads the ranks.
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, cpus_per_rank: float | None = None, concurrency: int = 1,
                 strategy: str = "PACK", namespace: str = "slapo-tune", placement_timeout: float = 60.0):
        import ray

        if not ray.is_initialized():
            try:
                ray.init(address=address, namespace=namespace, log_to_driver=False)
            except ConnectionError as exc:
                raise UsageError(f"cannot reach the Ray cluster at {address}: {exc}") from None
        self.cpus_per_rank, self.concurrency = cpus_per_rank, max(1, concurrency)
        self.strategy, self.namespace, self.placement_timeout = strategy, namespace, placement_timeout
        self._actor_class = ray.remote(_RankActor)
        self._live: set = set()
        self._placed: dict[str, list[tuple[str, str]]] = {}  # trial name -> each rank's (node id, place)

    def run(self, spec: TrialSpec):
        """The base runner's trial, with the node and device of every rank it placed; after a
        lost node, first waits for Ray to declare it dead (the next trial is sized without it)."""
        result = super().run(spec)
        placed = self._placed.pop(spec.name, [])
        result.nodes = [place for _, place in placed]
        if result.status == TrialStatus.LOST and placed:
            self._await_dead({node for node, _ in placed})
        return result

    def _await_dead(self, nodes: set[str]) -> None:
        """Wait (up to NODE_DEATH_WAIT) until one of ``nodes`` is no longer alive in Ray's view."""
        import ray

        deadline = time.monotonic() + NODE_DEATH_WAIT
        while time.monotonic() < deadline:
            if any(not n.get("Alive", True) for n in ray.nodes() if n.get("NodeID") in nodes):
                return
            time.sleep(0.5)

    def cancel(self) -> None:
        import ray

        for actor in list(self._live):
            ray.kill(actor, no_restart=True)

    def _bundle(self, spec: TrialSpec) -> dict[str, float]:
        import ray

        cuda = device_setup(spec.device, here=False).cuda  # the driver needs no GPU of its own
        cpus = self.cpus_per_rank
        if cpus is None:
            resources = _alive_resources(ray)
            total = resources.get("CPU", 1.0)
            if cuda:
                trials = default_concurrency("cuda", spec.world_size, int(resources.get("GPU", 0)))
                ranks = trials * spec.world_size
                cpus = _placeable_share(ray, ranks, total / ranks)
                cpus = float(int(cpus)) if cpus >= 1 else round(cpus, 4)  # whole threads; Ray's 1e-4 units
            else:
                cpus = min(1.0, total / (spec.world_size * self.concurrency))
        bundle = {"CPU": cpus}
        if cuda:
            bundle["GPU"] = 1.0
        return bundle

    def _execute(self, spec: TrialSpec, point: dict[str, Any]) -> list[dict[str, Any]]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        deadline = time.monotonic() + spec.time_limit
        bundle = self._bundle(spec)
        group = placement_group([dict(bundle) for _ in range(spec.world_size)], strategy=self.strategy,
                                name=spec.name)
        actors = []
        try:
            try:
                ray.get(group.ready(), timeout=min(self.placement_timeout, spec.time_limit))
            except GetTimeoutError:
                raise RankFailure(f"the cluster cannot place {spec.world_size} bundles of {bundle} "
                                  f"within {min(self.placement_timeout, spec.time_limit):.0f} s",
                                  kind=TrialStatus.PLACEMENT_TIMEOUT.value) from None
            threads = max(1, int(bundle["CPU"]))
            for rank in range(spec.world_size):
                actors.append(self._actor_class.options(
                    name=actor_name(spec, point, rank), namespace=self.namespace, max_restarts=0,
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
                ).remote(rank, spec.world_size, threads))
                self._live.add(actors[-1])
            refs = {}
            try:
                host, port = ray.get(actors[0].host_store.remote(), timeout=max(1.0, deadline - time.monotonic()))
                self._placed[spec.name] = ray.get([a.placement.remote() for a in actors],
                                                  timeout=max(1.0, deadline - time.monotonic()))
                refs = {a.run.remote(host, port, spec, point, spec.time_limit): rank for rank, a in enumerate(actors)}
            except GetTimeoutError:
                raise RankFailure(f"timed out after {spec.time_limit:.0f} s starting the rank actors",
                                  kind="timeout") from None
            except RayActorError as exc:  # before any of the schedule ran: the cluster's failure
                raise RankFailure(f"a rank actor died while starting: {_reason(exc)}",
                                  kind=TrialStatus.LOST.value) from None
            return self._collect(refs, deadline, spec.time_limit)
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)
                self._live.discard(actor)
            remove_placement_group(group)

    @staticmethod
    def _collect(refs: dict, deadline: float, limit: float, ray=None) -> list[dict[str, Any]]:
        """The ranks' reports by rank, or the RankFailure naming the trial's cause (``ray``: the
        module, or a stand-in for tests). Once a rank failed, the others are heard for
        FAILURE_GRACE; while every failure so far is a peer's error (a rank whose collective lost
        its partner), for LOST_RANK_GRACE: Ray reports a rank whose node died only when its health
        checks give up, well after the peers' "connection closed"."""
        if ray is None:
            import ray

        results: dict[int, Any] = {}
        failures: list[RankFailure] = []
        pending = list(refs)
        grace_end = first_at = None
        while pending:
            if failures:
                own = any(not is_peer_error(f) for f in failures)
                grace_end = first_at + (FAILURE_GRACE if own else LOST_RANK_GRACE)
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if now >= deadline:
                if failures:
                    break
                ranks = sorted(refs[r] for r in pending)
                raise RankFailure(f"timed out after {limit:.0f} s waiting for rank(s) {ranks}", rank=ranks[0],
                                  kind="timeout")
            until = min(deadline, grace_end) if grace_end is not None else deadline
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, until - now))
            for ref in ready:
                outcome = _outcome(ray, ref, refs[ref])
                if isinstance(outcome, RankFailure):
                    failures.append(outcome)
                    first_at = first_at or time.monotonic()
                else:
                    results[refs[ref]] = outcome
        if failures:
            raise first_failure(failures)
        return [results[i] for i in range(len(refs))]


def _outcome(ray, ref, rank: int):
    """A rank's report, or the RankFailure it amounts to."""
    from ray.exceptions import RayActorError

    try:
        message = ray.get(ref)
    except RayActorError as exc:  # its process died (the schedule's crash), or its node is gone
        if node_lost(exc):
            return RankFailure(f"rank {rank} lost: {_reason(exc)}", rank=rank, kind=TrialStatus.LOST.value)
        return RankFailure(f"rank {rank} died: {_first_line(exc)}", rank=rank)
    if message[0] == "error":
        _, exc_type, text, details, when = message
        failure = RankFailure(f"rank {rank} raised {exc_type}: {text}", rank=rank, exc_type=exc_type, details=details)
        failure.when = when
        return failure
    return message[1]


def _alive_resources(ray) -> dict[str, float]:
    """The resources of the nodes Ray holds alive (``ray.cluster_resources()`` may still count a
    node that died a moment ago)."""
    total: dict[str, float] = {}
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive", True)]
    except Exception:  # noqa: BLE001 - a cluster that cannot list its nodes: its own total
        return ray.cluster_resources()
    for node in nodes:
        for name, amount in node.get("Resources", {}).items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _placeable_share(ray, ranks: int, share: float) -> float:
    """The largest CPU share of at most ``share`` per GPU bundle with which the cluster's GPU nodes
    hold ``ranks`` bundles: a bundle must fit on one node, so the cluster's CPUs over the ranks can
    ask more of a node than it has per GPU (nodes of 32 CPUs and 2 GPUs hold one bundle of 24)."""
    try:
        nodes = [(n["Resources"].get("CPU", 0.0), int(n["Resources"].get("GPU", 0)))
                 for n in ray.nodes() if n.get("Alive", True)]
    except Exception:  # noqa: BLE001 - a cluster that cannot list its nodes: the share as it is
        return share
    nodes = [(c, g) for c, g in nodes if g > 0]

    def held(s: float) -> int:
        return sum(min(g, int(c / s + 1e-9)) for c, g in nodes)

    # the share changes what a node holds only at its CPUs over a whole number of bundles
    for candidate in sorted({share} | {c / k for c, g in nodes for k in range(1, g + 1)}, reverse=True):
        if candidate <= share and held(candidate) >= ranks:
            return candidate
    return share  # no GPU node listed: nothing to check against


def node_lost(exc: BaseException) -> bool:
    """Whether a rank actor's death is its node's (died, preempted, unreachable: the cluster's
    failure) rather than its own process's (killed, crashed: the schedule's)."""
    from ray.exceptions import ActorUnavailableError

    return (isinstance(exc, ActorUnavailableError) or bool(getattr(exc, "preempted", False))
            or "its node has died" in str(exc))  # GCS's words for an actor on a dead node


def _reason(exc: BaseException) -> str:
    """The line of a Ray error that says why (a node's death is not on its first line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "node" in line.lower() and "died" in line.lower()), _first_line(exc))


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
