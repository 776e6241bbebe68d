"""``slapo-tune space``: the knobs of a model's search space and the number of legal points."""

from __future__ import annotations

import argparse
import json
import time

from ..space import product_size
from . import EXIT_OK
from ._common import add_problem_arguments, problem_spec

HELP = "list the knobs of a model's search space and count its legal points"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p)
    p.add_argument("--domains", action="store_true", help="list every knob's legal values (enumerates the space)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    problem = problem_spec(args).resolve()
    template, info, workload, space = problem.template, problem.info, problem.workload, problem.space
    t0 = time.perf_counter()  # the space's work (imports and config loading are not the space's cost)
    domains = space.domains() if args.domains else None
    count = space.count()
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"model": args.model, "template": template.describe(), "world_size": workload.world_size,
                          "global_batch": workload.global_batch, "legal_points": count,
                          "domains": domains, "seconds": round(elapsed, 4)}))
        return EXIT_OK
    print(f"{args.model}: template {template.describe()}, world {workload.world_size}, "
          f"global batch {workload.global_batch} ({info.layers} layers, {info.heads} heads, hidden {info.hidden})")
    for knob in space.knobs:
        values = domains[knob.name] if domains else None
        shown = ", ".join(map(str, values)) if values is not None else "(--domains to list)"
        print(f"  {knob.name:<18} {shown:<40} {knob.doc}")
    extra = f" of {product_size(domains)} unconstrained combinations" if domains else ""
    print(f"legal points: {count}{extra}  (computed in {elapsed * 1e3:.0f} ms)")
    return EXIT_OK
