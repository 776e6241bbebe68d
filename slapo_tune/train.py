"""The training job: train a model with an exported schedule, save and resume checkpoints.

One rank function, :func:`train_rank`, serves both launches: ``slapo-tune train`` starts the
schedule's number of local ranks itself, and under ``torchrun`` each process runs it directly
(the process group comes from the usual environment variables).

The steps, the optimizer, the precision and the checkpoints are the rank's
:class:`~slapo_tune.session.Session`'s, the same as a trial's: a schedule trains as it was
measured. Checkpoints are per rank (:mod:`slapo_tune.checkpoint`). Batches are a function of the
step (:class:`~slapo_tune.data.TrainingData`), so a resumed job continues the uninterrupted job's
loss curve exactly.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .apply import apply_schedule, load_schedule
from .checkpoint import latest_checkpoint
from .data import TrainingData
from .device import auto_setup, device_setup
from .errors import UsageError
from .launch import RankContext
from .models import config_fingerprint, load_config, model_from_config

log = logging.getLogger("slapo_tune")


@dataclass(frozen=True)
class TrainConfig:
    schedule: str
    model: str | None = None
    space: str | None = None  # the template the user names (a schedule only names its file: it runs none)
    allow_model_mismatch: bool = False
    data: str = "synthetic"
    steps: int = 30
    lr: float = 1e-3
    seed: int = 0
    save: str | None = None
    save_every: int = 0  # 0: only at the end
    keep: int = 2  # checkpoints kept in the save folder
    resume: str | None = None
    init_from: str | None = None  # a Hugging Face checkpoint folder (save_pretrained)
    log_every: int = 1
    device: str | None = None  # cpu or cuda (None: cuda when every local rank can have a GPU, else cpu)
    started_at: float | None = None  # when the command started (time.time()): set-up counts from there


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass
class Progress:
    """What rank 0 tells a person while a job trains: elapsed time, an ETA, mean throughput, and
    the throughput the schedule was tuned at beside it."""

    steps: int  # steps this run will take (a resumed job: those left)
    global_batch: int
    tokens_per_batch: int
    tuned: float | None = None  # samples/s measured when the schedule was tuned (its file's figure)
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    step_seconds: float = 0.0  # the steps' own time (timed_step), without checkpoint saves

    def add(self, seconds: float) -> None:
        self.done += 1
        self.step_seconds += seconds

    @property
    def samples_per_s(self) -> float:
        return self.done * self.global_batch / self.step_seconds if self.step_seconds else 0.0

    def _versus_tuned(self) -> str:
        if not self.tuned:
            return ""
        return f", {100 * self.samples_per_s / self.tuned:.0f} % of the {self.tuned:.1f} samples/s it was tuned at"

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.steps - self.done) if self.done else 0.0
        return (f"mean {self.samples_per_s:.1f} samples/s{self._versus_tuned()} | elapsed {_clock(elapsed)}, "
                f"ETA {_clock(left)}")

    def summary(self, loss: float, setup_seconds: float) -> str:
        return (f"done: {self.done} step(s) in {_clock(time.monotonic() - self.started)} after "
                f"{setup_seconds:.1f} s of set-up, final loss {loss:.6f}; mean {self.samples_per_s:.1f} samples/s, "
                f"{self.samples_per_s * self.tokens_per_batch / self.global_batch:.0f} tokens/s{self._versus_tuned()}")


def checkpoint_files(folder: str) -> list[Path]:
    """The weight files of a Hugging Face checkpoint folder (UsageError when it holds none)."""
    path = Path(folder)
    if not path.is_dir():
        raise UsageError(f"--init-from {folder}: no such folder")
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise UsageError(f"--init-from {folder}: not a Hugging Face checkpoint folder (no *.safetensors or "
                         "pytorch_model*.bin)")
    return files


def pretrained_model(folder: str, spec) -> torch.nn.Module:
    """``spec``'s model with the weights of a Hugging Face checkpoint folder (``save_pretrained``):
    built on the meta device, then every parameter assigned from the files, never initialised."""
    path = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(folder):
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                state.update(load_file(str(file)))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - a damaged file: one line
            raise UsageError(f"--init-from {folder}: cannot read {file.name}: {type(exc).__name__}: {exc}") from None
    if (path / "config.json").is_file():
        theirs, ours = config_fingerprint(load_config(path)), config_fingerprint(spec.config())
        if theirs != ours:
            raise UsageError(f"--init-from {folder}: the checkpoint's config ({theirs}) is not the schedule's "
                             f"model {spec.name} ({ours}); pass --model {folder} to train that model")
    model = model_from_config(spec.config(), "meta")
    model.config.use_cache = False
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UsageError(f"--init-from {folder}: the checkpoint has no value for {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if result.unexpected_keys:
        log.warning("--init-from %s: ignored %d unexpected tensors (e.g. %s)", folder, len(result.unexpected_keys),
                    result.unexpected_keys[0])
    return model


# ------------------------------------------------------------------ the job
def train_rank(ctx, config: TrainConfig) -> list[float]:
    """Train on this rank; returns the loss of every step run (rank 0 logs them)."""
    # set-up counts from the command's start (ranks spawned, libraries imported), else from here (torchrun)
    begun = time.monotonic() - (time.time() - config.started_at if config.started_at else 0.0)
    rank = dist.get_rank()
    loaded = load_schedule(config.schedule, model=config.model, world_size=dist.get_world_size(), space=config.space,
                           allow_model_mismatch=config.allow_model_mismatch)
    torch.manual_seed(config.seed)
    model = pretrained_model(config.init_from, loaded.model) if config.init_from else None
    session = apply_schedule(model, loaded, device=getattr(ctx, "device", None) or "cpu", seed=config.seed,
                             lr=config.lr)
    workload = loaded.workload
    data = TrainingData(config.data, session.stage.model.config.vocab_size, workload.global_batch, workload.seq_len,
                        config.seed)
    meta = {"schedule": loaded.plan.knobs(), "world_size": loaded.world_size, "model": loaded.model.name,
            "data": config.data, "seed": config.seed, "lr": config.lr}
    start, losses = 0, []
    if config.resume:
        folder = latest_checkpoint(config.resume)
        saved = session.restore(folder)
        mismatch = [k for k in ("schedule", "world_size", "data", "seed", "lr") if saved.get(k) != meta[k]]
        if mismatch:
            raise UsageError(f"--resume {config.resume}: the checkpoint was made with another {mismatch[0]} "
                             f"({saved.get(mismatch[0])!r}, now {meta[mismatch[0]]!r})")
        start, losses = saved["step"], list(saved.get("losses", []))
        if rank == 0:
            print(f"resumed from {folder} at step {start}", flush=True)
    tokens = workload.global_batch * workload.seq_len
    setup_seconds = time.monotonic() - begun  # building, scheduling, restoring: seconds a person otherwise waits blind
    if rank == 0:
        print(f"ready after {setup_seconds:.1f} s of set-up (model built, schedule applied"
              f"{', checkpoint restored' if config.resume else ''})", flush=True)
    progress = Progress(config.steps - start, workload.global_batch, tokens,
                        (loaded.data.get("measured") or {}).get("samples_per_s"))
    for step in range(start, config.steps):
        loss, seconds, _ = session.timed_step(data.batch(step))
        losses.append(loss)
        progress.add(seconds)
        if rank == 0 and ((step + 1) % config.log_every == 0 or step + 1 == config.steps):
            print(f"step {step + 1}/{config.steps} loss {loss:.6f} {workload.global_batch / seconds:.1f} "
                  f"samples/s {tokens / seconds:.0f} tokens/s | {progress.line()}", flush=True)
        last = step + 1 == config.steps
        if config.save and (last or (config.save_every and (step + 1) % config.save_every == 0)):
            session.save(config.save, step + 1, {**meta, "losses": losses}, config.keep)
    if rank == 0 and progress.done:
        print(progress.summary(losses[-1], setup_seconds), flush=True)
    return losses


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))


def run_under_torchrun(config: TrainConfig) -> list[float]:
    """Each torchrun process: join the group from the environment, train, leave."""
    world = int(os.environ["WORLD_SIZE"])
    load_schedule(config.schedule, model=config.model, world_size=world, space=config.space,
                  allow_model_mismatch=config.allow_model_mismatch)  # fail before joining the group
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    setup = device_setup(config.device) if config.device else auto_setup(local_world)
    setup.check_world(local_world)  # one GPU per rank of this node
    device = setup.rank_device(local)  # torchrun shows every rank all of its node's GPUs
    if setup.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(setup.backend)
    try:
        return train_rank(RankContext(dist.get_rank(), world, device), config)
    finally:
        dist.destroy_process_group()
