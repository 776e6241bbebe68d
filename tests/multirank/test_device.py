"""Where ranks run (slapo_tune.device): the device kind apart from the cost model's hardware, one GPU
per rank, trials in flight by GPUs, the default budget on a GPU, out-of-memory errors by rank.

No GPU here: CUDA's presence is faked (torch.cuda's queries, the process group) up to where a
kernel would run, and the launcher's ranks are captured as they would start."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from multiprocessing import get_context
from types import SimpleNamespace

import pytest
import torch

from slapo_tune import device as device_module
from slapo_tune.cli import EXIT_NO_RESULT, main
from slapo_tune.cost_model import detect_hardware, hardware_for
from slapo_tune.device import DeviceSetup, GiB, collective_timeout, cuda_reserve, device_setup
from slapo_tune.errors import UsageError

import _device_workers as w

H100 = ("NVIDIA H100 80GB HBM3", 80 * GiB)
H200 = ("NVIDIA H200", 141 * GiB)


@pytest.fixture
def fake_cuda(monkeypatch):
    """``fake_cuda(n, (name, memory))``: torch sees ``n`` such GPUs (and no CUDA_VISIBLE_DEVICES)."""

    def install(count: int = 8, gpu=H100) -> None:
        name, memory = gpu
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(name=name, total_memory=memory))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return install


# ---------------------------------------------------------------------------- the command line
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tune_on_cuda_without_cuda_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "slapo_tune.cli", "tune", "--device", "cuda", "--ray-address", "none"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "slapo-tune: error: --device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
        "use --device cpu"]


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "llama-7b", "--world-size", "8", "--memory-budget", "80GiB", "--device", "a100-80gb"],
     "--device a100-80gb is a hardware preset: use --hardware a100-80gb (--device is where ranks run: cpu or cuda)"),
    (["plan", "--model", "llama-7b", "--world-size", "8", "--memory-budget", "80GiB", "--hardware", "tpu-v9"],
     "unknown hardware 'tpu-v9' (choose from cpu, a100-80gb"),
    (["tune", "--device", "h200"], "use --hardware h200"),
    (["tune", "--device", "gpu"], "unknown device 'gpu': --device is where ranks run (cpu or cuda)"),
    (["verify", "--model", "gpt2-tiny", "--world-size", "2", "--device", "cuda"], "--device cuda: torch sees no CUDA"),
])
def test_device_and_hardware_are_apart_on_the_command_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_plan_hardware_follows_the_visible_gpu_and_is_a100_without_one(capsys, monkeypatch, fake_cuda):
    import json

    argv = ["plan", "--model", "llama-7b", "--world-size", "8", "--memory-budget", "80GiB", "--top", "1", "--json"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 0
    without = json.loads(capsys.readouterr().out)
    assert (without["device"], without["hardware"], without["precision"]) == ("cuda", "a100-80gb", "bf16")
    fake_cuda(1, H200)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["hardware"] == "h200"


def test_tune_defaults_on_cuda(capsys, monkeypatch, fake_cuda, tmp_path):
    """``tune`` with CUDA present and nothing said: ranks on cuda, bf16, the GPU's preset for the
    cost model, the GPU's memory less the reserve as the budget, GPUs // world trials in flight."""
    import slapo_tune.cli.tune as tune_command

    fake_cuda(8, H200)
    seen = {}

    class Tuner:  # stands in for the driver: what the command would tune with, and nothing run
        def __init__(self, config, runner, **_):
            seen.update(config=config, runner=runner)
            self.study = SimpleNamespace(study_name="s", user_attrs={}, get_trials=lambda **_: [])

        def run(self):
            return {"stop": "trials", "launched": 0, "pruned": 0, "failed": 0, "infrastructure": 0, "duplicates": 0,
                    "best_point": None, "confirmed": None, "elapsed": 0.0}

    monkeypatch.setattr(tune_command, "Tuner", Tuner)
    # (the stand-in measures nothing: the command's code for a study without a result)
    assert main(["tune", "--world-size", "4", "--ray-address", "none", "--out", str(tmp_path / "o")]) == EXIT_NO_RESULT
    config = seen["config"]
    expected = 141 * GiB - cuda_reserve(141 * GiB)
    assert config.problem.device == "cuda" and config.problem.precision == "bf16" and config.hardware == "h200"
    assert config.problem.memory_budget == expected == 141 * GiB - 2 * GiB - int(0.05 * 141 * GiB)
    assert config.concurrency == seen["runner"].concurrency == 2
    assert seen["runner"].gpu_pool().items == [str(i) for i in range(8)]
    err = capsys.readouterr().err
    assert "4 NVIDIA H200 rank(s), one GPU each, bf16" in err and "hardware h200 (detected: NVIDIA H200" in err
    assert "reserved" in err and "2 in flight" in err
    # a budget given is taken as given; a world larger than the GPUs stops before anything starts
    assert main(["tune", "--world-size", "2", "--ray-address", "none", "--memory-budget", "1GiB",
                 "--out", str(tmp_path / "p")]) == EXIT_NO_RESULT
    assert seen["config"].problem.memory_budget == GiB and seen["config"].concurrency == 4
    assert main(["tune", "--world-size", "16", "--global-batch", "16", "--ray-address", "none",
                 "--out", str(tmp_path / "q")]) == 2
    assert "world size 16 needs 16 GPUs (one per rank) but 8 are available" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the decision
def test_device_setup_decides_kind_backend_and_count(monkeypatch, fake_cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = device_setup(None)
    assert (cpu.kind, cpu.backend, cpu.count, cpu.gpus) == ("cpu", "gloo", len(os.sched_getaffinity(0)), ())
    assert cpu.default_memory_budget() is None and cpu.rank_device() == "cpu"
    with pytest.raises(UsageError, match="use --device cpu"):
        device_setup("cuda")
    assert device_setup("cuda", here=False).count == 0  # ranks elsewhere (a Ray cluster): taken as asked
    fake_cuda(8, H100)
    gpu = device_setup(None)
    assert (gpu.kind, gpu.backend, gpu.count, gpu.name) == ("cuda", "nccl", 8, "NVIDIA H100 80GB HBM3")
    assert gpu.gpu_ids == [str(i) for i in range(8)] and device_setup("cpu").backend == "gloo"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0,1,2,3")
    assert device_setup("cuda").gpu_ids == ["4", "5", "6", "7", "0", "1", "2", "3"]  # as this process names them


@pytest.mark.parametrize("gpus,world,expected", [(8, 4, 2), (8, 3, 2), (8, 8, 1), (8, 1, 8), (1, 1, 1),
                                                 (8, 16, None), (1, 2, None)])
def test_trials_in_flight_are_gpus_over_world(fake_cuda, gpus, world, expected):
    from runners.ray_cluster import connect

    fake_cuda(gpus)
    setup = device_setup("cuda")
    if expected is None:
        with pytest.raises(UsageError, match=f"world size {world} needs {world} GPUs"):
            setup.concurrency(world)
        with pytest.raises(UsageError, match="lower --world-size or use --device cpu"):
            connect("none", None, world, None, device=setup)
        return
    assert setup.concurrency(world) == expected
    assert connect("none", None, world, None, device=setup).runner.concurrency == expected
    assert connect("none", None, world, 1, device=setup).runner.concurrency == 1  # as asked


def test_cpu_concurrency_stays_cores_over_world():
    cores = len(os.sched_getaffinity(0))
    setup = device_setup("cpu")
    assert [setup.concurrency(w) for w in (1, 2, cores * 4)] == [cores, max(1, cores // 2), 1]


def test_ray_fit_counts_the_clusters_gpus(monkeypatch):
    ray = pytest.importorskip("ray")
    from runners.ray_cluster import _fit

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 96.0, "GPU": 8.0})
    cuda = device_setup("cuda", here=False)  # the driver needs no GPU of its own
    assert [_fit(None, w, cuda) for w in (4, 3, 8)] == [2, 2, 1]
    assert _fit(None, 4, device_setup("cpu")) == 24  # cores as before
    with pytest.raises(UsageError, match="world size 16 needs 16 GPUs"):
        _fit(None, 16, cuda)


@pytest.mark.parametrize("nodes,world,device,bundle", [
    ([(96, 8)], 4, "cuda", {"CPU": 12.0, "GPU": 1.0}),  # 2 trials of 4 ranks on 8 GPUs share 96 CPUs
    ([(96, 8)], 3, "cuda", {"CPU": 16.0, "GPU": 1.0}),  # 2 trials of 3 ranks: 6 GPUs in use
    ([(32, 2)] * 3, 4, "cuda", {"CPU": 16.0, "GPU": 1.0}),  # 96 / 4 = 24 would place 3: a node's share instead
    ([(40, 4), (8, 4)], 4, "cuda", {"CPU": 2.0, "GPU": 1.0}),  # uneven nodes: 8 ranks fit at 2 CPUs each
    ([(4, 8)], 2, "cuda", {"CPU": 0.5, "GPU": 1.0}),  # fewer CPUs than GPUs: fractional shares
    ([(96, 8)], 4, "cpu", {"CPU": 1.0}),  # CPU trials: no GPU asked for
])
def test_ray_bundles_hold_one_gpu_per_rank(monkeypatch, nodes, world, device, bundle):
    ray = pytest.importorskip("ray")
    from runners.ray_runner import RayRunner
    from runners.trial import TrialSpec
    from slapo_tune.problem import ProblemSpec

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": float(sum(c for c, _ in nodes)),
                                                           "GPU": float(sum(g for _, g in nodes))})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": float(c), "GPU": float(g)}}
                                               for c, g in nodes])
    runner = object.__new__(RayRunner)  # no cluster started: only the bundle is computed
    runner.cpus_per_rank, runner.concurrency = None, 2
    spec = TrialSpec(ProblemSpec("gpt2-tiny", world, device=device), {})
    assert runner._bundle(spec) == bundle


# ---------------------------------------------------------------------------- one GPU per rank
class _CapturedProcess:
    """Stands in for a rank's process: records, at start, the backend and the environment a spawned
    child would inherit, and reports them as the rank's result."""

    started: list = []

    def __init__(self, target, args, name):
        self.args, self.name = args, name
        self.pid, self.exitcode = os.getpid(), 0
        self._r, w_ = os.pipe()
        os.close(w_)
        self.sentinel = self._r  # readable at once: the process "ended"

    def start(self):
        rank, backend, conn, env = self.args[1], self.args[4], self.args[6], self.args[8]
        inherited = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
        _CapturedProcess.started.append(rank)
        conn.send(("ok", rank, {"backend": backend, "inherited": inherited, "env": env}))
        conn.close()

    def is_alive(self):
        return False

    def join(self, timeout=None):
        if self._r is not None:
            os.close(self._r)
            self._r = None

    def kill(self):
        pass


def _capture_ranks(monkeypatch):
    import slapo_tune.launch as launch_module

    real = get_context("spawn")
    # nccl ranks are spawned (each must see only its own GPU before CUDA is first asked)
    assert launch_module._start_method("nccl", w.report_device).get_start_method() == "spawn"
    monkeypatch.setattr(launch_module, "_start_method",
                        lambda backend, fn: SimpleNamespace(Pipe=real.Pipe, Process=_CapturedProcess))


def test_launcher_gives_each_rank_its_own_gpu_on_nccl(monkeypatch, fake_cuda):
    from slapo_tune.launch import default_backend, launch

    fake_cuda(8)
    _capture_ranks(monkeypatch)
    assert default_backend(4) == "nccl" and default_backend(16) == "gloo"  # the library's fallback
    ranks = launch(w.report_device, 4, timeout=30)
    assert [r["backend"] for r in ranks] == ["nccl"] * 4
    assert [r["inherited"]["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["0", "1", "2", "3"]
    assert all(r["inherited"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" for r in ranks)
    assert all(r["env"]["CUDA_VISIBLE_DEVICES"] == r["inherited"]["CUDA_VISIBLE_DEVICES"] for r in ranks)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the launcher's own environment is left as it was
    ranks = launch(w.report_device, 2, timeout=30, gpus=["6", "GPU-5e1f"])  # a runner's pool hands out GPUs
    assert [r["inherited"]["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["6", "GPU-5e1f"]
    cpu = launch(w.report_device, 2, timeout=30, backend="gloo")
    assert [r["backend"] for r in cpu] == ["gloo"] * 2 and all(r["inherited"]["CUDA_VISIBLE_DEVICES"] is None
                                                                for r in cpu)
    with pytest.raises(UsageError, match="world size 3 needs 3 GPUs"):
        launch(w.report_device, 3, timeout=30, backend="nccl", gpus=["0", "1"])


def test_a_launched_nccl_rank_uses_cuda_0_and_a_collective_timeout():
    """A real rank process (CUDA and the process group faked inside it): its GPU is cuda:0 (the only
    one it sees), its process group is nccl with a timeout shorter than the trial's limit."""
    ctx = get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=w.rank_with_fake_cuda, args=(writer, 300.0))
    proc.start()
    try:
        assert reader.poll(60), "the rank did not report"
        got = reader.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert got["set_device"] == "cuda:0" and got["backend"] == "nccl"
    assert got["pg_timeout"] == collective_timeout(300.0) == 150.0 < 300.0
    assert got["message"][:2] == ("ok", 1) and got["message"][2] == {"device": "cuda:0", "rank": 1}
    assert got["destroyed"]  # torn down after reporting


def test_concurrent_local_trials_get_disjoint_gpus(monkeypatch, fake_cuda):
    import runners.local as local
    from runners import LocalRunner
    from runners.trial import TrialSpec
    from slapo_tune.problem import ProblemSpec

    fake_cuda(8)
    got, lock = [], threading.Lock()

    def fake_launch(fn, world_size, args=(), **kw):
        with lock:
            got.append((kw["backend"], list(kw["gpus"])))
        time.sleep(0.3)  # both trials hold their GPUs at once
        return []

    monkeypatch.setattr(local, "launch", fake_launch)
    runner = LocalRunner.for_device(device_setup("cuda"), 4)
    spec = TrialSpec(ProblemSpec("gpt2-tiny", 4, device="cuda"), {})
    threads = [threading.Thread(target=runner._execute, args=(spec, {})) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert runner.concurrency == 2 and [b for b, _ in got] == ["nccl", "nccl"]
    first, second = (set(g) for _, g in got)
    assert len(first) == len(second) == 4 and not first & second
    assert runner.gpu_pool()._free == [str(i) for i in range(8)]  # all given back
    with pytest.raises(UsageError, match="world size 9 needs 9 GPUs"):
        runner._execute(TrialSpec(ProblemSpec("gpt2-tiny", 9, device="cuda"), {}), {})


# ---------------------------------------------------------------------------- hardware and budget
@pytest.mark.parametrize("name,memory,preset,how", [
    ("NVIDIA H100 80GB HBM3", 80 * GiB, "h100-80gb", "detected"),
    ("NVIDIA H100", int(94.5 * GiB), "h100-96gb", "detected"),  # torchtitan's 96 GB, 500 W part
    ("NVIDIA H200", 141 * GiB, "h200", "detected"),
    ("NVIDIA A100-SXM4-40GB", int(39.4 * GiB), "a100-40gb", "detected"),
    ("NVIDIA A100-SXM4-80GB", int(79.1 * GiB), "a100-80gb", "detected"),
    ("Tesla V100-SXM2-32GB", int(31.7 * GiB), "v100-32gb", "detected"),
    ("NVIDIA L40S", int(44.5 * GiB), "a100-40gb", "fallback"),  # unknown: the preset closest in memory
    ("NVIDIA GeForce RTX 4090", int(23.6 * GiB), "v100-32gb", "fallback"),
])
def test_hardware_is_detected_from_the_gpus_name_and_memory(name, memory, preset, how):
    hw, line = detect_hardware(name, memory)
    assert hw.name == preset and hw.memory == memory
    assert line.startswith(f"hardware {preset} ({how}: {name}")
    if how == "fallback":
        assert "matches no preset" in line and "--hardware" in line


def test_hardware_of_a_device_setup(fake_cuda):
    assert hardware_for(device_setup("cpu"))[0].name == "cpu"
    fake_cuda(2, H200)
    assert hardware_for(device_setup("cuda"))[0].name == "h200"
    with pytest.raises(UsageError, match="give --hardware"):
        hardware_for(dataclasses.replace(device_setup("cuda"), gpus=()))


def test_default_budget_is_the_gpus_memory_less_the_reserve(fake_cuda):
    assert cuda_reserve(80 * GiB) == 2 * GiB + 4 * GiB  # context and NCCL buffers, plus 5 % fragmentation
    fake_cuda(8, H100)
    assert device_setup("cuda").default_memory_budget() == 80 * GiB - cuda_reserve(80 * GiB) == 74 * GiB
    reserve = device_module.CUDA_RESERVE_FIXED, device_module.CUDA_RESERVE_FRACTION
    assert reserve == (2 * GiB, 0.05)
    with pytest.raises(UsageError, match="give --memory-budget"):  # GPUs on a cluster this process cannot see
        DeviceSetup("cuda", "nccl", 0).default_memory_budget()


# ---------------------------------------------------------------------------- failures and figures
def test_out_of_memory_inside_a_stage_is_oom_on_the_rank_that_hit_it(no_leftover_children):
    from runners import LocalRunner
    from runners.trial import TrialSpec
    from slapo_tune.launch import launch
    from slapo_tune.problem import ProblemSpec

    class WrappedOOM(LocalRunner):
        def _execute(self, spec, point):
            return launch(w.wrapped_oom_on_rank_one, 2, timeout=60, backend="gloo")

    result = WrappedOOM().run(TrialSpec(ProblemSpec("gpt2-tiny", 2), {}))
    assert result.status == "oom" and result.error_rank == 1 and result.error_type == "OutOfMemoryError"
    assert result.error.startswith("rank 1 raised OutOfMemoryError: CUDA out of memory")


def test_out_of_memory_as_the_context_of_another_error_is_the_cause():
    from slapo_tune.launch import describe_exception

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("cleanup failed")  # noqa: B904 - the OOM stays its context
    except RuntimeError as exc:
        assert describe_exception(exc)[0] == "OutOfMemoryError"
    try:
        try:
            raise KeyError("handled")
        except KeyError:
            raise ValueError("a different error") from None
    except ValueError as exc:  # a context that is no OOM is not the cause
        assert describe_exception(exc)[0] == "ValueError"


def test_cuda_peak_reports_allocated_and_reserved(monkeypatch):
    from runners.trial import TrialSpec, summarize
    from slapo_tune.memory import measured_peak
    from slapo_tune.problem import ProblemSpec

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * GiB)
    peak = measured_peak(lambda: None, stage=None, optimizer=None, device="cuda:0")
    assert (peak.total, peak.reserved) == (3 * GiB, 4 * GiB)
    spec = TrialSpec(ProblemSpec("gpt2-tiny", 2, global_batch=8, seq_len=32), {}, measured_steps=1)
    ranks = [{"times": [1.0], "waits": [0.0], "remeasured": 0, "peak": p, "reserved": r, "rss": 1, "is_last": True,
              "losses": [1.0], "started": 0.0, "finished": 1.0, "cores": [0]} for p, r in ((3, 4), (5, 6))]
    result = summarize(spec, {}, ranks, 1.0, "local")
    assert result.peak_memory == [3, 5] and result.peak_reserved == [4, 6]
