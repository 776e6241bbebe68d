"""``build``: turn a schedule into the runnable model, giving meta tensors real values.

Materialisation is deterministic and needs no communication: each *initialisation unit* (a
subtree of at most ``_UNIT_ELEMENTS`` full-size elements) is initialised at full size under a seed
derived from the base seed and the unit's path, then every rank keeps its own shard. The same
model built unscheduled, or sharded differently, or on another rank, therefore gets the same
weights, and no rank ever holds more than one unit at full size. Tensors that are already real are
never overwritten (a loaded checkpoint survives ``build``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ._schedule import Schedule, state_of
from ._sharding import rule_for
from .errors import MaterializeError, ScheduleError

_UNIT_ELEMENTS = 1 << 26  # ~256 MiB of fp32 per unit at full size


def _full_shape(module: nn.Module, name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    st = state_of(module)
    spec = st.shards.get(name) if st is not None else None
    return spec.full_shape if spec is not None else tuple(tensor.shape)


def _direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False


def _subtree_elements(module: nn.Module) -> int:
    total = 0
    for m in module.modules():
        for name, t, _ in _direct_tensors(m):
            n = 1
            for d in _full_shape(m, name, t):
                n *= d
            total += n
    return total


def _has_meta(module: nn.Module, recurse: bool) -> bool:
    mods = module.modules() if recurse else [module]
    return any(t.device.type == "meta" for m in mods for _, t, _ in _direct_tensors(m))


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
        node = getattr(node, part)
        if isinstance(node, PreTrainedModel):
            owner = node
    if owner is not None:
        return owner._init_weights

    def reset(module: nn.Module) -> None:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()

    return reset


def _seed_for(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _post_order(module: nn.Module, whole: bool) -> list[nn.Module]:
    if not whole:
        return [module]
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for c in m.children():
            visit(c)
        order.append(m)

    visit(module)
    return order


def _sentinel(t: torch.Tensor) -> float | int:
    return float("nan") if t.is_floating_point() or t.is_complex() else -(2**31) + 7


@torch.no_grad()
def materialize(model: nn.Module, *, seed: int = 0, device: torch.device | str | None = None) -> nn.Module:
    """Give every meta parameter and buffer of ``model`` its real value, in place.

    Each unit is initialised at full size with the model's own initialiser (Hugging Face
    ``_init_weights``, else ``reset_parameters``) under a seed derived from ``seed`` and its path;
    sharded tensors then keep this rank's slice. Raises :class:`MaterializeError` for a tensor
    that no initialiser wrote.
    """
    if not _has_meta(model, recurse=True):
        return model
    device = torch.device(device) if device is not None else _default_device(model)
    owners: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for m in model.modules():
        for name, t, is_param in _direct_tensors(m):
            owners.setdefault(id(t), []).append((m, name, is_param))

    for unit_path, unit, whole in _init_units(model):
        if not _has_meta(unit, recurse=whole):
            continue
        modules = _post_order(unit, whole)
        originals: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
        temps: dict[int, torch.Tensor] = {}
        for m in modules:
            for name, t, is_param in _direct_tensors(m):
                if id(t) not in temps:
                    temps[id(t)] = torch.full(_full_shape(m, name, t), _sentinel(t), dtype=t.dtype, device=device)
                tmp = temps[id(t)]
                originals.append((m, name, is_param, t))
                if is_param:
                    m._parameters[name] = nn.Parameter(tmp, requires_grad=t.requires_grad)
                else:
                    m._buffers[name] = tmp
        init = _initializer(model, unit_path)
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_seed_for(seed, unit_path))
            for m in modules:
                init(m)
        done: dict[int, torch.Tensor] = {}
        for m, name, is_param, original in originals:
            if original.device.type != "meta":
                (m._parameters if is_param else m._buffers)[name] = original
                continue
            if id(original) not in done:
                full = temps[id(original)]
                sentinel = _sentinel(original)
                unwritten = full.isnan().any() if isinstance(sentinel, float) else (full == sentinel).any()
                if bool(unwritten):
                    raise MaterializeError(
                        f"{unit_path or 'model'}: {type(m).__name__}.{name} is on the meta device and its "
                        "initialiser did not set it; build the model on a real device or give the module "
                        "reset_parameters()"
                    )
                st = state_of(m)
                spec = st.shards.get(name) if st is not None else None
                value = spec.take(full) if spec is not None else full
                done[id(original)] = (
                    nn.Parameter(value, requires_grad=original.requires_grad) if is_param else value
                )
            new = done[id(original)]
            for om, oname, o_is_param in owners.get(id(original), [(m, name, is_param)]):
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
) -> nn.Module:
    """The runnable model of a schedule.

    Validates the schedule, materialises meta tensors (see :func:`materialize`), then moves the
    model to ``device`` / ``dtype`` if given. Works the same on CPU (gloo) and CUDA (nccl).
    """
    if not isinstance(sch, Schedule):
        raise ScheduleError(f"build(): expected a Schedule from create_schedule(), got {type(sch).__name__}")
    validate(sch)
    model = sch.mod
    materialize(model, seed=seed, device=device)
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    return model
