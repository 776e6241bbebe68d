"""``build``: turn a schedule into the runnable model, giving meta tensors real values.

Materialisation is deterministic and needs no communication: each *initialisation unit* (a
subtree of at most ``_UNIT_ELEMENTS`` full-size elements) is initialised at full size under a seed
derived from the base seed and the unit's path, then every rank keeps its own shard. The same
model built unscheduled, or sharded differently, or on another rank, therefore gets the same
weights, and no rank ever holds more than one unit at full size. Tensors that are already real are
never overwritten (a loaded checkpoint survives ``build``).
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .._master_weights import MasterWeights
from .._partition import rank_stages
from ..errors import MaterializeError, PipelineError, ScheduleError
from ..parallel._data_parallel import ZERO_STAGES, largest_module_list, shard_data_parallel
from ..precision import precision as precision_named
from ._pipeline import (
    StageInfo,
    StageModule,
    VirtualStages,
    make_stage,
    pipeline_cuts,
    set_compute_dtype,
    structural_copy,
)
from ._schedule import Schedule
from ._sharding import rule_for
from ._state import INIT_OWNERS_ATTR, INIT_PARTS, TRACED_FROM, direct_tensors, state_of

_UNIT_ELEMENTS = 1 << 26  # ~256 MiB of fp32 per unit at full size


def _full_shape(module: nn.Module, name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    st = state_of(module)
    spec = st.shards.get(name) if st is not None else None
    return spec.full_shape if spec is not None else tuple(tensor.shape)


def _subtree_elements(module: nn.Module) -> int:
    total = 0
    for m in module.modules():
        for name, t, _ in direct_tensors(m):
            n = 1
            for d in _full_shape(m, name, t):
                n *= d
            total += n
    return total


def _has_meta(module: nn.Module, recurse: bool) -> bool:
    mods = module.modules() if recurse else [module]
    return any(t.device.type == "meta" for m in mods for _, t, _ in direct_tensors(m))


def _init_units(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module, bool]]:
    """(path, module, whole_subtree) units in module order; a large module is split by children."""
    children = list(module.named_children())
    if not children or _subtree_elements(module) <= _UNIT_ELEMENTS:
        yield path, module, True
        return
    yield path, module, False
    for name, child in children:
        yield from _init_units(child, f"{path}.{name}" if path else name)


def _initializer(root: nn.Module, module_path: str) -> Callable[[nn.Module], None]:
    """The function that initialises one module the way its model would (Hugging Face aware)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        PreTrainedModel = ()  # noqa: N806
    owner = root if isinstance(root, PreTrainedModel) else None
    node = root
    for part in module_path.split(".") if module_path else []:
        node = getattr(node, part, None)
        if node is None:
            break
        if isinstance(node, PreTrainedModel):
            owner = node
    if owner is not None:
        return owner._init_weights

    def reset(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return reset


InitWeights = Callable[[nn.Module], None] | Callable[[nn.Module, str], None]


def _custom_initializer(init_weights: InitWeights, path: str) -> Callable[[nn.Module], None]:
    """``init_weights`` as a one-argument initialiser: given the module's path too if it takes two."""
    try:
        inspect.signature(init_weights).bind(None, None)
    except (TypeError, ValueError):  # one argument, or a builtin without a signature
        return init_weights
    return lambda module: init_weights(module, path)


def _seed_for(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _post_order(module: nn.Module, path: str, whole: bool) -> list[tuple[str, nn.Module]]:
    if not whole:
        return [(path, module)]
    order: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, p: str) -> None:
        for name, c in m.named_children():
            visit(c, f"{p}.{name}" if p else name)
        order.append((p, m))

    visit(module, path)
    return order


def _sentinel(t: torch.Tensor) -> float | int:
    return float("nan") if t.is_floating_point() or t.is_complex() else -(2**31) + 7


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _unwritten(full: torch.Tensor, sentinel: float | int) -> bool:
    return bool(full.isnan().any() if isinstance(sentinel, float) else (full == sentinel).any())


@torch.no_grad()
def materialize(model: nn.Module, *, seed: int = 0, device: torch.device | str | None = None,
                init_weights: InitWeights | None = None) -> nn.Module:
    """Give every meta parameter and buffer of ``model`` its real value, in place.

    Every module is initialised by the model's own initialiser (Hugging Face ``_init_weights``,
    else ``reset_parameters``) at full size under a seed derived from ``seed`` and *its own path*,
    so a module's values do not depend on which other modules are present (pipeline stages) or
    how they are sharded; sharded tensors then keep this rank's slice. A tensor held by several
    modules (ties) takes the value written by the first of them in module order, as Hugging Face
    ties do. Raises :class:`MaterializeError` for a tensor that no initialiser wrote.

    ``init_weights`` replaces the model's initialiser: ``init_weights(module)`` or
    ``init_weights(module, path)`` is called on each module (children first) with the module's
    tensors at full size, under the same per-path seed; it writes them in place (``nn.init``).
    """
    if not _has_meta(model, recurse=True):
        return model
    device = torch.device(device) if device is not None else _default_device(model)
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    canonical: dict[int, tuple[str, nn.Module, str]] = dict(model.__dict__.get(INIT_OWNERS_ATTR, {}))
    for path, m in model.named_modules():
        for name, t, is_param in direct_tensors(m):
            owners.setdefault(id(t), []).append((m, name, is_param))
            canonical.setdefault(id(t), (path, m, name))
    present = {id(m) for m in model.modules()}
    devices = [device.index or 0] if device.type == "cuda" else []

    def fresh(t: torch.Tensor, shape) -> torch.Tensor:
        return torch.full(shape, _sentinel(t), dtype=t.dtype, device=device)

    for unit_path, unit, whole in _init_units(model):
        if not _has_meta(unit, recurse=whole):
            continue
        modules = _post_order(unit, unit_path, whole)
        saved: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
        kept: dict[int, torch.Tensor] = {}  # the temporary that will become each meta tensor

        def install(m: nn.Module, name: str, is_param: bool, tmp: torch.Tensor, original: torch.Tensor,
                    saved=saved) -> None:
            saved.append((m, name, is_param, original))
            if is_param:
                m._parameters[name] = nn.Parameter(tmp, requires_grad=original.requires_grad)
            else:
                m._buffers[name] = tmp

        detached: list[tuple[str, nn.Module]] = []
        composite: dict[int, list[torch.Tensor]] = {}
        for _, m in modules:
            for name, t, is_param in direct_tensors(m):
                shape = _full_shape(m, name, t)
                owner_path, owner, owner_name = canonical[id(t)]
                parts = m.__dict__.get(INIT_PARTS, {}).get(name)
                if t.device.type == "meta" and parts:
                    # a horizontally fused tensor: initialise each original module, concatenate
                    install(m, name, is_param, fresh(t, shape), t)
                    composite[id(t)] = []
                    for part_path, part_module, part_name in parts:
                        original = getattr(part_module, part_name)
                        piece = fresh(original, tuple(original.shape))
                        install(part_module, part_name, is_param, piece, original)
                        detached.append((part_path, part_module))
                        composite[id(t)].append(piece)
                    continue
                if t.device.type == "meta" and owner is m:
                    install(m, name, is_param, kept.setdefault(id(t), fresh(t, shape)), t)
                    continue
                install(m, name, is_param, fresh(t, shape), t)  # written, then thrown away
                if t.device.type == "meta" and id(owner) not in present and id(t) not in kept:
                    # the module that initialises this tied tensor lives on another pipeline stage
                    kept[id(t)] = fresh(t, shape)
                    install(owner, owner_name, is_param, kept[id(t)], getattr(owner, owner_name))
                    detached.append((owner_path, owner))
        with torch.random.fork_rng(devices=devices):
            for path, m in detached + modules:
                torch.manual_seed(_seed_for(seed, path))
                init = _custom_initializer(init_weights, path) if init_weights is not None else _initializer(model, path)
                init(m.__dict__.get(TRACED_FROM, m))
        for m, name, is_param, original in reversed(saved):
            (m._parameters if is_param else m._buffers)[name] = original
        for tid, pieces in composite.items():
            kept[tid] = torch.cat(pieces, dim=0)
        for path, m in modules:
            for name, t, is_param in list(direct_tensors(m)):
                if id(t) not in kept:
                    continue
                full = kept.pop(id(t))
                if not _is_fake(full) and _unwritten(full, _sentinel(t)):
                    raise MaterializeError(
                        f"{path or 'model'}: {type(m).__name__}.{name} is on the meta device and its "
                        "initialiser did not set it; build the model on a real device or give the module "
                        "reset_parameters()"
                    )
                st = state_of(m)
                spec = st.shards.get(name) if st is not None else None
                value = spec.take(full) if spec is not None else full
                new = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
                for om, oname, o_is_param in owners[id(t)]:
                    (om._parameters if o_is_param else om._buffers)[oname] = new
    return model


def _default_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def validate(sch: Schedule) -> None:
    """Refuse a schedule whose sharding cannot compute correctly (checked before running)."""
    for path, node in sch.named_schedules():
        st = state_of(node.mod)
        if st is None or not st.shards:
            continue
        reason = rule_for(node.mod).check_consistent(node.mod, st.shards)
        if reason:
            raise ScheduleError(f"'{node.path or path}' ({type(node.mod).__name__}): {reason}")


def build(
    sch: Schedule,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    topology=None,
    zero: int = 0,
    precision: str = "fp32",
    init_weights: InitWeights | None = None,
) -> nn.Module:
    """The runnable model of a schedule.

    Validates the schedule, keeps this rank's pipeline stage (when the schedule has cuts),
    materialises meta tensors (see :func:`materialize`), moves the model to ``device`` / ``dtype``,
    applies sharded data parallelism (``zero`` 1-3, see :mod:`slapo_tune.parallel._data_parallel`) and the
    ``precision``'s parameter dtype (:mod:`slapo_tune.precision`: FSDP2's mixed-precision policy
    where sharded, :class:`~slapo_tune.precision.MasterWeights` in ``stage.master`` otherwise).
    Works the same on CPU (gloo) and CUDA (nccl). ``init_weights`` replaces the model's own
    initialiser for meta tensors (see :func:`materialize`); real tensors are never re-initialised.

    Without a ``topology`` the model itself is returned. With one (see
    :func:`slapo_tune.topology.init_topology`) a :class:`~slapo_tune.schedule._pipeline.StageModule` is
    returned, which :class:`slapo_tune.runtime.TrainStep` runs with micro-batching for any ``pp``;
    a schedule cut into ``pp * vpp`` stages gives each rank ``vpp`` of them, interleaved
    (:class:`~slapo_tune.schedule._pipeline.VirtualStages`).
    """

    if not isinstance(sch, Schedule):
        raise ScheduleError(f"build(): expected a Schedule from create_schedule(), got {type(sch).__name__}")
    if zero not in ZERO_STAGES:
        raise ScheduleError(f"build(): zero must be one of {ZERO_STAGES} (0: replicated; 1, 2, 3: optimizer "
                            f"state, gradients, parameters sharded), got {zero}")
    mode = precision_named(precision)
    if mode.fp8:
        raise ScheduleError("build(): precision fp8 is modelled by the cost model (`plan`) only: the runtime does not "
                            "convert linear layers to FP8 (use bf16)")
    validate(sch)
    cuts = pipeline_cuts(sch)
    stages = cuts.num_stages if cuts is not None else 1
    if topology is None:
        if cuts is not None:
            raise PipelineError(
                f"build(): the schedule cuts the model into {stages} pipeline stages; "
                f"pass topology=init_topology(pp={stages}, ...)"
            )
        if zero:
            raise ScheduleError(f"build(): zero={zero} shards over data parallelism; pass a topology")
        if mode.master:
            raise ScheduleError(f"build(): precision {precision} keeps master weights for a training step; "
                                "pass a topology")
    elif stages % topology.pp or (stages > 1 and topology.pp == 1):
        after = ", ".join(f"'{cuts.block_path(last)}'" for _, last in cuts.stages[:-1]) if cuts else "none"
        raise PipelineError(
            f"build(): the schedule cuts the model into {stages} stage(s) (cuts after: {after}) but pp={topology.pp} "
            "ranks cannot share them (an interleaved pipeline holds a multiple of pp stages, over pp > 1 ranks)"
        )

    def finish(model: nn.Module) -> None:
        materialize(model, seed=seed, device=device, init_weights=init_weights)
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        set_compute_dtype(model, mode.param_dtype if dtype is None else dtype)

    model = sch.mod
    if topology is None:
        finish(model)
        return model
    # an interleaved rank runs several stages: every copy is made before any stage is cut (cutting
    # changes the model in place)
    indices = list(rank_stages(topology.pp_rank, topology.pp, stages))
    models = [model] + [structural_copy(model) for _ in indices[1:]]
    chunks = []
    for index, copy in zip(indices, models, strict=True):
        info = make_stage(copy, cuts, index) if cuts is not None else StageInfo(0, 1, "", "")
        finish(copy)
        chunks.append(StageModule(copy, info, topology))
    stage = chunks[0] if len(chunks) == 1 else VirtualStages(chunks, topology)
    sharded = zero > 0 and topology.dp > 1
    stage.__dict__["zero"] = zero if sharded else 0
    stage.__dict__["master"] = MasterWeights(stage.parameters(), mode.param_dtype) if mode.master and not sharded \
        else None
    if sharded:
        for index, chunk in zip(indices, chunks, strict=True):
            if cuts is not None:
                lo, hi = cuts.stages[index]
                blocks = [chunk.model.get_submodule(cuts.block_path(i)) for i in range(lo, hi + 1)]
            else:
                found = largest_module_list(chunk.model)
                blocks = list(found[1]) if found else []
            # each stage is its own FSDP root, as the pipeline schedule runs stages one at a time
            shard_data_parallel(chunk, blocks, topology.dp_mesh(), zero, mode.mixed_precision_policy())
    return stage
