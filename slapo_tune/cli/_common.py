"""What several commands share: the model/world/space arguments and the problem they describe."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .._inputs import MAX_BATCH, MAX_COUNT, MAX_SEED, MAX_SEQ_LEN, MAX_WORLD_SIZE
from ..cost_model import PRESETS, Hardware, hardware, hardware_for
from ..device import DeviceSetup, device_setup
from ..errors import UsageError
from ..precision import PRECISIONS
from ..problem import ProblemSpec
from ..units import parse_duration

DEVICE_HELP = "where ranks run: cpu or cuda (default: cuda when torch.cuda.is_available(), else cpu)"


def _int_from(text: str, least: int, most: int, what: str) -> int:
    if len(text) > len(str(most)) + 2:  # (int() of a 100,000-digit text is itself slow)
        shown = text if len(text) <= 24 else f"{text[:24]}... ({len(text)} characters)"
        raise argparse.ArgumentTypeError(f"expected {what} of at most {most}, got {shown}")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    if value > most:
        raise argparse.ArgumentTypeError(f"expected {what} of at most {most}, got {value}")
    return value


def bounded_int(least: int, most: int, what: str):
    """An argparse type: an integer from ``least`` to ``most`` (``what`` says so when it is not)."""
    def parse(text: str) -> int:
        return _int_from(text, least, most, what)

    parse.__name__ = what  # (argparse names the type in some messages)
    return parse


positive_int = bounded_int(1, MAX_COUNT, "a positive integer")
non_negative_int = bounded_int(0, MAX_COUNT, "an integer of 0 or more")
world_size_int = bounded_int(1, MAX_WORLD_SIZE, "a positive integer")
batch_int = bounded_int(1, MAX_BATCH, "a positive integer")
seq_len_int = bounded_int(1, MAX_SEQ_LEN, "a positive integer")
seed_int = bounded_int(0, MAX_SEED, "an integer of 0 or more")


def positive_float(most: float, what: str):
    """An argparse type: a finite number above 0 and at most ``most`` (NaN and infinity refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text[:24]}'") from None
        if not 0 < value <= most:  # (False for NaN too)
            raise argparse.ArgumentTypeError(f"expected {what}, got {text[:24]}")
        return value

    parse.__name__ = what
    return parse


def duration(text: str) -> float:
    """An argparse type: a positive duration as :func:`slapo_tune.units.parse_duration` reads it."""
    try:
        return parse_duration(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_problem_arguments(p: argparse.ArgumentParser, *, model: str | None = None, world_size: int | None = None,
                          global_batch: int | None = None) -> None:
    """``--model``, ``--world-size``, ``--space``, ``--global-batch``, ``--seq-len`` (required
    unless a default is given)."""
    p.add_argument("--model", required=model is None, default=model,
                   help="preset name or path to a config.json / model directory"
                   + (" (default: %(default)s)" if model else ""))
    p.add_argument("--world-size", type=world_size_int, required=world_size is None, default=world_size,
                   help="number of ranks" + (" (default: %(default)s)" if world_size else ""))
    p.add_argument("--space", default=None,
                   help="template: gpt2, llama, bert, opt, generic, module:attr, or a .py file defining a Template "
                        "or schedule(sch, point) with KNOBS (default: from the config)")
    p.add_argument("--global-batch", type=batch_int, default=global_batch,
                   help="global batch, held fixed (default: %(default)s)" if global_batch else
                   "global batch in sequences, held fixed (default: on cpu 8 x world size; on cuda the multiple "
                   "of the world size closest to 2^22 tokens, about 4M)")
    p.add_argument("--seq-len", type=seq_len_int, default=None,
                   help="sequence length (default: on cpu 128, or the model's positions if fewer; on cuda the "
                   "model's context length)")


def add_space_argument(p: argparse.ArgumentParser, recorded_in: str = "study") -> None:
    """``--space`` where a study or a schedule file names its template (``export``, ``show``,
    ``train``): they are data, so a template file or module named there is loaded only when the
    user names it too."""
    p.add_argument("--space", default=None, metavar="TEMPLATE",
                   help=f"the template file (or module:attr) the {recorded_in} was tuned with, when it is not a "
                        f"built-in one: a {recorded_in} only names it, and a file runs only if its content is the "
                        "one tuned with")


def add_precision_argument(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--precision`` (see :mod:`slapo_tune.precision`)."""
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="; ".join(f"{name}: {prec.doc}" for name, prec in PRECISIONS.items()) + f" (default: {default_help})")


def problem_spec(args: argparse.Namespace, **fields) -> ProblemSpec:
    """The :class:`ProblemSpec` of the parsed problem arguments (plus ``fields``)."""
    return ProblemSpec(args.model, args.world_size, template=args.space, global_batch=args.global_batch,
                       seq_len=args.seq_len, **fields)



def add_device_argument(p: argparse.ArgumentParser, help_text: str = DEVICE_HELP) -> None:
    """``--device``: where ranks run (see :mod:`slapo_tune.device`)."""
    p.add_argument("--device", default=None, help=help_text)


def add_hardware_argument(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--hardware``: the cost model's hardware preset (see :mod:`slapo_tune.cost_model.hardware`)."""
    p.add_argument("--hardware", default=None,
                   help=f"the cost model's hardware: cpu (this machine, measured), {', '.join(PRESETS)} "
                        f"(default: {default_help})")


def device_of(requested: str | None, *, here: bool = True) -> DeviceSetup:
    """The :class:`~slapo_tune.device.DeviceSetup` of ``--device`` (``here``: the ranks run on this
    machine). A hardware preset there, the option's old meaning, is refused with the new spelling."""
    if requested in PRESETS:
        raise UsageError(f"--device {requested} is a hardware preset: use --hardware {requested} "
                         f"(--device is where ranks run: cpu or cuda)")
    return device_setup(requested, here=here)


def hardware_of(args: argparse.Namespace, setup: DeviceSetup, fallback: str | None = None) -> tuple[Hardware, str]:
    """The cost model's hardware: ``--hardware``, else the devices of ``setup``
    (:func:`~slapo_tune.cost_model.hardware.hardware_for`), else the preset ``fallback`` when no GPU
    is visible to detect it from; with one line saying which and why."""
    if args.hardware:
        return hardware(args.hardware), f"hardware {args.hardware} (--hardware)"
    if fallback and setup.cuda and not setup.gpus:
        return hardware(fallback), f"hardware {fallback} (default: no GPU visible here to detect it from)"
    return hardware_for(setup)


def add_storage_arguments(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--storage URL`` or ``--storage-file PATH`` (one of them; see
    :func:`slapo_tune.search._storage.storage_url`), and ``--study``."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--storage", default=None,
                       help=f"Optuna storage URL, e.g. postgresql://user:pass@host/db (default: $SLAPO_TUNE_STORAGE, "
                            f"else {default_help})")
    where.add_argument("--storage-file", default=None, metavar="PATH",
                       help="read the storage URL from this file's first line, keeping a password off the "
                            "command line")


WIDTH = 100  # the columns a command's text fits (show's table, plan's lines)


def wrapped(text: str | Sequence[str], indent: str = "", then: str = "  ", sep: str = ", ",
            width: int = WIDTH) -> list[str]:
    """``text`` as lines within ``width`` columns, the first indented by ``indent``, the others
    by ``then``; broken at spaces only (``llama-70b`` stays whole) unless one word is wider. A
    sequence of phrases is joined by ``sep`` and broken between phrases only (``548.5 MiB`` whole)."""
    import textwrap

    if not isinstance(text, str):  # a no-break space inside a phrase: textwrap breaks at ASCII blanks only
        return [line.replace("\xa0", " ") for line in wrapped(sep.join(p.replace(" ", "\xa0") for p in text),
                                                                indent, then, width=width)]
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=then, break_on_hyphens=False)


def aligned(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Rows of cells as lines, one space apart, each column as wide as its widest cell (the columns
    in ``right`` right-aligned, the others left-aligned and padded: a caller may add a column)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    return [" ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def table(rows: list[list[str]], right: set[int] = frozenset(), keep: int = 1) -> list[str]:
    """:func:`aligned` rows (the first the header), within :data:`WIDTH` columns: columns that do not
    fit beside the others come in a further block below, each block led by the first ``keep``
    columns again (a row's number), as pandas wraps a wide frame."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lead = sum(widths[:keep]) + keep  # the kept columns and their separators
    blocks: list[list[int]] = [[]]
    used = lead
    for i in range(keep, len(widths)):
        if blocks[-1] and used + widths[i] > WIDTH:
            blocks.append([])
            used = lead
        blocks[-1].append(i)
        used += widths[i] + 1
    lines: list[str] = []
    for block in blocks:
        columns = [*range(keep), *block]
        lines += [line.rstrip() for line in aligned([[row[i] for i in columns] for row in rows],
                                                    {n for n, i in enumerate(columns) if i in right})]
    return lines
