"""``slapo-tune tune``: search for the fastest schedule that fits, running real trials."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cost_model import CostModel
from ..cost_model.ranking import least_peak_if_none_fits
from ..device import DeviceSetup, cuda_reserve
from ..errors import UsageError
from ..launch import multiprocessing_temp_dir
from ..models import preset_names
from ..plan import readable
from ..precision import default_precision, runnable
from ..problem import Problem
from ..search import DEFAULT_STRATEGY, STRATEGIES, TuneConfig, Tuner
from ..search._report import no_result_reason
from ..search._storage import STORAGE_ENV, check_storage, redact, storage_url
from ..space import format_point, parse_knobs
from ..units import format_size, parse_duration, parse_size, size_at_least
from . import EXIT_NO_RESULT, EXIT_OK, interrupted_exit_code
from ._common import (
    add_device_argument,
    add_hardware_argument,
    add_precision_argument,
    add_problem_arguments,
    add_storage_arguments,
    device_of,
    hardware_of,
    non_negative_int,
    positive_int,
    problem_spec,
    seed_int,
    wrapped,
)
from ._signals import termination_deferred

HELP = "search for the fastest schedule that fits, running real trials"
CPU_BUDGET = "16MiB"  # the default budget on cpu: small enough that it rules out part of gpt2-tiny's space


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p, model="gpt2-tiny", world_size=2)
    p.add_argument("--memory-budget", default=None,
                   help=f"per-rank memory budget (default: on cuda the GPU's memory less a reserve for the CUDA "
                        f"context, NCCL's buffers and fragmentation; {CPU_BUDGET} on cpu)")
    add_precision_argument(p, "bf16 on cuda, fp32 on cpu")
    add_device_argument(p, "where trials' ranks run: cpu or cuda, one GPU per rank (default: cuda when "
                           "torch.cuda.is_available(), else cpu)")
    add_hardware_argument(p, "the visible GPU's preset on cuda, this machine measured on cpu")
    p.add_argument("--trials", type=positive_int, default=12, help="trials to launch (default: %(default)s)")
    p.add_argument("--time-budget", default=None, help="stop launching after this long, e.g. 30m")
    p.add_argument("--patience", type=positive_int, default=None, help="stop after N trials without improvement")
    p.add_argument("--confirm", type=non_negative_int, default=3, metavar="N",
                   help="at the end, measure the best trial and those within the noise of it (at most N) again, "
                        "side by side in alternating rounds, and crown from that; 0: crown the best trial as "
                        "measured (default: %(default)s)")
    p.add_argument("--knobs", default="",
                   help="hold knobs at values, e.g. tp=8,zero=3: the search explores the others (default: none)")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, help=f"{'|'.join(STRATEGIES)} (default: %(default)s)")
    p.add_argument("--objective", default="throughput", choices=["throughput", "throughput,memory"], metavar="OBJECTIVE",
                   help="throughput (samples/s), or throughput,memory (also the peak memory: a Pareto front) "
                        "(default: %(default)s)")
    p.add_argument("--prune", default="exact", choices=["exact", "analytic", "none"],
                   help="cost-model pruning before launch (default: %(default)s)")
    add_storage_arguments(p, "a journal file in --out")
    p.add_argument("--study", default=None, help="study name (default: the --out folder's name)")
    p.add_argument("--ray-address", default="local",
                   help="local (start a Ray head), none (local processes, no Ray), or ADDRESS of a running cluster "
                        "(default: %(default)s)")
    p.add_argument("--runtime-env", default=None, metavar="ENV",
                   help="Ray runtime environment of the trials on an attached cluster: package (ship this "
                        "installation's code, so nodes need only Ray, torch and transformers), a .whl file "
                        "(pip-installed on each node), or a JSON object as Ray takes it (default: none, every node "
                        "has slapo-tune installed)")
    p.add_argument("--net-if", default=None, metavar="IFACE",
                   help="network interface of the ranks' rendezvous and collectives (sets GLOO_SOCKET_IFNAME and "
                        "NCCL_SOCKET_IFNAME; default: those variables, else the interface holding each node's Ray "
                        "address)")
    p.add_argument("--keep-dashboard", action="store_true",
                   help="with --ray-address local: leave the Ray head (and its dashboard) up after the study and "
                        "print the command that stops it")
    p.add_argument("--oversubscribe", action="store_true",
                   help="on cpu, run a world larger than this machine's usable cores (refused without it: ranks "
                        "would take turns on the cores, and each trial would time that as much as its schedule)")
    p.add_argument("--concurrency", type=positive_int, default=None, help="trials in flight (default: what the cluster holds)")
    p.add_argument("--measured-steps", type=positive_int, default=3,
                   help="timed steps of each trial, after its warm-up step (default: %(default)s)")
    p.add_argument("--trial-timeout", default="5m", help="wall-clock limit of one trial (default: %(default)s)")
    p.add_argument("--seed", type=seed_int, default=0, help="the search's seed (default: %(default)s)")
    p.add_argument("--out", default=None, help="output folder (default: results/<model>-w<world>)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quiet", action="store_true", help="only the final summary")
    mode.add_argument("--json-lines", action="store_true", help="one JSON object per event on stdout")


def best_lines(summary: dict, schedule: Path, width: int) -> list[str]:
    """The summary's lines on the crowned point (a summary with one: see ``no_result_reason``
    otherwise): its figure (confirmed, where it was) and file, then its knobs on indented lines, as
    the live view shows a trial's, all within ``width`` columns."""
    # rich-free: every --help imports this module; _live imports rich's live display
    from ._live import knob_lines

    best, confirmed = summary["best_point"], summary["confirmed"]
    if confirmed is None:
        line = f"best: {summary['best']:.2f} samples/s -> {schedule}"
    else:
        line = (f"best: {summary['best']:.2f} samples/s, confirmed (median of {len(confirmed['step_times'])} steps, "
                f"spread {confirmed['spread']:.1%}; its trial measured {confirmed['trial_samples_per_s']:.2f}) "
                f"-> {schedule}")
    return wrapped(line, width=width) + knob_lines(readable(best), width)


def run(args: argparse.Namespace) -> int:
    # rich-free: every --help imports this module; _live imports rich's live display
    from ._live import STOPS, TuneView, print_summary

    if args.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy '{args.strategy}' (choose from {', '.join(STRATEGIES)})")
    # where ranks run: this machine, unless trials go to a Ray cluster this process only attaches to
    here = args.ray_address in ("none", "local")
    setup = device_of(args.device, here=here)
    if args.memory_budget:
        budget = parse_size(args.memory_budget)
        budget_text = format_size(budget)
    elif setup.cuda:
        budget = setup.default_memory_budget()
        budget_text = (f"{format_size(budget)} ({setup.name}'s {format_size(setup.memory)} less "
                       f"{format_size(cuda_reserve(setup.memory))} reserved)")
    else:
        budget = parse_size(CPU_BUDGET)
        budget_text = format_size(budget)
    time_budget = parse_duration(args.time_budget) if args.time_budget else None
    trial_timeout = parse_duration(args.trial_timeout)
    device = setup.kind
    model_label = args.model if args.model in preset_names() else Path(args.model).stem
    pins = parse_knobs(args.knobs)
    # a pinned search is another study: its own folder by default
    out = Path(args.out or f"results/{model_label}-w{args.world_size}" + (f"-{format_point(pins)}" if pins else ""))
    if out.exists() and not out.is_dir():
        raise UsageError(f"output folder {out} is a file; choose another --out")
    precision = args.precision or default_precision(device)
    runnable(precision, setup)  # fp8: one line, before anything starts
    problem = problem_spec(args, precision=precision, device=device, memory_budget=budget).resolve().pinned(pins)
    hardware, hardware_line = hardware_of(args, setup)
    if here:
        setup.concurrency(args.world_size)  # a world larger than the GPUs here fails before anything starts
        check_cores(setup, args.world_size, args.oversubscribe)
    storage_at = storage_url(args.storage, args.storage_file)
    check_storage(storage_at)  # an unusable URL fails here, before anything is started or written
    if args.keep_dashboard and args.ray_address != "local":
        raise UsageError("--keep-dashboard keeps the head of --ray-address local; an attached cluster stays up anyway")
    # torch-free: every --help imports this module; the runners package imports torch
    from runners.ray_cluster import connect, runtime_env_of

    runtime_env = runtime_env_of(args.runtime_env)
    # made now, not at the first local launch (with Ray there may be none): this also removes the
    # multiprocessing folders of SIGKILLed drivers before anything else runs
    multiprocessing_temp_dir()
    cost = CostModel(problem, hardware)  # the tuner's too
    unfit = nothing_fits_line(cost, problem, budget) if args.prune != "none" else None
    if unfit:  # what every point would be pruned for, said before a head, a rank or a study starts
        print(f"slapo-tune: no result: {unfit}", file=sys.stderr)
        return EXIT_NO_RESULT
    cluster = connect(args.ray_address, out if args.ray_address != "local" else _mkdir(out), args.world_size,
                      args.concurrency, device=setup, runtime_env=runtime_env, net_if=args.net_if,
                      withheld=(STORAGE_ENV,))  # the study's storage URL, password and all: not Ray's
    try:
        config = TuneConfig(problem=problem.spec, out=out, trials=args.trials, time_budget=time_budget,
                            strategy=args.strategy, objective=args.objective, storage=storage_at,
                            storage_file=None if args.storage else args.storage_file,
                            storage_from_environment=bool(storage_at) and not (args.storage or args.storage_file),
                            study=args.study, concurrency=cluster.runner.concurrency, seed=args.seed,
                            prune=args.prune, patience=args.patience, measured_steps=args.measured_steps,
                            trial_time_limit=trial_timeout, hardware=hardware.name, knobs=pins, confirm=args.confirm)
        shown = [k for k in problem.space.names if len(problem.space.domain(k)) > 1]  # the knobs that vary
        view = TuneView("quiet" if args.quiet else "json" if args.json_lines else "auto", budget, shown)
        tuner = Tuner(config, cluster.runner, problem=problem, report=view, cost=cost)
        study_name = tuner.study.study_name  # (the study opened: a resumed one at odds with this run fails here)
        storage_shown = redact(storage_at, storage_at) if storage_at else str(out / "study.journal")
        if not args.json_lines:
            ranks = f"{args.world_size} {setup.name} rank(s), one GPU each" if setup.cuda else f"{args.world_size} cpu rank(s)"
            header = [f"slapo-tune: {args.model} on {ranks}", precision, f"budget {budget_text} per rank", hardware_line,
                      f"strategy {config.strategy}", f"{config.trials} trial(s)",
                      f"{cluster.runner.concurrency} in flight", cluster.describe(),
                      f"study '{study_name}' in {storage_shown}"]
            # broken at spaces (the cluster's description is longer than a line)
            print("\n".join(wrapped(", ".join(header), width=view.width)), file=sys.stderr, flush=True)
        with view:
            summary = tuner.run()
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (see ._signals)
        print(f"slapo-tune: interrupted; running trials were stopped. Resume with the same command "
              f"(the study in {out} keeps every finished trial).", file=sys.stderr)
        return interrupted_exit_code(exc)
    finally:
        # trials, and a Ray head this tuner started, end with the command (unless kept for inspection);
        # a SIGTERM meanwhile waits for the head to be stopped
        with termination_deferred():
            kept = cluster.stop(keep_head=args.keep_dashboard)
        if kept:
            print(f"slapo-tune: {kept}", file=sys.stderr)
    if args.json_lines:
        print(json.dumps({"event": "done", **summary}, default=str))
    if summary["best_point"] is None:  # one line and its own exit code: a scheduler can tell it from a result
        stop = STOPS.get(summary["stop"], summary["stop"])
        print(f"slapo-tune: no result: {no_result_reason(tuner.study)} (stopped: {stop}); each point's outcome "
              f"is in {out / 'trials.csv'}", file=sys.stderr)
        return EXIT_NO_RESULT
    if not args.json_lines:
        print_summary(summary, budget, shown)
        print("\n".join(best_lines(summary, out / "best_schedule.json", view.width)))
        # (a URL's password is shown as ***: the user types their own)
        password = ", your password for ***" if storage_at and storage_shown != storage_at else ""
        print("\n".join(wrapped([f"see: slapo-tune show {out}", f"report: {out / 'report.html'}",
                                  f"{dashboard_command(storage_shown)}{password}"], sep="; ", width=view.width)))
    return EXIT_OK


def check_cores(setup: DeviceSetup, world_size: int, oversubscribe: bool) -> None:
    """Refuse a world larger than this machine's usable cores (a :class:`UsageError` naming
    ``--oversubscribe``); with ``oversubscribe``, say once that the ranks share cores."""
    if not setup.shares_cores(world_size):
        return
    ranks = f"{world_size} cpu ranks on this machine's {setup.count} usable core(s)"
    if not oversubscribe:
        raise UsageError(f"{ranks}: ranks would take turns on the cores, so each trial would time that as much as its "
                         f"schedule (and may run out its --trial-timeout); use --world-size {setup.count} or less, "
                         f"run it on a Ray cluster, or insist with --oversubscribe")
    print(f"slapo-tune: warning: {ranks} (--oversubscribe): the ranks take turns on the cores, so trials run slower "
          f"and their figures include that", file=sys.stderr)


def nothing_fits_line(cost: CostModel, problem: Problem, budget: int) -> str | None:
    """Why no trial could run, when the cost model predicts that no point of ``problem``'s space
    fits ``budget`` bytes per rank (the tuner would prune every one): the smallest predicted peak,
    as ``plan`` finds it, and a budget that holds it; None when a point fits."""
    least = least_peak_if_none_fits(cost, problem, budget)
    if least is None:
        return None
    return (f"no point fits the memory budget of {format_size(budget)} per rank, as the cost model predicts "
            f"(nothing was started): the smallest predicted peak is {format_size(least['peak'])}, at "
            f"{format_point(least['point'])}; rerun with --memory-budget {size_at_least(least['peak'])} or more")


def dashboard_command(storage: str) -> str:
    """The optuna-dashboard command for a study's storage as it is shown (``storage``: a URL, or
    the journal's path): optuna-dashboard opens a journal given as a plain path (``journal:PATH``,
    Optuna's own spelling, fails there)."""
    import shlex

    path = storage.removeprefix("journal:")
    return f"optuna-dashboard {path if '://' in path else shlex.quote(path)}"


def _mkdir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return out

