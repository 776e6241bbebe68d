"""Pipeline stages cut from the unmodified model, without tracing it.

Each stage keeps the *whole* model object and runs its own ``forward``: blocks of other stages are
replaced by pass-throughs, modules with parameters that run before the first block (embeddings)
are replaced on later stages by stubs producing zeros of the right shape, and modules that run
after the last block (final norm, head) are dropped on earlier stages. On a later stage the
received hidden state is substituted for the input of its first block; on an earlier stage the
forward stops right after its last block. So the model's own code computes masks, positions and
rotary embeddings on every stage; only the hidden state crosses stages, any micro-batch shape
works, and per-block checkpointing survives (export-traced stages freeze shapes and drop it).

Which modules run before / after the blocks is learned from one forward pass under
``FakeTensorMode`` (no memory, no compute, communication disabled).

Interleaved pipelines cut ``pp * vpp`` stages and give rank ``r`` the stages ``r, r + pp, ...``
(:class:`VirtualStages`). Each is cut from its own structural copy of the model, made before any
stage is cut: the copies share the parameter tensors (no memory), and each keeps only its stage's
modules, so every stage is one module with one forward, as torch's multi-stage schedules expect.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import PipelineError
from ..parallel import _comm
from ..parallel._context_parallel import chunk_positions
from ._schedule import Schedule, cut_nodes
from ._state import _HOOK_DICTS, INIT_PARTS, TRACED_FROM, direct_tensors, record_init_owners


@dataclass
class PipelineCuts:
    """Where the pipeline cuts fall: which blocks of the repeated block list each stage runs."""

    blocks_path: str
    block_names: list[str]
    stages: list[tuple[int, int]]  # inclusive (first, last) block index per stage

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def block_path(self, index: int) -> str:
        return f"{self.blocks_path}.{self.block_names[index]}"


def pipeline_cuts(sch: Schedule) -> PipelineCuts | None:
    """The stages the schedule's ``cut_pipeline_stage`` marks define (None when there are no cuts)."""
    nodes = cut_nodes(sch)
    if not nodes:
        return None
    parent = nodes[0].parent
    names = list(parent.child)
    index = sorted(names.index(node.name) for node in nodes)
    if index[-1] == len(names) - 1:
        raise PipelineError(
            f"cut_pipeline_stage('{parent.child[names[-1]].path}'): a cut after the last block leaves the "
            "last stage with no blocks"
        )
    stages, start = [], 0
    for i in index:
        stages.append((start, i))
        start = i + 1
    stages.append((start, len(names) - 1))
    return PipelineCuts(parent.path, names, stages)


class _StageExit(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, hidden: torch.Tensor):
        super().__init__("stage finished")
        self.hidden = hidden


class _Skip(nn.Module):
    """A block of another stage: passes the hidden state through, in the block's output format."""

    def __init__(self, tuple_len: int | None):
        super().__init__()
        self.tuple_len = tuple_len

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))
        if self.tuple_len is None:
            return hidden
        return (hidden,) + (None,) * (self.tuple_len - 1)


class _ZerosStub(nn.Module):
    """A module of the first stage seen from a later one: zeros of the shape it would produce."""

    def __init__(self, path: str, prefix_dims: int, tail: tuple[int, ...], dtype: torch.dtype):
        super().__init__()
        self.path, self.prefix_dims, self.tail, self.dtype = path, prefix_dims, tail, dtype

    def forward(self, *args, **kwargs):
        x = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros(*x.shape[: self.prefix_dims], *self.tail, dtype=self.dtype, device=x.device)


class _Absent(nn.Module):
    """A module that runs after this stage's last block: never reached on this stage."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, *args, **kwargs):
        raise PipelineError(f"'{self.path}' belongs to a later pipeline stage but was called on this one")


@dataclass
class _Call:
    order: int
    input_shape: tuple[int, ...] | None = None
    output_shape: tuple[int, ...] | None = None
    output_dtype: torch.dtype | None = None
    output_tuple_len: int | None = None


@contextlib.contextmanager
def _recorded_calls(model: nn.Module):
    calls: dict[str, _Call] = {}
    counter = [0]
    handles = []
    for path, m in model.named_modules():
        if not path:
            continue

        def pre(mod, args, kwargs, path=path):
            if path not in calls:
                x = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
                calls[path] = _Call(counter[0], tuple(x.shape) if x is not None else None)
                counter[0] += 1

        def post(mod, args, kwargs, out, path=path):
            call = calls[path]
            if call.output_shape is None:
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor):
                    call.output_shape, call.output_dtype = tuple(first.shape), first.dtype
                call.output_tuple_len = len(out) if isinstance(out, (tuple, list)) else None

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _dry_run(model: nn.Module) -> dict[str, _Call]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _recorded_calls(model) as calls, _comm.communication_disabled(), torch.no_grad(), \
            FakeTensorMode(allow_non_fake_inputs=True):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        ids = torch.zeros(3, 7, dtype=torch.long, device=device)  # sizes unlikely to equal a model width
        try:
            model(input_ids=ids)
        except Exception as exc:  # noqa: BLE001 - any failure here means we cannot pipeline this model
            raise PipelineError(
                f"cannot cut {type(model).__name__} into pipeline stages: its forward(input_ids=...) failed "
                f"({type(exc).__name__}: {exc})"
            ) from None
    return calls


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _topmost(paths: list[str]) -> list[str]:
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


@dataclass
class StageInfo:
    """What a rank needs to know about its pipeline stage."""

    index: int
    num_stages: int
    first_block: str
    last_block: str
    # names (in this stage's model) of parameters tied to a parameter of another stage, in an
    # order both stages agree on (the tied tensor's path in the full model)
    tied: list[str] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, new)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Make the stand-ins for earlier stages' modules produce ``dtype`` where they produced floats:
    a model whose parameters compute in bf16 embeds into bf16, and what the model derives from the
    embedding's dtype (rotary tables, masks) must follow on every stage."""
    for module in model.modules():
        if isinstance(module, _ZerosStub) and module.dtype.is_floating_point:
            module.dtype = dtype


def make_stage(model: nn.Module, cuts: PipelineCuts, index: int) -> StageInfo:
    """Keep only stage ``index`` of ``model`` (in place) and describe it."""
    calls = _dry_run(model)
    first_block, last_block = cuts.block_path(0), cuts.block_path(len(cuts.block_names) - 1)
    if first_block not in calls:
        raise PipelineError(f"the forward of {type(model).__name__} never calls '{first_block}'")
    start, end = calls[first_block].order, calls[last_block].order
    block_prefix = cuts.blocks_path + "."
    pre, post = [], []
    for path, m in model.named_modules():
        if (not path or path not in calls or path.startswith(block_prefix) or cuts.blocks_path.startswith(path + ".")
                or path == cuts.blocks_path or not _has_params(m)):
            continue
        (pre if calls[path].order < start else post if calls[path].order > end else []).append(path)
    pre, post = _topmost(pre), _topmost(post)

    full_names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full_names.setdefault(id(p), []).append(name)
    record_init_owners(model)
    lo, hi = cuts.stages[index]
    info = StageInfo(index, cuts.num_stages, cuts.block_path(lo), cuts.block_path(hi))
    last = cuts.num_stages - 1
    if index > 0:
        for path in pre:
            call = calls[path]
            if call.output_shape is None or call.input_shape is None:
                raise PipelineError(f"cannot stand in for '{path}' on later stages: it returns no tensor")
            # the output keeps the input's leading dimensions (batch, sequence) and adds a fixed tail
            prefix = 0
            while (prefix < min(len(call.input_shape), len(call.output_shape))
                   and call.output_shape[prefix] == call.input_shape[prefix]):
                prefix += 1
            if prefix == 0:
                raise PipelineError(f"cannot stand in for '{path}' on later stages: its output shape is not "
                                    "its input's leading dimensions plus a fixed tail")
            _set_submodule(model, path, _ZerosStub(path, prefix, call.output_shape[prefix:], call.output_dtype))
    if index < last:
        for path in post:
            _set_submodule(model, path, _Absent(path))
    for i in range(len(cuts.block_names)):
        if not lo <= i <= hi:
            _set_submodule(model, cuts.block_path(i), _Skip(calls[cuts.block_path(i)].output_tuple_len))
    if cuts.num_stages > 1 and index in (0, last):
        # A tensor used both before and after the blocks (GPT-2's embedding and LM head) now has a
        # copy on the first and on the last stage; their gradients must be summed every step.
        present = {id(p): name for name, p in model.named_parameters()}
        for pid, names in full_names.items():
            where = {"pre" if any(n.startswith(p + ".") for p in pre) else
                     "post" if any(n.startswith(p + ".") for p in post) else "" for n in names}
            if {"pre", "post"} <= where and pid in present:
                info.tied.append((names[0], present[pid]))
        info.tied = [local for _, local in sorted(info.tied)]
    return info


# on the scheduled model's root: into how many shards sequence parallelism cuts the blocks' sequence
# (set by parallelize.apply_sequence_parallel)
SEQUENCE_SHARDS = "_slapo_sequence_shards"


def sequence_shards(model: nn.Module) -> int:
    """Into how many sequence shards ``model``'s blocks cut the hidden state (the tp size under
    sequence parallelism, else 1): what a pipeline stage sends and receives is
    ``[batch, seq / sequence_shards(model), hidden]``. ``model`` may be the scheduled model or a
    module holding it (a pipeline stage)."""
    return next((m.__dict__[SEQUENCE_SHARDS] for m in model.modules() if SEQUENCE_SHARDS in m.__dict__), 1)


def structural_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules (and what the schedule stored on them) that shares its
    parameter and buffer tensors: cutting a stage from it leaves ``model`` intact."""
    import copy

    from torch import fx

    memo = {id(t): t for m in model.modules() for _, t, _ in direct_tensors(m)}
    clone = copy.deepcopy(model, memo)
    # A GraphModule's deepcopy rebuilds it from its graph, dropping what the schedule stored on it
    # (its state, patched forward, hooks, the module it was traced from); its deep-copied __dict__
    # is in the memo, so restoring from there keeps every reference consistent.
    twins = dict(clone.named_modules())
    for path, m in model.named_modules():
        if isinstance(m, fx.GraphModule):
            for key in ("_slapo", TRACED_FROM, INIT_PARTS, "forward", *_HOOK_DICTS):
                if key in m.__dict__:
                    twins[path].__dict__[key] = copy.deepcopy(m.__dict__[key], memo)
    return clone


# on a stage: a weak reference to the training step that runs it (:class:`slapo_tune.runtime.TrainStep`),
# which knows the loss, the precision and the gradient synchronisation a call of the stage like its
# model needs (weak: the step holds the stage, and a cycle would keep a dropped model's memory until
# the garbage collector runs)
TRAIN_STEP = "_slapo_train_step"


class StageModule(nn.Module):
    """One pipeline stage as one module: token ids or a hidden state in, hidden state or logits
    out. With a single stage it is simply the model returning logits.

    Called with keywords instead (``stage(input_ids=..., labels=..., attention_mask=...)``, or
    ``stage(**batch)``), a single stage is called as the Hugging Face model it was scheduled from
    and returns that model's output (see :meth:`slapo_tune.runtime.TrainStep.call_like_model`);
    :meth:`no_sync` defers the gradient synchronisation as DDP's does."""

    def __init__(self, model: nn.Module, info: StageInfo, topology):
        super().__init__()
        self.model = model
        self.__dict__["info"] = info
        self.__dict__["topology"] = topology
        self.__dict__["_incoming"] = [None]
        # a later stage receives its slice of the sequence under sequence parallelism, and the
        # model must still see (masks, positions, rotary tables) the whole sequence
        self.__dict__["sequence_shards"] = sequence_shards(model)
        if not info.is_first:
            model.get_submodule(info.first_block).register_forward_pre_hook(self._substitute, with_kwargs=True)
        if not info.is_last:
            model.get_submodule(info.last_block).register_forward_hook(self._exit)

    @property
    def chunks(self) -> list[StageModule]:
        """The stages this rank runs (one, unless the pipeline is interleaved)."""
        return [self]

    def tied_parameters(self) -> list[nn.Parameter]:
        """This rank's copies of tensors tied across stages, in the order every stage agrees on."""
        return [self.model.get_parameter(name) for name in self.info.tied]

    def _substitute(self, module, args, kwargs):
        hidden = self._incoming[0]
        if args:
            return (hidden, *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: hidden}

    @staticmethod
    def _exit(module, args, output):
        raise _StageExit(output[0] if isinstance(output, (tuple, list)) else output)

    @property
    def config(self):
        """The scheduled model's configuration (as ``model.config`` on the Hugging Face model)."""
        return self.model.config

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward calls inside leave their gradients unsynchronised, for the next one outside to
        synchronise with its own (gradient accumulation, as with DDP's ``no_sync``)."""
        return train_step_of(self).no_sync()

    def forward(self, x: torch.Tensor | None = None, /, **model_inputs):
        if model_inputs or x is None:
            if x is not None:
                raise TypeError("call a stage with one tensor (the pipeline's input) or with keywords as its "
                                "model (input_ids=..., labels=...), not both")
            return train_step_of(self).call_like_model(**model_inputs)
        if self.info.is_first:
            ids = x
        else:
            self._incoming[0] = x
            ids = torch.zeros(x.shape[0], x.shape[1] * self.sequence_shards, dtype=torch.long, device=x.device)
        kwargs = {}
        topo = self.topology
        if topo is not None and topo.cp > 1:
            # context parallelism: this rank's chunk of the sequence, at its global positions
            positions = chunk_positions(ids.shape[1] * topo.cp, topo.cp_rank, topo.cp, ids.device)
            kwargs["position_ids"] = positions.expand(ids.shape[0], -1)
        try:
            return self.model(input_ids=ids, **kwargs).logits
        except _StageExit as done:
            # a block may return a view (OPT's decoder layer reshapes its output back with .view()):
            # torch's zero-bubble backward detaches stage outputs in place, which a view refuses. A
            # copy in place of the view (its base is no autograd input, so it is freed as it goes)
            hidden = done.hidden
            return hidden.clone() if hidden._base is not None else hidden
        finally:
            self._incoming[0] = None


class VirtualStages(nn.Module):
    """This rank's stages of an interleaved pipeline (``vpp`` of ``pp * vpp``): rank ``r`` runs
    stages ``r, r + pp, ...``, each a :class:`StageModule` cut from its own structural copy of
    the model (see the module docstring). ``info`` describes the rank (first / last pipeline rank);
    ``model`` is the first chunk's model (for its config and loss)."""

    def __init__(self, chunks: list[StageModule], topology):
        super().__init__()
        self.parts = nn.ModuleList(chunks)
        first, last = chunks[0].info, chunks[-1].info
        self.__dict__["info"] = StageInfo(topology.pp_rank, topology.pp, first.first_block, last.last_block,
                                          [name for c in chunks for name in c.info.tied])
        self.__dict__["topology"] = topology

    @property
    def chunks(self) -> list[StageModule]:
        return list(self.parts)

    @property
    def model(self) -> nn.Module:
        return self.parts[0].model

    def tied_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.parts for p in c.tied_parameters()]

    @property
    def config(self):
        return self.model.config

    def forward(self, x: torch.Tensor | None = None, /, **model_inputs):
        if model_inputs or x is None:
            return train_step_of(self).call_like_model(**model_inputs)  # refuses: no rank holds the model
        raise PipelineError("an interleaved pipeline rank runs its stages through the pipeline schedule, "
                            "one chunk at a time; call its chunks")


def train_step_of(stage: nn.Module):
    """The training step that runs ``stage`` (the last one made for it)."""
    ref = stage.__dict__.get(TRAIN_STEP)
    if ref is None:
        raise PipelineError("calling a stage like its model (input_ids=..., labels=...) needs its training step: "
                            "slapo_tune.runtime.TrainStep(stage, ...) (apply_schedule makes one)")
    step = ref()
    if step is None:
        raise PipelineError("this stage's training step is gone: keep the Session that apply_schedule returned "
                            "(or the TrainStep) while you call session.stage like the model")
    return step
