"""Analytic memory and time: closed-form terms, microseconds per point.

Memory per pipeline stage is a weighted sum of *terms*, each a byte count derived from the model's
sizes and the point's knobs (tensor parallelism divides what it shards, checkpointed blocks keep
only their input, a GPipe stage holds all its micro-batches in flight, a 1F1B stage ``s`` holds
``pp - s``, the last stage also holds the logits...). The weights are how many times a term's
bytes are alive at the peak; defaults come from the textbook counts and :mod:`.calibration`
fits them to exact-mode (or measured) points per device, model family and precision. Model
states follow the precision (fp32, amp-bf16, bf16 with fp32 master weights; fp8 as bf16) and the ZeRO level
(:func:`model_state_bytes`); what FSDP gathers and buffers during a step follows the level and
whether a pipeline defers its reduction (:func:`memory_terms`). What a block keeps is measured by
:func:`activation_probe`, including what sequence parallelism puts on a sequence shard and what
a selectively checkpointed block keeps (:func:`block_activations`); an interleaved pipeline rank
holds what torch's interleaved 1F1B warm-up leaves in flight (:func:`interleaved_warmup`).

Time is compute (FLOPs at an achievable rate that a GPU's small products reach less of,
recomputation included), memory-bound passes at memory bandwidth, plus a fixed cost per block and
micro-batch (on a GPU, FSDP's), plus tensor-parallel, data-parallel (per ZeRO level: all-reduce, or
all-gathers in the compute dtype and fp32 reduce-scatters, half hidden behind compute on a GPU) and
pipeline communication (alpha-beta over NVLink inside a node and every NIC of a node across nodes),
with the pipeline bubble ((pp - 1) / (vpp m) of the step). On llm-foundry's published GPU runs it is
within 15 % of every one (benchmarks/published_runs.py). Korthikanti et al.'s
per-layer activation formulas (:func:`megatron_activation_bytes`) are kept for comparison.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from .._atomic import atomic_write_text
from .._partition import GRADIENT_BUCKET_BYTES as DP_BUCKET_BYTES
from .._partition import rank_block_count
from ..plan import Workload, accumulation, knob_value
from ..template import Template
from .hardware import Hardware, _cache_dir, choose, larger

MEMORY_TERMS = (
    "weights",  # parameters the rank holds between steps (sharded by tp; by dp under zero>=1: fp32 shards)
    "master",  # bf16: fp32 master weights (replicated: beside the bf16 weights; sharded: the shards)
    "gradients",  # fp32 gradients alive across micro-batches: whole (zero 0-1, pipelined) or shards (2-3)
    "gradients_single",  # the same without accumulation: created while activations are freed
    "grads_unsharded",  # gradients backward just made, in the compute dtype, before upcast or reduction (FSDP, autocast)
    "grads_transient",  # a gradient just made, before it is added in: a weight's, a tied embedding's, the embedding's
    "optimizer",  # AdamW's two fp32 moments per held parameter
    "optimizer_temp",  # the optimizer step's temporaries: a few copies of the largest parameter
    "gathered",  # FSDP: parameters gathered whole in the compute dtype (zero 1-2: the stage; 3: a block)
    "ag_buffer",  # FSDP: flat all-gather buffers, kept until the next unit's copy-out (or prefetched)
    "rs_buffer",  # FSDP: a reduce-scatter's fp32 input (whole unit) and output (its shard) buffers
    "rs_copy",  # gloo: the full-size copy of a reduce-scatter's input it reduces on (NCCL: none)
    "compute_copies",  # amp-bf16: autocast's bf16 copies of the weights (cached all step where replicated)
    "act_replicated",  # per-token activations every tp rank keeps (norm inputs, residuals)
    "act_parallel",  # per-token activations inside the tensor-parallel region (Q/K/V, MLP width)
    "act_scores",  # what attention keeps per score element (eager: softmax; fused SDPA: none)
    "act_fused",  # extra per-token tensors of decomposed / fused layers (fuse=on)
    "act_checkpointed",  # inputs of checkpointed blocks
    "act_selective",  # what selectively checkpointed blocks keep besides their input: matmul outputs
    "recompute",  # one block's activations rebuilt during its backward
    "backward_temp",  # a block's backward temporaries: MLP-wide gradients
    "score_grads",  # an attention backward's gradients of materialised scores (eager, SDPA's math fallback)
    "logits",  # per micro-batch in flight (last stage): the loss's fp32 log-softmax, a pipeline stage's output
    # (loss_parallel: the vocab / tp slice of each)
    "logits_grad",  # the loss's backward: two fp32 logits-sized gradients (log-softmax's and its input's;
    # loss_parallel: made in place of the softmax; one compute-dtype slice, the head's output or the cast,
    # and the head's backward beside it)
    "pp_recv",  # pipeline receive buffers in flight: activations (stages after the first), gradients (before the last)
    "pp_sends",  # interleaved pipelines: what a rank has sent (chunk outputs, input gradients), alive until the step ends
    "dp_buckets",  # the flat buffer gradients are averaged through (replicated data parallelism)
    "constant",  # 1 MiB units (none by default; a calibration may find some)
)

# What checkpointed blocks keep, per checkpointed block (the other activation terms: per full block).
CHECKPOINTED = frozenset({"act_checkpointed", "act_selective"})
# Activations: what forward passes keep for their backward (the logits included).
ACTIVATION_TERMS = ("act_replicated", "act_parallel", "act_scores", "act_fused", "act_checkpointed", "act_selective",
                    "logits")


def combine(events: Mapping[str, Mapping[str, float]], weights: Mapping[str, float]) -> tuple[float, str]:
    """Peak bytes of a stage: the largest weighted sum over its events, and that event."""
    best, name = -1.0, ""
    for event, terms in events.items():
        value = 0.0
        for k, v in terms.items():  # a plain loop: plan evaluates ~60k events for a 70B model
            if v:
                value += weights[k] * v
        if value > best:
            best, name = value, event
    return best, name


# How many times each term's bytes are alive at the peak, before calibration (activation weights
# follow Korthikanti et al. 2022: ~17 hidden-sized tensors per token and layer for GPT-style blocks).
DEFAULT_WEIGHTS = {
    "weights": 1.0,
    "master": 1.0,
    "gradients": 1.0,
    "gradients_single": 1.0,
    "grads_unsharded": 1.0,
    "grads_transient": 1.0,
    "optimizer": 1.0,
    "optimizer_temp": 2.0,
    "gathered": 1.0,
    "ag_buffer": 1.0,
    "rs_buffer": 1.0,
    "rs_copy": 1.0,
    "compute_copies": 1.0,
    "act_replicated": 1.0,
    "act_parallel": 1.0,
    "act_scores": 1.0,
    "act_fused": 1.0,
    "act_checkpointed": 1.0,
    "act_selective": 1.0,
    "recompute": 1.0,
    "backward_temp": 2.0,
    "score_grads": 1.0,
    "logits": 1.0,
    "logits_grad": 1.0,
    "pp_recv": 1.0,
    "pp_sends": 1.0,
    "dp_buckets": 1.0,
    # nothing of a fixed size is alive beyond the counted tensors (a real step's peak, measured):
    # a 1 MiB allowance made tiny models' predictions 13 % high on median; calibration may fit one
    "constant": 0.0,
}
# Relative, before calibration; pruning keeps a point unless even peak x (1 - this) exceeds the
# budget. Measured against every point of the recorded grids (benchmarks/data, torch's MemTracker
# on real steps), the uncalibrated model predicts -6.7 % to +18.8 % (GPT-2 tiny, world 2) and -5.1 %
# to +7.5 % (GPT-2 384-wide, world 1): a +18.8 % over-prediction needs at least 0.16.
DEFAULT_UNCERTAINTY = 0.2


@dataclass(frozen=True)
class ModelLayout:
    """The parameter and activation sizes of one model, found once from its meta-device build."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    block_sharded: int  # per block: parameters tensor parallelism splits
    block_replicated: int  # per block: parameters every tp rank keeps
    pre_sharded: int  # before the blocks (token embedding)
    pre_replicated: int  # before the blocks (positions, embedding norms)
    post_sharded: int  # after the blocks (LM head) if not tied to the embedding
    post_replicated: int  # after the blocks (final norm, head transform)
    tied_head: bool
    # the MLP's activation function as the config names it (``hidden_act`` / ``activation_function``):
    # how many element-wise passes it makes (:data:`ACTIVATION_OP_PASSES`); "" in layouts from before it
    activation: str = ""
    # measured by :func:`activation_probe`, per precision (``{"amp-bf16": {"sdpa/off/rep": ...}}``),
    # as the training step runs it: bytes one block saves for its backward per token, and per
    # attention-score element (per head, per query and key), per attention kernel
    token_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    score_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    # one line per measurement the probe could not make, and what stands in for it (textbook
    # counts, a tensor-parallel split not measured): empty when everything was measured
    probe_fallbacks: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        return (self.layers * (self.block_sharded + self.block_replicated) + self.pre_sharded
                + self.pre_replicated + self.post_sharded + self.post_replicated)


_LAYOUTS: dict[tuple[str, str, str], ModelLayout] = {}
LAYOUT_VERSION = 5  # bump when what a layout measures changes: cached layouts are then remeasured


def layout_of(config, template: Template) -> ModelLayout:
    """Measure a model from its config: which parameters sit in a block, before and after the
    blocks, and what a block keeps for its backward (:func:`activation_probe`). Only one- and
    two-block copies are built (meta device, fake tensors); blocks are alike. Cached per config."""
    import torch

    from ..models import config_fingerprint

    # a template from a user's file is known by its content too: its name and version need not change with it
    version = str(template.version) + (f"+{template.source.sha256[:12]}" if template.source else "")
    key = (config_fingerprint(config), template.name, version)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    cache = _cache_dir() / (f"layout-v{LAYOUT_VERSION}-{key[0].removeprefix('sha256:')}-{key[1]}-{key[2]}"
                            f"-torch{torch.__version__}.json")
    try:
        layout = ModelLayout(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        layout = _measure_layout(config, template)
        atomic_write_text(cache, json.dumps(asdict(layout)))
    _LAYOUTS[key] = layout
    return layout


def _measure_layout(config, template: Template) -> ModelLayout:
    import copy

    from .._pipeline import _dry_run, _topmost
    from ..models import model_from_config

    layers = config.num_hidden_layers
    small_config = copy.deepcopy(config)
    small_config.num_hidden_layers = min(2, layers)
    model = model_from_config(small_config, "meta")
    blocks_path = template.blocks_path(model)
    block0 = model.get_submodule(blocks_path)[0]

    def split(params) -> tuple[int, int]:
        params = list(params)
        sharded = sum(p.numel() for p in params if p.dim() >= 2)
        return sharded, sum(p.numel() for p in params if p.dim() < 2)

    block_sharded, block_rep = split(block0.parameters())
    calls = _dry_run(model)
    start = calls[f"{blocks_path}.0"].order
    pre, post = [], []
    for path, m in model.named_modules():
        if (not path or path not in calls or path == blocks_path or path.startswith(blocks_path + ".")
                or blocks_path.startswith(path + ".") or not any(True for _ in m.parameters())):
            continue
        (pre if calls[path].order < start else post).append(path)
    pre_params = {id(p): p for path in _topmost(pre) for p in model.get_submodule(path).parameters()}
    post_params = {id(p): p for path in _topmost(post) for p in model.get_submodule(path).parameters()}
    tied = bool(set(pre_params) & set(post_params))
    post_only = [p for k, p in post_params.items() if k not in pre_params]
    pre_sharded, pre_rep = split(pre_params.values())
    post_sharded, post_rep = split(post_only)
    heads = config.num_attention_heads
    hidden = config.hidden_size
    token_bytes, score_bytes, fallbacks = activation_probe(config, template, fusion=bool(template.has_fusion))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None) or 4 * hidden)
    gated = any(hasattr(m, "gate_proj") for _, m in block0.named_modules())
    activation = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or ""
    return ModelLayout(
        family=getattr(config, "model_type", "model"), layers=layers, hidden=hidden, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=inter, vocab=config.vocab_size, gated_mlp=gated,
        block_sharded=block_sharded, block_replicated=block_rep, pre_sharded=pre_sharded,
        pre_replicated=pre_rep, post_sharded=post_sharded, post_replicated=post_rep, tied_head=tied,
        activation=activation if isinstance(activation, str) else "",
        token_bytes=token_bytes, score_bytes=score_bytes, probe_fallbacks=fallbacks,
    )


PROBE_SEQ = (64, 128)
# the precisions the probe measures a block in: every one a workload can run (slapo_tune.precision)
PROBE_PRECISIONS = ("fp32", "amp-bf16", "bf16")
# the probe's vocabulary (rounded up to a multiple of the probed tensor-parallel degree): what a
# block keeps does not depend on it, and a real one (GPT-2's 50257) may be one tp cannot split
PROBE_VOCAB = 128


class ProbeRun(NamedTuple):
    """One forward of the probe: attention kernel, precision, sequence length."""

    attn: str
    precision: str
    seq: int


def probe_tp(config, template: Template | None = None) -> int:
    """The tensor-parallel degree the probe measures what tensor parallelism divides at: the
    smallest above 1 that divides everything a block's tensor parallelism splits (the template's
    sizes but the vocabulary, which the probe picks: heads, KV heads, MLP width); 0 if none, or if
    the template refuses tensor parallelism for this model (``Template.tp_refusal``)."""
    from dataclasses import replace

    from ..template import ModelInfo

    if template is not None and template.tp_refusal(config):
        return 0
    info = replace(ModelInfo.from_config(config), vocab=0)
    sizes = template.tp_divides(info) if template is not None else (info.heads, info.kv_heads, info.intermediate)
    return next((tp for tp in range(2, info.heads + 1) if all(n % tp == 0 for n in sizes)), 0)


def probe_config(config, layers: int, tp: int = 1):
    """A ``layers``-block copy of ``config`` for the probe: a small vocabulary ``tp`` divides (the
    per-block counts are what one block adds: the embedding and the head cancel out), and
    positions enough for :data:`PROBE_SEQ`."""
    import copy

    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    pad = getattr(config, "pad_token_id", None)
    floor = max(PROBE_VOCAB, pad + 1 if isinstance(pad, int) else 0)  # an embedding's padding index must exist
    small.vocab_size = -(-floor // tp) * tp
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < max(PROBE_SEQ):
        small.max_position_embeddings = max(PROBE_SEQ)
    return small


def probe_block(config, template: Template | None, point: Mapping[str, Any], runs: Iterable[ProbeRun], *,
                alive: bool = False, output: bool = True, layers: int | None = None, whole: bool = False,
                score_elements: dict[ProbeRun, int] | None = None) -> dict[ProbeRun, float | Exception]:
    """What the second block of a ``layers``-block copy of the model keeps for its backward, one
    training-mode forward of one sequence per run, as the training step runs it
    (:meth:`~slapo_tune.runtime.TrainStep.compute_context`): ``amp-bf16`` under autocast (its
    cached bf16 copies of the weights are the ``compute_copies`` memory term, not counted here),
    ``bf16`` with the parameters cast as :class:`~slapo_tune.precision.MasterWeights` casts them;
    scheduled for ``point`` (fusion, tensor and sequence parallelism over a fake group,
    checkpointing; the attention kernel is each run's). Fake tensors: shapes only, no compute. One
    build serves every run; each run's bytes, or what it raised.

    Counted: the storages the block's forward saves for backward that nothing before it saved
    (its input, saved by its first layer, included; parameters, and tensors earlier blocks saved
    too, such as rotary tables, excluded): what one more block adds to a model's saved bytes.
    ``alive``: the storages the block's forward creates that are still alive after the model's
    forward instead, its ``output`` included unless told: a checkpointed block saves through its
    own hooks, which hide what it keeps (a selective policy's matmul outputs) from the caller's;
    so does sequence parallelism, whose hooks keep shards of gathered tensors (always counted so).
    ``whole``: every block's and the rest of the model's, for comparison. ``score_elements``: filled
    with each run's largest element size of what the block saves in the shape of attention scores
    (``[..., seq, seq]``; 0 if none): the dtype the scores' backward runs in. ``layers``: 2, or 3 where
    the forward's alive tensors are counted: the second block is then neither the first nor the
    last, whose forwards also do the model's work at its ends (sequence parallelism scatters the
    sequence in the first block, gathers it in the last, and the last block's output is the head's
    input)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .._build import build
    from .._data_parallel import largest_module_list
    from ..models import model_from_config
    from ..precision import precision as precision_named
    from ..template import set_attention
    from ..topology import init_topology

    tp = point["tp"]
    runs = sorted(set(runs), key=lambda r: precision_named(r.precision).master)  # bf16 last: its cast is one-way
    sequence_parallel = tp > 1 and knob_value(point, "sp") == "on"
    alive = alive or sequence_parallel
    layers = layers or (3 if alive else 2)
    results: dict[ProbeRun, float | Exception] = {}
    if tp > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        try:
            topology = init_topology(pp=1, tp=tp) if tp > 1 else None  # real tensors: before the fake mode
        except Exception as exc:  # noqa: BLE001 - every run fails alike
            return dict.fromkeys(runs, exc)
        with FakeTensorMode(allow_non_fake_inputs=True):
            try:
                small = probe_config(config, layers, tp)
                if template is None:
                    model = model_from_config(small, "cpu")
                else:
                    meta = model_from_config(small, "meta")
                    meta.config.use_cache = False
                    sch = template.schedule(meta, {"ckpt_ratio": 0.0, "ckpt_policy": "full", "sp": "off",
                                                   "attn": runs[0].attn, "fuse": "off", **point, "pp": 1, "vpp": 1},
                                            topology)
                    model = build(sch, seed=0)
                model.config.use_cache = False
                model.train()
                blocks = template.blocks_path(model) if template is not None else largest_module_list(model)[0]
                block = model.get_submodule(blocks)[min(1, layers - 1)]
            except Exception as exc:  # noqa: BLE001 - every run fails alike
                return dict.fromkeys(runs, exc)
            cast = False
            for run in runs:
                try:
                    mode = precision_named(run.precision)
                    if mode.master and not cast:  # bf16 parameters, as MasterWeights makes them
                        for p in {id(p): p for p in model.parameters()}.values():
                            p.data = p.data.to(mode.param_dtype)
                        cast = True
                    set_attention(model, run.attn)
                    found: list[int] = [0]
                    results[run] = float(_block_bytes(model, block, run.seq, mode.autocast, alive, output, whole,
                                                      sequence_parallel, found))
                    if score_elements is not None:
                        score_elements[run] = found[0]
                except Exception as exc:  # noqa: BLE001 - recorded by the caller
                    results[run] = exc
    finally:
        if tp > 1:
            dist.destroy_process_group()
    return results


def _block_bytes(model, block, seq: int, autocast, alive: bool, output: bool, whole: bool,
                 sequence_parallel: bool, score_element: list[int]) -> int:
    """One forward for :func:`probe_block` (``score_element[0]``: the largest element size of the
    score-shaped tensors the block saves)."""
    import contextlib
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from .exact import fake_mask_decisions

    params = {id(p.untyped_storage()) for p in model.parameters()}
    # and buffers, autocast's copies of the parameters, and the block's output unless counted
    excluded = params | {id(b.untyped_storage()) for b in model.buffers()}
    held: list[object] = []  # storages whose ids are in a set: holding them keeps the ids unique
    state = {"inside": whole}
    saved: dict[int, object] = {}
    seen: set[int] = set()
    # every storage the forward makes, and whether the block made it (a view the block takes of an
    # earlier tensor, its input, is not the block's)
    created: dict[int, tuple[weakref.ref, bool]] = {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and id(args[0].untyped_storage()) in params):
                storage = out.untyped_storage()
                excluded.add(id(storage))
                held.append(storage)
            elif alive:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        known = created.get(id(storage))
                        if known is None or known[0]() is not storage:  # new (its id may be a dead one's)
                            created[id(storage)] = (weakref.ref(storage), state["inside"])
            return out

    def pack(t):
        storage = t.untyped_storage()
        key = id(storage)
        if key not in seen:
            seen.add(key)
            if state["inside"]:
                saved[key] = storage
        if state["inside"] and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == seq:
            score_element[0] = max(score_element[0], t.element_size())
        held.append(storage)
        return t

    def enter(*_):
        state["inside"] = True

    def leave(_module, _args, out):
        state["inside"] = whole
        if not output:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    excluded.add(id(t.untyped_storage()))
                    held.append(t.untyped_storage())

    hooks = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    stack = contextlib.ExitStack()
    try:
        if sequence_parallel:
            from ..parallelize import sequence_parallel_activations

            # as the training step runs it: gathered tensors layers save are kept as this rank's shard
            stack.enter_context(sequence_parallel_activations())
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=autocast))
        if alive or autocast is not None:
            stack.enter_context(Watch())
        if not alive:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(fake_mask_decisions())
        with stack:
            out = model(input_ids=torch.zeros(1, seq, dtype=torch.long))  # noqa: F841 - alive while counted
            if alive:
                return sum(s.nbytes() for key, (ref, inside) in created.items()
                           if inside and (s := ref()) is not None and key not in excluded)
            return sum(s.nbytes() for key, s in saved.items() if key not in excluded)
    finally:
        for h in hooks:
            h.remove()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""


def activation_probe(config, template: Template | None = None, fusion: bool = False,
                     precisions: Iterable[str] = PROBE_PRECISIONS
                     ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]], list[str]]:
    """What one block keeps for its backward, measured rather than assumed, in each precision as
    the training step runs it (:func:`probe_block`: fp32; autocast's fp32 copies kept for
    backward beside its bf16 matmul outputs; bf16): dropout masks, softmax copies, kernels that
    fall back to materialising the scores (SDPA with attention dropout), fused layers, what tensor
    parallelism really divides: all differ by family and precision.

    Per precision, a block's saved bytes at two sequence lengths give its bytes per score element
    (per head) and per token. With ``template``, the block is scheduled: per token bytes for each
    ``attn/fuse`` at tp 1 and at the smallest degree that divides a block (:func:`probe_tp`), from
    which the replicated part (``.../rep``) and the part tensor parallelism divides (``.../par``)
    follow. Returns ``({precision: {key: bytes}}, {precision: {attn: bytes}}, fallbacks)``: each
    measurement fails alone, and every one that could not be made is a line of ``fallbacks``,
    saying what stands in for it (the textbook counts where a precision's tp=1 block cannot run).

    Two more measurements, where a tensor-parallel degree runs: sequence parallelism (SDPA, per
    fusion) cuts the replicated bytes along the sequence, ``seq/<fuse>`` per token: norm inputs,
    residuals, dropout masks between the tensor-parallel regions, and the regions' inputs, which
    their first linear layers save as this rank's shard and gather again in backward (as the
    training step runs them: :func:`~slapo_tune.parallelize.sequence_parallel_activations`); and
    a selectively checkpointed block (:meth:`~slapo_tune._schedule.Schedule.checkpoint`) keeps its
    linear layers' matmul outputs besides its input, ``sel/rep`` per token on every rank
    (row-parallel outputs, partial sums before their reduction) and ``sel/par`` divided by tp
    (column-parallel outputs); its input is counted with the checkpointed inputs. Those two are
    counted by what the forward leaves alive (a checkpoint hides what it keeps from saved-tensor
    hooks).
    """
    import torch.distributed as dist

    heads = config.num_attention_heads
    s1, s2 = PROBE_SEQ
    precisions = tuple(precisions)
    attns = ("eager", "sdpa")
    fuses = ("off", "on") if fusion and template is not None else ("off",)
    fallbacks: list[str] = []
    tp = probe_tp(config, template) if template is not None else 0
    if template is not None and not tp:
        refusal = template.tp_refusal(config)
        fallbacks.append(f"tp: the template offers tp=1 only ({refusal})" if refusal else
                         "tp: no degree above 1 divides the heads, KV heads and MLP width (no tensor-parallel split "
                         "measured)")
    elif tp and dist.is_initialized():
        fallbacks.append(f"tp={tp}: not probed, this process is in a process group already (every tensor-parallel "
                         "rank counted as keeping a whole block)")
        tp = 0
    degrees = (1, tp) if tp else (1,)

    def runs(attn_kernels: Iterable[str], seqs: Iterable[int] = (s1,)) -> list[ProbeRun]:
        return [ProbeRun(a, p, s) for a in attn_kernels for p in precisions for s in seqs]

    def measure(point: Mapping[str, Any], probe_runs: list[ProbeRun], **kwargs) -> dict[ProbeRun, float | Exception]:
        """One build's runs; whatever goes wrong fails them alone (the caller records it)."""
        try:
            return probe_block(config, template, point, probe_runs, **kwargs)
        except Exception as exc:  # noqa: BLE001 - e.g. a process group that cannot start
            return dict.fromkeys(probe_runs, exc)

    # one build per scheduled block; its runs: each attention kernel and precision
    elements: dict[ProbeRun, int] = {}
    plain = {("off", 1): measure({"fuse": "off", "tp": 1}, runs(attns, (s1, s2)), score_elements=elements)}
    # the length at which score-shaped tensors are not also the heads' [seq, head_dim] ones
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    s_scores = s2 if s2 != head_dim else s1
    for fuse in fuses:
        for t in degrees:
            if (fuse, t) not in plain:
                plain[fuse, t] = measure({"fuse": fuse, "tp": t}, runs(attns))
    shards, selective = {}, {}
    s_sp = -(-s1 // tp) * tp if tp else s1  # sequence parallelism cuts the sequence in tp shards
    if template is not None:
        if tp:
            shards = {fuse: measure({"fuse": fuse, "tp": tp, "sp": "on"}, runs(("sdpa",), (s_sp,)))
                      for fuse in fuses}
        # a block's input (the previous block's output) is counted with the checkpointed inputs
        selective = {t: measure({"fuse": "off", "tp": t, "ckpt_ratio": 1.0, "ckpt_policy": "selective"},
                                runs(("sdpa",)), alive=True, output=False) for t in degrees}

    def split(whole: float, parted: float | None) -> float:
        """The replicated part of ``whole`` bytes (tp 1), given the bytes at tp ``tp``."""
        return whole if parted is None else min(whole, max(0.0, (tp * parted - whole) / (tp - 1)))

    token_bytes: dict[str, dict[str, float]] = {}
    score_bytes: dict[str, dict[str, float]] = {}
    for prec in precisions:
        def value(results: Mapping[ProbeRun, float | Exception], attn: str, seq: int, what: str,
                  instead: str) -> float | None:
            got = results.get(ProbeRun(attn, prec, seq))  # noqa: B023 - read in this iteration only
            if isinstance(got, Exception):
                line = f"{prec} {what}: {type(got).__name__}: {_first_line(got)} ({instead})"  # noqa: B023
                if line not in fallbacks:
                    fallbacks.append(line)
                return None
            return got

        tokens: dict[str, float] = {}
        scores: dict[str, float] = {}
        for attn in attns:
            per_seq = [value(plain["off", 1], attn, s, f"tp=1 attn={attn}", "textbook counts") for s in (s1, s2)]
            if None in per_seq:
                continue
            # bytes(s) = s * token + heads * s^2 * score
            scores[attn] = max(0.0, (per_seq[1] / s2 - per_seq[0] / s1) / (heads * (s2 - s1)))
            if scores[attn]:
                # their backward holds two gradients at once, in the dtype the scores are saved in
                scores[f"{attn}/grad"] = 2.0 * elements.get(ProbeRun(attn, prec, s_scores), 0)
            for fuse in fuses:
                per_tp: dict[int, float] = {}
                for t in degrees:
                    what = f"tp={t} attn={attn}" + (" fuse=on" if fuse == "on" else "")
                    instead = ("counted as kept whole by every tensor-parallel rank" if t > 1
                               else "fuse=off's counts and a textbook fused extra")
                    got = value(plain[fuse, t], attn, s1, what, instead)
                    if got is not None:
                        per_tp[t] = max(0.0, got / s1 - heads / t * s1 * scores[attn])
                if 1 in per_tp:
                    rep = split(per_tp[1], per_tp.get(tp))
                    tokens[f"{attn}/{fuse}/rep"], tokens[f"{attn}/{fuse}/par"] = rep, per_tp[1] - rep
        for fuse, results in shards.items():
            got = value(results, "sdpa", s_sp, f"tp={tp} sp=on" + (" fuse=on" if fuse == "on" else ""),
                        "textbook: every replicated byte on a sequence shard")
            if got is None or f"sdpa/{fuse}/rep" not in tokens:
                continue
            rep, par = tokens[f"sdpa/{fuse}/rep"], tokens[f"sdpa/{fuse}/par"]
            sharded = max(0.0, got / s_sp - heads / tp * s_sp * scores["sdpa"])
            # rep + par / tp without, rep - seq + seq / tp + par / tp with sequence parallelism
            tokens[f"seq/{fuse}"] = min(rep, max(0.0, (rep + par / tp - sharded) * tp / (tp - 1)))
        kept = {t: value(results, "sdpa", s1, f"tp={t} ckpt_policy=selective", "textbook counts")
                for t, results in selective.items()}
        if kept.get(1) is not None:
            rep = split(kept[1] / s1, None if kept.get(tp) is None else kept[tp] / s1)
            tokens["sel/rep"], tokens["sel/par"] = rep, kept[1] / s1 - rep
        if tokens or scores:
            token_bytes[prec], score_bytes[prec] = tokens, scores
    return token_bytes, score_bytes, fallbacks


# Bytes per parameter of the model states (slapo_tune.precision). Gradients are fp32 at every
# precision: fp32 parameters' own, bf16's master gradients, or FSDP's reduce dtype (fp32).
GRAD_BYTES = 4
SCORE_GRAD_BYTES = 8  # two fp32 gradients per attention-score element, where not measured (block_activations)
LOSS_BYTES = 4  # Hugging Face's losses upcast the logits: the log-softmax they keep is fp32 at every precision
MASTER_BYTES = 4  # bf16: fp32 master weights (MasterWeights where replicated, FSDP's fp32 shards where sharded)
SHARD_BYTES = 4  # FSDP's parameter shards are fp32 at every precision (the masters under bf16)
MOMENT_BYTES = 8  # AdamW's two fp32 moments


@functools.lru_cache(maxsize=64)
def model_state_bytes(precision_name: str, zero: int, dp: int) -> Mapping[str, float]:
    """Bytes per parameter of each model state held between steps, the closed forms of ZeRO:
    replicated fp32 / amp-bf16 16 (weights 4, gradients 4, AdamW 8), bf16 18 (bf16 weights 2,
    fp32 master 4, gradients 4, AdamW 8); sharded (``zero`` >= 1 over ``dp`` > 1 ranks) 16 / dp
    at every precision (fp32 shards 4, gradient shards 4, AdamW 8; under bf16 the shards are the
    masters and the bf16 weights exist only gathered)."""
    from ..precision import precision

    mode = precision(precision_name)
    if zero and dp > 1:
        states = {"weights": 0.0 if mode.master else SHARD_BYTES / dp, "master": MASTER_BYTES / dp if mode.master else 0.0,
                  "gradients": GRAD_BYTES / dp, "optimizer": MOMENT_BYTES / dp}
    else:
        states = {"weights": float(mode.param_bytes), "master": float(MASTER_BYTES) if mode.master else 0.0,
                  "gradients": float(GRAD_BYTES), "optimizer": float(MOMENT_BYTES)}
    return MappingProxyType(states)  # cached: read-only


def flights(point: Mapping[str, Any], stage: int, micro_batches: int) -> tuple[float, float]:
    """Micro-batches whose activations a stage holds: at most, before its first backward; and
    at most once gradients exist (after the first backward, when accumulating).

    GPipe runs every forward first; 1F1B's warm-up holds ``pp - stage``, and every later forward
    refills that many, as long as forwards remain. Interleaved (``vpp`` > 1), in micro-batches of
    the rank's whole set of stages: :func:`interleaved_warmup` chunk forwards and the first 1F1B
    step's, over ``vpp`` (rank 0: ``pp + (pp - 1) / vpp`` where 1F1B holds ``pp``).
    """
    return _flights(point["pp"], point["pipeline_schedule"], stage, micro_batches, knob_value(point, "vpp"))


def _flights(pp: int, schedule: str, stage: int, m: int, vpp: int = 1) -> tuple[float, float]:
    if pp == 1:
        return 1, 1
    if schedule == "gpipe":
        return m, max(1, m - 1)
    if vpp > 1:
        warmup, total = interleaved_warmup(pp, vpp, m, stage), m * vpp
        fresh = min(warmup + 1, total)
        # every later 1F1B step runs its forward before its backward: as many again, while forwards remain
        held = fresh if total - warmup >= 2 else max(1, total - 1)
        return fresh / vpp, held / vpp
    warmup = min(pp - stage, m)
    return warmup, warmup if m > warmup else max(1, warmup - 1)


def interleaved_warmup(pp: int, vpp: int, m: int, rank: int) -> int:
    """Chunk forwards pipeline ``rank`` runs before its first backward under torch's
    ``ScheduleInterleaved1F1B`` (``schedules._get_warmup_ops``): ``m`` micro-batches in
    ``max(1, m // pp)`` rounds of ``r = m // rounds``; the last rank runs ``(vpp - 1) r``, each rank
    before it 2 more; at most all ``m vpp``. Rank ``r``'s forward ``k`` runs its local chunk
    ``(k // r) % vpp``; each 1F1B step then runs a forward before its backward, so ``warmup + 1``
    chunks are in flight at most: ``vpp pp + pp - 1`` on rank 0 (``m`` a multiple of ``pp``),
    ``pp + (pp - 1) / vpp`` micro-batches of the rank's ``vpp`` chunks, Narayanan et al. (2021)'s
    ``pp (1 + (pp - 1) / (pp vpp))``."""
    per_round = m // max(1, m // pp)
    return min((vpp - 1) * per_round + 2 * (pp - 1 - rank), m * vpp)


@functools.lru_cache(maxsize=4096)
def interleaved_chunks_in_flight(pp: int, vpp: int, m: int, rank: int) -> tuple[int, ...]:
    """Per local chunk of ``rank``, the micro-batches whose activations it holds at the most (at the
    first 1F1B step's forward; see :func:`interleaved_warmup`)."""
    per_round = m // max(1, m // pp)
    counts = [0] * vpp
    for step in range(min(interleaved_warmup(pp, vpp, m, rank) + 1, m * vpp)):
        counts[(step // per_round) % vpp] += 1
    return tuple(counts)


def rank_blocks(total_layers: int, pp: int, rank: int, vpp: int = 1) -> list[int]:
    """The blocks pipeline ``rank`` runs, in its local order: the model is cut into ``pp * vpp``
    stages (:func:`~slapo_tune._partition.stage_block_counts`: equal, or the first and last the
    fewer) and rank ``r`` holds stages ``r, r + pp, ...``."""
    from .._partition import stage_block_range

    return [i for k in range(vpp) for i in range(*stage_block_range(total_layers, pp * vpp, rank + k * pp))]


@functools.lru_cache(maxsize=4096)
def checkpointed_per_chunk(ratio: float, total_layers: int, pp: int, rank: int, vpp: int = 1) -> tuple[int, ...]:
    """How many blocks of each of ``rank``'s ``vpp`` chunks are checkpointed (uniform spreading)."""
    from .._partition import checkpointed_indices

    chosen = set(checkpointed_indices(total_layers, ratio, "uniform"))
    blocks = rank_blocks(total_layers, pp, rank, vpp)
    chunk = len(blocks) // vpp
    return tuple(sum(1 for i in blocks[k * chunk:(k + 1) * chunk] if i in chosen) for k in range(vpp))


@functools.lru_cache(maxsize=4096)
def checkpointed_per_stage(ratio: float, total_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """How many of each pipeline rank's blocks are checkpointed (uniform spreading)."""
    return tuple(sum(checkpointed_per_chunk(ratio, total_layers, pp, s, vpp)) for s in range(pp))


@functools.lru_cache(maxsize=4096)
def checkpointed_in_flight(ratio: float, total_layers: int, pp: int, rank: int, vpp: int, micro_batches: int) -> float:
    """The checkpointed blocks of ``rank`` a micro-batch in flight holds: all of them, or
    interleaved, averaged over the chunks in flight at the most (:func:`interleaved_chunks_in_flight`)."""
    chunks = checkpointed_per_chunk(ratio, total_layers, pp, rank, vpp)
    ckpt = sum(chunks)
    if vpp > 1 and ckpt:
        counts = interleaved_chunks_in_flight(pp, vpp, micro_batches, rank)
        return vpp * sum(n * c for n, c in zip(counts, chunks)) / sum(counts)
    return ckpt


def checkpointed_count(layers_on_stage: int, ratio: float, total_layers: int, pp: int, vpp: int = 1) -> int:
    """The most checkpointed blocks on any stage (the recomputation the slowest stage does)."""
    return max(checkpointed_per_stage(ratio, total_layers, pp, vpp))


@dataclass
class StageTerms:
    stage: int
    params: int  # parameters held by the rank (its shard under sharded data parallelism)
    base: dict[str, float] = field(default_factory=dict)  # alive all step (model states, receive buffers)
    moments: dict[str, dict[str, float]] = field(default_factory=dict)  # what else is alive at each moment
    _events: dict[str, dict[str, float]] | None = field(default=None, repr=False, compare=False)

    @property
    def events(self) -> dict[str, dict[str, float]]:
        """Everything alive at each moment of the step (the base with each moment's own terms)."""
        if self._events is None:
            self._events = {name: {**self.base, **terms} for name, terms in self.moments.items()}
        return self._events

    def peak(self, weights: Mapping[str, float]) -> tuple[float, str]:
        """The largest weighted sum over the events, and that event (:func:`combine`, without
        summing the base once per event)."""
        total, name = combine(self.moments, weights)
        return total + sum(weights[k] * v for k, v in self.base.items()), name

    @property
    def terms(self) -> dict[str, float]:
        """Each term's largest byte count over the events."""
        out: dict[str, float] = {}
        for terms in self.events.values():
            for k, v in terms.items():
                if v > out.get(k, 0.0):
                    out[k] = v
        return out


class BlockActivations(NamedTuple):
    """Bytes one block keeps for its backward per micro-batch, on one rank (see :func:`block_activations`)."""

    replicated: float  # every tensor-parallel rank's (norm inputs, residuals, the regions' inputs; sp: a shard)
    parallel: float  # inside the tensor-parallel regions (Q/K/V, attention output, MLP width)
    scores: float  # per attention-score element (eager: the softmax; fused SDPA: none)
    fused: float  # decomposed / fused layers' extra tensors (fuse=on, where not probed)
    input: float  # the block's input: all a fully checkpointed block keeps, what stages receive
    selective: float  # besides its input, what a selectively checkpointed block keeps: matmul outputs
    selective_parallel: float  # the column-parallel part of ``selective`` (a plain block saves it too)
    # the gradients a block's attention backward holds at once where it materialises the scores
    score_grads: float = 0.0

    def kept(self, checkpointed: str | None = None) -> float:
        """All a block keeps: not checkpointed (None), ``"full"`` or ``"selective"``."""
        if checkpointed == "full":
            return self.input
        if checkpointed == "selective":
            return self.input + self.selective
        return self.replicated + self.parallel + self.scores + self.fused


def block_activations(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                      backend: str = "gloo") -> BlockActivations:
    """What one block of ``layout`` keeps per micro-batch under ``point``, from the activation
    probe's counts in the workload's precision, as measured (:func:`activation_probe`; textbook
    counts where it could not run, which the layout's ``probe_fallbacks`` say):
    tensor parallelism divides the ``parallel`` part and the scores; sequence parallelism (``sp``)
    the part of ``replicated`` between the regions and the block's input; a selective
    checkpoint's matmul outputs (``selective``) are there only with ``ckpt_policy`` selective.
    ``backend`` ``nccl`` (CUDA ranks): SDPA runs a fused kernel (FlashAttention-2 or the
    memory-efficient one, attention dropout included) that keeps no scores, whatever the probe's
    CPU run kept (torch's math fallback under dropout); the time model charges it as such."""
    from ..precision import precision

    tp, b, attn, fuse = point["tp"], point["micro_batch"], point["attn"], point["fuse"]
    cp = knob_value(point, "cp")
    sp = tp > 1 and knob_value(point, "sp") == "on"
    selective = point["ckpt_ratio"] > 0 and knob_value(point, "ckpt_policy") == "selective"
    mode = precision(workload.precision)
    s, B = workload.seq_len, mode.activation_bytes
    q = layout.heads * layout.head_dim
    kv = layout.kv_heads * layout.head_dim
    attn_width = 2 * q + 2 * kv  # q, k, v and the attention output
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    # context parallelism: a rank's chunk of each sequence (s / cp tokens), whose queries attend to
    # the whole sequence's keys
    tokens = b * s / cp
    # a block's saved bytes per token, measured by the probe in the workload's precision: the part
    # every tensor-parallel rank keeps and the part it divides; the textbook counts (B bytes an
    # element) where the model could not be probed in it (the layout's probe_fallbacks say why)
    measured = dict(layout.token_bytes.get(mode.measured_as, {}))
    key = f"{attn}/{fuse}"
    fused_extra = 0.0
    if f"{key}/rep" in measured:
        rep_bytes, par_bytes = measured[f"{key}/rep"], measured[f"{key}/par"]
    elif f"{attn}/off/rep" in measured:
        rep_bytes, par_bytes = measured[f"{attn}/off/rep"], measured[f"{attn}/off/par"]
        fused_extra = layout.intermediate * B if fuse == "on" else 0.0
    else:
        rep_bytes, par_bytes = B * 5 * layout.hidden, B * (attn_width + mlp_width)
        fused_extra = layout.intermediate * B if fuse == "on" else 0.0
    if mode.fp8:
        # fp8: what bf16 keeps, less what the linear layers' inputs save as FP8 casts (fp8_saved_bytes)
        rep_save, par_save = fp8_saved_bytes(layout, mode)
        rep_bytes, par_bytes = max(0.0, rep_bytes - rep_save), max(0.0, par_bytes - par_save)
        for key_ in [k for k in measured if k.startswith("seq/")]:  # the regions' inputs, kept as shards
            measured[key_] = max(0.0, measured[key_] - rep_save)
    # sequence parallelism: the replicated bytes (norm inputs, residuals, dropout masks between the
    # tensor-parallel regions, and the regions' inputs, kept as shards and gathered again in
    # backward) are on a sequence shard; the textbook count: all of them
    seq_bytes = measured.get(f"seq/{fuse}", measured.get("seq/off", rep_bytes))
    seq_bytes = min(rep_bytes, seq_bytes) if sp else 0.0
    rep_1 = tokens * (rep_bytes - seq_bytes + seq_bytes / tp)
    par_1 = tokens * par_bytes / tp
    # cp > 1: attention keeps the keys and values gathered over the whole sequence (repeated to the
    # query heads under grouped-query attention) for its backward
    gathered_width = 2 * (q if layout.kv_heads < layout.heads else kv)
    par_1 = par_1 + _pick(cp > 1, b * s * gathered_width * B / tp, 0.0)
    # selective recomputation keeps the matmul outputs of a checkpointed block (row-parallel ones
    # whole: partial sums before their reduction; column-parallel ones divided), recomputes the rest
    sel_rep = measured.get("sel/rep", B * 2 * layout.hidden)
    sel_par = measured.get("sel/par", B * (q + 2 * kv + layout.intermediate * (2 if layout.gated_mlp else 1)))
    sel_par_1 = tokens * sel_par / tp if selective else 0.0
    sel_1 = tokens * sel_rep + sel_par_1 if selective else 0.0
    materialised = scores_materialised(layout, attn, workload.precision, gpu=backend == "nccl")
    score_bytes = layout.score_bytes.get(mode.measured_as, {}).get(attn, 2.0 * B if attn == "eager" else 0.0) \
        if materialised else 0.0
    scores_1 = b * (layout.heads / tp) * (s / cp) * s * score_bytes
    # the backward of materialised scores holds two score-sized gradients at once (the softmax's
    # output's and its input's), in the dtype the softmax ran in (measured; textbook: fp32)
    grad_bytes = layout.score_bytes.get(mode.measured_as, {}).get(f"{attn}/grad", SCORE_GRAD_BYTES)
    score_grads_1 = b * (layout.heads / tp) * (s / cp) * s * grad_bytes if score_bytes else 0.0
    fused_1 = tokens * fused_extra / tp
    # a block's input: checkpointed blocks keep it, pipeline stages receive it (a sequence shard
    # under sequence parallelism); the residual stream is in the parameters' dtype (fp32 under
    # autocast, which casts only what the matrix products read)
    hidden_1 = tokens * layout.hidden * mode.param_bytes / (tp if sp else 1)
    return BlockActivations(rep_1, par_1, scores_1, fused_1, hidden_1, sel_1, sel_par_1, score_grads_1)


def fp8_saved_bytes(layout: ModelLayout, mode) -> tuple[float, float]:
    """Bytes per token one block's saved activations lose when its linear layers save FP8 casts of
    their inputs (precision fp8) instead of the compute dtype's: (the part every tensor-parallel rank
    keeps, the part tensor parallelism divides, before dividing it). Each distinct linear input is
    counted once (Q, K and V share theirs, as do a gated MLP's gate and up projections: one cast under
    torch.compile or Transformer Engine's fused layers): the attention's and the MLP's inputs (hidden
    wide, replicated), the attention output's projection input and the MLP's down projection input
    (tensor-parallel). Nothing else changes: norms, the attention core and softmax stay bf16."""
    saved = mode.activation_bytes - mode.linear_input_bytes
    return (saved * 2 * layout.hidden,
            saved * (layout.heads * layout.head_dim + layout.intermediate))


# precision fp8: the fp32 amax and scale of a linear layer's input, weight and output gradient
FP8_SCALE_BYTES = 6 * 4


def fp8_transient_bytes(layout: ModelLayout, tp: Any, blocks: Any) -> Any:
    """Precision fp8: bytes of the FP8 weight copies and scales alive at any moment of a step, on a
    rank holding ``blocks`` blocks: the FP8 cast of the largest linear weight (an MLP matrix) and
    its transposed cast for the backward's input gradient (each made when its layer runs, freed
    after), and every linear layer's amax/scale scalars (:data:`FP8_SCALE_BYTES`)."""
    linears = 4 + (3 if layout.gated_mlp else 2)  # Q, K, V, output; the MLP's
    return 2 * layout.hidden * layout.intermediate / tp + blocks * linears * FP8_SCALE_BYTES


def memory_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                 backend: str = "nccl", stages: Iterable[int] | None = None) -> list[StageTerms]:
    """The byte count of every memory term at each event of a step, per pipeline stage (of
    ``stages`` only, if given). Moments another one outweighs term by term are left out.

    Model states follow :func:`model_state_bytes`. During the step, data parallelism adds what
    its ZeRO level keeps (see :mod:`slapo_tune._data_parallel`): level 0 averages whole fp32
    gradients through flat buckets; FSDP (levels 1-3) gathers parameters in the compute dtype and
    reduce-scatters fp32 gradients through a flat input buffer per unit (the whole stage at level
    1, a block at levels 2 and 3). Level 1 keeps the stage gathered and its gradients whole until
    the step's one reduce-scatter; level 2 keeps the stage gathered from forward to the end of each
    micro-batch's backward, reducing block by block; level 3 gathers a block at a time (and
    prefetches the next). Under pipelining the schedule defers every level's reduction and
    resharding to the step's last backward. ``backend`` ``gloo`` also counts the full-size copy gloo
    makes of a reduce-scatter's input (it has no reduce-scatter of its own); NCCL reduces in place.
    """
    stage_terms = stage_builder(layout, point, workload, backend)
    return [stage_terms(stage) for stage in (range(point["pp"]) if stages is None else stages)]


def stage_builder(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                  backend: str = "nccl", acts: BlockActivations | None = None,
                  linear: bool = False) -> Callable[[int], StageTerms]:
    """:func:`memory_terms` one stage at a time: the knobs read once, a function of the stage.

    ``acts``: what a block keeps, if not ``point``'s (:func:`block_activations`, the only thing
    read of the knobs that change it). Its fields may be numpy arrays, one element per point: the
    terms are then arrays, each element the same float operations as for that point alone.

    ``linear``: every term is linear in what a block keeps (each a multiple of one of
    :class:`LinearFeatures`, or none); the terms are then the multiples, whatever a block keeps
    (:func:`linear_terms` reads them)."""
    from ..precision import precision

    # the knobs, read once (a Plan's mapping access is not free: plan evaluates ~15k points)
    tp, pp, dp, b = point["tp"], point["pp"], point["dp"], point["micro_batch"]
    zero, ratio, schedule = point["zero"], point["ckpt_ratio"], point["pipeline_schedule"]
    pipelined = _same(pp > 1)
    vpp = knob_value(point, "vpp") if pipelined else 1  # a point without it means what it always meant
    mode = precision(workload.precision)
    s, B = workload.seq_len, mode.activation_bytes
    Pb = mode.param_bytes  # what the model computes with: held (replicated) or gathered (FSDP)
    G = GRAD_BYTES
    m = accumulation(workload, dp, b)
    accumulating = _same(m > 1)
    level = _scalar(_pick(dp > 1, zero, 0))  # the ZeRO level in effect: nothing is sharded over one rank
    sharded = level > 0
    # torch's pipeline schedule turns FSDP's gradient sync and resharding after backward off until
    # the step's last backward (with one micro-batch, the first backward is the last)
    deferred = sharded and pipelined and accumulating
    gpipe = _same(schedule == "gpipe")
    # the gradients a backward makes before any were accumulated (one micro-batch: the step's only)
    grads_key = "gradients" if accumulating else "gradients_single"
    interleaved = _same(vpp > 1)
    gloo = backend == "gloo"
    state_bytes = {k: _each(lambda d, k=k: model_state_bytes(workload.precision, level, d)[k], dp)
                   for k in ("weights", "master", "optimizer")}
    tokens = b * s / knob_value(point, "cp")  # context parallelism: this rank's chunk of each sequence
    # loss_parallel: the loss in place on the head's logits (the vocabulary-parallel cross-entropy,
    # over a vocab / tp slice when tp > 1); off: Hugging Face's loss (a point without the knob: off)
    fused_loss = knob_value(point, "loss_parallel") == "on"
    vocab_shards = _pick((tp > 1) & fused_loss, tp, 1)
    if linear:
        acts = UNIT_ACTIVATIONS
    elif acts is None:
        acts = block_activations(layout, point, workload, backend)
    rep_1, par_1, scores_1, fused_1 = acts.replicated, acts.parallel, acts.scores, acts.fused
    sel_1, sel_par_1, hidden_1 = acts.selective, acts.selective_parallel, acts.input
    score_grads_1 = acts.score_grads
    # of a block's activations, the share its MLP keeps (freed once the MLP's backward is done): the
    # textbook widths' of the tensor-parallel part, half of the replicated part (one of two norms)
    attn_width = 2 * layout.heads * layout.head_dim + 2 * layout.kv_heads * layout.head_dim
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    mlp_par_share, mlp_rep_share = mlp_width / (attn_width + mlp_width), 0.5
    temp_1 = tokens * layout.intermediate / tp * B  # one MLP-wide gradient, alive in a block's backward
    block = layout.block_sharded / tp + layout.block_replicated
    largest = max(layout.block_sharded / 4, layout.pre_sharded, layout.post_sharded) / tp
    # amp-bf16: autocast's bf16 copies of the weights matrix products use. Replicated, its cache
    # keeps one per weight for the whole step; under FSDP (cache off) each micro-batch in flight
    # saves its own for backward, as an activation
    copy_bytes = B if mode.autocast_type is not None else 0
    head_matrix = (layout.pre_sharded if layout.tied_head else layout.post_sharded) / tp
    # the largest weight gradient a block's backward makes at once (an MLP matrix), alive beside
    # what is accumulated before it is added in (the same for every attention kernel and fusion:
    # points differing only in those share these terms)
    mlp_matrix = layout.hidden * layout.intermediate / tp
    embedding = layout.pre_sharded / tp
    # a tied embedding's gradient from the head, held until the embedding's backward adds its own
    tied_wait = embedding if layout.tied_head and not pipelined else 0.0

    def stage_terms(stage: int) -> StageTerms:
        first, last = _same(stage == 0), _same(stage == pp - 1)
        # the blocks this rank holds (an uneven split gives the first and last stages the fewer)
        per_stage = _each(rank_block_count, layout.layers, pp, stage, vpp)
        # the first stage's backward ends in its embedding's, which makes a dense gradient of the
        # whole table (a tied one sums it with the head's, held since the head's backward: three
        # at once), beside every other gradient made
        emb_1 = embedding * Pb * (3 if layout.tied_head and last else 1) if first else 0.0
        ckpt = _each(checkpointed_in_flight, ratio, layout.layers, pp, stage, vpp, m)
        # the checkpointed blocks' local positions: the first and the last (-1: none), how many, and
        # whether the block before the stage's last is one (one array each, for array columns)
        first_ckpt, last_ckpt, n_ckpt, before_top_ckpt, first_chunk_ckpt = _each(
            _stage_ckpt_summary, ratio, layout.layers, pp, stage, vpp)
        full = per_stage - ckpt
        ends = 0.0
        if first:
            ends += layout.pre_sharded / tp + layout.pre_replicated
        if last:
            ends += layout.post_sharded / tp + layout.post_replicated
            if layout.tied_head and not first:
                ends += layout.pre_sharded / tp  # the last stage's copy of the tied embedding
        params = per_stage * block + ends
        shard = params / dp if sharded else params
        grads = params * G  # the stage's whole fp32 gradients
        grad_shards = shard * G
        # the parameters whose gradients a last stage's backward makes first (the head, the final
        # norm, a tied embedding); an untied embedding's come after the blocks'
        head = layout.post_sharded / tp + layout.post_replicated + (layout.pre_sharded / tp if layout.tied_head else 0.0) \
            if last else 0.0
        fresh, held = _each(_flights, pp, schedule, stage, m, vpp)
        logits_fresh, logits_held = (fresh, held) if gpipe and pipelined else (1, 1)
        per_mb = _nonzero({
            "act_replicated": rep_1 * full, "act_parallel": par_1 * full, "act_scores": scores_1 * full,
            "act_fused": fused_1 * full, "act_checkpointed": hidden_1 * ckpt, "act_selective": sel_1 * ckpt,
            "compute_copies": copy_bytes * (full * layout.block_sharded / tp + (head_matrix if last else 0.0))
            if sharded else 0.0,
        })
        base = _nonzero({
            "weights": params * state_bytes["weights"], "master": params * state_bytes["master"],
            "optimizer": params * state_bytes["optimizer"],
            # receive buffers (runtime._lazy_receive_stage) are made when a receive is posted and
            # go once consumed: a received activation is its micro-batch's stage input, kept by
            # autograd while that micro-batch is in flight (every chunk but the model's first); a
            # received gradient lives through one backward (every chunk but the last). O(pp) under
            # 1F1B, whatever the micro-batch count; GPipe holds every micro-batch's
            "pp_recv": hidden_1 * (fresh * (vpp - first) + vpp - last) if pipelined else 0.0,
            "constant": 2**20,
            # fp8: the FP8 weight casts and scales (autocast's copies are amp-bf16's compute_copies)
            "compute_copies": fp8_transient_bytes(layout, tp, per_stage) if mode.fp8 else 0.0,
        })
        cache = {} if sharded or not copy_bytes else {
            "compute_copies": copy_bytes * (per_stage * layout.block_sharded / tp + (head_matrix if last else 0.0))}
        whole = params * Pb  # the stage's parameters gathered
        one = block * Pb  # one block gathered
        root = ends * Pb  # the stage root (embeddings, final norm, head): FSDP keeps it gathered all step

        def gathered(position: int, accumulated: bool) -> dict[str, float]:
            """What FSDP holds gathered while the backward runs block ``position`` (``per_stage``:
            before the stage's backward starts)."""
            if not sharded:
                return {}
            if level < 3 and (level == 1 or deferred):
                return {"gathered": whole}
            if level == 2:  # blocks stay gathered from forward until their own backward ends
                return {"gathered": _min(position + 1, per_stage) * one + root,
                        "rs_buffer": _pick(position < per_stage - 1, G * block, 0.0)}
            # level 3: the running block and the next one's all-gather buffer (prefetched); deferred,
            # what this backward gathered stays (in GPipe's later backwards, the whole stage)
            running = {"ag_buffer": _pick((position > 0) & (position < per_stage), one, 0.0)}
            if deferred:
                blocks = per_stage if accumulated and gpipe else per_stage - position
                return {"gathered": blocks * one + root, **running}
            # the input buffer of the block reduced before this one is kept until the next reduce
            return {"gathered": _pick(position < per_stage, one, 0.0) + root, **running,
                    "rs_buffer": _pick(position < per_stage - 1, G * block, 0.0)}

        def gradients(position: int, accumulated: bool) -> dict[str, float]:
            """The gradients alive while the backward runs block ``position``."""
            made = (per_stage - 1 - position) * block + head  # parameters whose gradients this backward made
            if not sharded:
                if not accumulated:
                    return {grads_key: made * G, "grads_transient": mlp_matrix * G}
                # beside the accumulated gradients, the one just made (before it is added in), and
                # what waits for the end of the backward: amp-bf16's gradients of the step's cached
                # bf16 weight copies (their casts are the first micro-batch's autograd nodes, which run
                # after everything this one made), else a tied embedding's gradient from the head,
                # held until the embedding adds its own
                if copy_bytes:
                    waiting = ((per_stage - 1 - position) * layout.block_sharded / tp + (head_matrix if last else 0.0))
                    return {"gradients": grads, "grads_unsharded": waiting * copy_bytes,
                            "grads_transient": mlp_matrix * copy_bytes}
                return {"gradients": grads, "grads_transient": (tied_wait + mlp_matrix) * Pb}
            if level == 1 or deferred:
                # whole gradients until the step's reduce-scatter, fp32 once accumulated: FSDP upcasts
                # bf16 gradients to its reduce dtype when a backward ends, so until then this
                # backward's bf16 gradients are alive beside the fp32 ones; and, as without FSDP, the
                # gradient just made and a tied embedding's from the head (autocast's copies are
                # made again each micro-batch: their gradients are added in at once)
                if not accumulated:
                    return {grads_key: made * Pb}
                return {"gradients": grads, "grads_unsharded": made * Pb if Pb != G else 0.0,
                        "grads_transient": (0.0 if Pb != G else tied_wait * Pb) + mlp_matrix * (Pb + copy_bytes)}
            # levels 2 and 3, one stage: blocks reduce-scattered as their backward ends; the running
            # block's gradients and the root's (until the root's reduce at the end) unsharded
            current = {"grads_unsharded": (block + head) * Pb}
            if accumulated:
                return {"gradients": grad_shards, **current}
            return {grads_key: (made - head) * G / dp, **current}

        def reduce_scatter(unit: float, source: float) -> dict[str, float]:
            """A unit's reduce-scatter at its largest: FSDP's fp32 input buffer, copied in from the
            ``source`` bytes of gradients (counted by the caller, except under gloo: freed by then),
            and its output; gloo reduces on a full-size copy of the input, NCCL in place (the larger
            moment is then the copy-in, unless the output outweighs the source)."""
            if gloo:
                return {"rs_buffer": unit * G * (1 + 1 / dp), "rs_copy": unit * G}
            return {"rs_buffer": unit * G + _at_least_zero(unit * G / dp - source)}

        top = per_stage - 1
        top_checkpointed = _same(last_ckpt == top)
        # a checkpointed block's backward rebuilds its activations (selective: beside the matmul
        # outputs it kept, which include the column-parallel ones a plain block saves)
        if linear:
            recompute = _pick(ckpt != 0, 1.0, 0.0)  # the coefficient of LinearFeatures' recompute
        else:
            recompute = _pick(ckpt != 0, _at_least_zero(rep_1 + par_1 + scores_1 + fused_1 - sel_par_1), 0.0)
        # under FSDP (autocast's cache off) the rebuilt block casts its weights again and keeps the copies
        recopies = _pick((ckpt != 0) & sharded, copy_bytes * layout.block_sharded / tp, 0.0)

        def after_top(flight: int) -> dict[str, float]:
            """Activations once the stage's last block has finished its backward."""
            if top_checkpointed:
                acts = {k: v * flight for k, v in per_mb.items()}
                acts["act_checkpointed"] = hidden_1 * (ckpt * flight - 1)
                acts["act_selective"] = sel_1 * (ckpt * flight - 1)
                return acts
            acts = {k: v * (flight - 1) + v * _at_least_zero(full - 1) / full for k, v in per_mb.items()
                    if k not in CHECKPOINTED}
            acts["act_checkpointed"] = hidden_1 * ckpt * flight
            acts["act_selective"] = sel_1 * ckpt * flight
            return acts

        forward = {} if not sharded else {"gathered": whole} if level < 3 else {"gathered": one + root}
        # a micro-batch's logits on the last stage: Hugging Face's loss upcasts them and keeps the
        # log-softmax for backward (fp32 at every precision; the logits themselves are freed), and a
        # pipeline stage keeps its output (the logits, in the compute dtype) until its backward ends.
        # The loss's backward makes two fp32 gradients of that size beside the log-softmax
        # Under loss_parallel the vocabulary-parallel loss keeps one fp32 softmax of the head's logits
        # (a vocab / tp slice when tp > 1: they stay sharded), its backward turning it into the
        # gradient in place: beside it, the head's output while the loss runs, then the gradient's
        # cast to the compute dtype (one compute-dtype slice either way: "logits_grad")
        loss_1 = tokens * layout.vocab / vocab_shards * LOSS_BYTES if last else 0.0
        out_1 = tokens * layout.vocab / vocab_shards * B if last and pipelined else 0.0
        logits_1 = loss_1 + out_1
        # The head's backward then runs beside that gradient: its input's gradient (the whole
        # sequence) and, when tp > 1, the all-reduced copy of it, and its weight's gradient. Without loss_parallel
        # this moment stays below the two full-width gradients before it.
        head_backward = _pick(tp > 1, 2, 1) * tokens * layout.hidden * B + head_matrix * Pb
        grad_1 = _pick(fused_loss, tokens * layout.vocab / vocab_shards * B + head_backward if last else 0.0,
                       2 * loss_1)
        events = {
            # the most micro-batches in flight, before this step's first backward: no gradients yet
            "forward": {**cache, **{k: v * fresh for k, v in per_mb.items()}, "logits": logits_1 * logits_fresh,
                        **forward},
        }
        if sharded:
            # the flat all-gather buffer of the unit just gathered and of the one before it, kept
            # until the next copy-out (level 1: the stage's one unit, until the forward ends). Levels
            # 1 and (pipelined) 2 gather the stage in the step's first forward only
            forward["ag_buffer"] = whole if level == 1 else 2 * one
            if level == 1 or (level == 2 and deferred):
                events["forward_gather"] = {**cache, **per_mb, "logits": logits_1, **forward}
            else:
                events["forward"].update(forward)
        if accumulating and level >= 2 and not deferred:
            # levels 2 and 3 gather again for every micro-batch, beside the accumulated gradient shards
            events["forward_later"] = {"gradients": grad_shards, **{k: v * held for k, v in per_mb.items()},
                                       "logits": logits_1 * logits_held, **forward}
        # the first backward runs with the most micro-batches in flight but no gradients yet; later
        # ones with gradients (accumulating) beside fewer micro-batches (as many: one stage, a
        # 1F1B stage holding fewer than all: the first backward's moments, dominated term by term,
        # are left out)
        # torch's runtime schedules (interleaved) keep what they send until the step ends (see
        # backward_last below), so the steady state's in-flight micro-batches meet more sends with
        # every step: at its end, once the last forward is done, every forward send and the sends of
        # the backwards run so far (all but the warm-up's count still to run; a rank's first chunk
        # sends none on the model's first stage)
        steady_sends = 0.0
        if interleaved and accumulating:
            left = _min(_each(interleaved_warmup, pp, vpp, m, stage), m * vpp)
            steady_sends = hidden_1 * (m * (vpp - last) + (m * vpp - left) * (vpp - first) / vpp)
        variants = [("", held, logits_held, True)] if accumulating else []
        if not accumulating or _same((fresh != held) | (logits_fresh != logits_held)):
            variants.insert(0, ("_first", fresh, logits_fresh, False))
        # interleaved with no steady state (the warm-up runs every forward): the accumulating
        # moments are the cool-down's second backward, when only the chunk the rank runs backward
        # first (its last) has made gradients, not the whole stage
        cooling = interleaved and _same(m * vpp - _each(interleaved_warmup, pp, vpp, m, stage) < 2)
        # what a backward's end frees: a micro-batch's activations, or interleaved, its chunk's
        done = 1 / vpp
        for suffix, flight, logits_flight, accumulated in variants:
            before = set(events)
            acts = {k: v * flight for k, v in per_mb.items()}
            # once the loss's backward is done, the micro-batch's log-softmax is freed
            logits = out_1 * logits_flight + loss_1 * (logits_flight - 1)
            alive = gradients(per_stage, True) if accumulated else {}
            alive.pop("grads_unsharded", None)
            alive.pop("grads_transient", None)
            # the loss of a micro-batch: its logits' gradients beside the logits
            sends = {"pp_sends": steady_sends} if accumulated and interleaved and accumulating else {}
            events["loss" + suffix] = {**cache, **alive, **acts, "logits": logits_1 * logits_flight,
                                       "logits_grad": grad_1, **gathered(per_stage, accumulated), **sends}
            # the stage's backward starts: every activation alive, the block's gradient temporaries
            events["backward_start" + suffix] = {
                **cache, **acts, "logits": logits, "backward_temp": temp_1,
                **gathered(top, accumulated), **gradients(top, accumulated), **sends}
            if not top_checkpointed and _any(score_grads_1):
                # the last block's attention backward: its MLP's activations freed, the gradients of
                # its materialised scores alive
                events["backward_attention" + suffix] = {
                    **cache, **acts, "act_replicated": rep_1 * (full * flight - mlp_rep_share),
                    "act_parallel": par_1 * (full * flight - mlp_par_share), "act_fused": fused_1 * (full * flight - 1),
                    "logits": logits, "score_grads": score_grads_1,
                    **gathered(top, accumulated), **gradients(top, accumulated), **sends}
            # The backward walks the blocks last to first, freeing each one's activations. A
            # checkpointed block is rebuilt beside the full blocks before it and the gradients of
            # the blocks after it: the last such block has the most activations beside it, the
            # first the most gradients.
            # (the checkpointed blocks up to the last one: all of them; up to the first: one)
            for name, position, inputs_before in (("backward", last_ckpt, n_ckpt), ("backward_early", first_ckpt, 1)):
                if _same(position < 0) or (name == "backward_early" and _same(position == last_ckpt)):
                    continue
                full_before = position + 1 - inputs_before
                partial = _same(full != 0)
                current = {k: v * (flight - 1) + v * full_before / full if partial else v * (flight - 1)
                           for k, v in per_mb.items() if k not in CHECKPOINTED}
                current["act_checkpointed"] = hidden_1 * (ckpt * (flight - 1) + inputs_before)
                current["act_selective"] = sel_1 * (ckpt * (flight - 1) + inputs_before)
                if _any(recopies):
                    current["compute_copies"] = current.get("compute_copies", 0.0) + recopies
                # the stage holds a micro-batch's output (the logits) until its backward is done
                events[name + suffix] = {**cache, **current, "logits": logits, "recompute": recompute,
                                         "backward_temp": temp_1, **gathered(position, accumulated),
                                         **gradients(position, accumulated), **sends}
            if not sharded and first:
                if accumulated:
                    waiting = (per_stage * layout.block_sharded / tp + (head_matrix if last else 0.0)) * copy_bytes
                    ended = {"gradients": grads, "grads_unsharded": waiting, "grads_transient": emb_1}
                else:
                    ended = {grads_key: params * G, "grads_transient": emb_1 - embedding * Pb}
                events["backward_end" + suffix] = {
                    **cache, **{k: v * (flight - done) for k, v in per_mb.items()},
                    "logits": logits_1 * (logits_flight - 1), **ended, **sends}
            if level == 1 or deferred:
                # the backward ends with every gradient of the stage made, the stage gathered, the
                # other micro-batches in flight (FSDP then upcasts bf16 gradients, or reduces)
                made = {"gradients": grads, "grads_unsharded": params * Pb if Pb != G else 0.0} \
                    if accumulated else {grads_key: params * Pb}
                # the embedding's own gradient is among those made (the first stage's only: a later
                # stage has no transient of it)
                made["grads_transient"] = emb_1 if accumulated else _at_least_zero(emb_1 - embedding * Pb)
                events["backward_end" + suffix] = {
                    **cache, **{k: v * (flight - done) for k, v in per_mb.items()},
                    "logits": logits_1 * (logits_flight - 1), "gathered": whole, **made, **sends}
            if level >= 2 and not deferred:
                # levels 2 and 3: the first reduce-scatter of the backward (the last block's, just
                # resharded), then the next block's backward beside its kept input buffer
                after = after_top(flight)
                reduced = {"gathered": top * one + root} if level == 2 else \
                    {"gathered": root, "ag_buffer": _pick(top != 0, one, 0.0)}
                # the root's gradients stay unsharded until its own reduce-scatter ends the backward
                events["backward_reduce" + suffix] = {
                    **after, **reduced, **(gradients(per_stage, True) if accumulated else {}),
                    **reduce_scatter(block, block * Pb), "grads_unsharded": head * Pb + (0.0 if gloo else block * Pb)}
                if _same(top != 0):
                    rebuilt = before_top_ckpt
                    events["backward_block" + suffix] = {
                        **after, "backward_temp": temp_1, "recompute": _pick(rebuilt, recompute, 0.0),
                        **gathered(top - 1, accumulated), **gradients(top - 1, accumulated)}
                    if _any(rebuilt & (recopies != 0)):
                        copies = events["backward_block" + suffix].get("compute_copies", 0.0)
                        events["backward_block" + suffix]["compute_copies"] = copies + _pick(rebuilt, recopies, 0.0)
            if accumulated and cooling and not sharded:
                for name in set(events) - before:
                    if "gradients" in events[name]:
                        events[name]["gradients"] = events[name]["gradients"] / vpp  # not in place: shared
        if interleaved and not sharded:
            # torch's runtime schedules (interleaved 1F1B, interleaved zero bubble) wait for their
            # sends only once the step's actions are done (_PipelineScheduleRuntime._step_microbatches):
            # every chunk output sent forward (the chunks before the model's last) and every input
            # gradient sent backward (the chunks after its first) stays alive until then. Their most
            # is at the rank's last backward, beside the stage's gradients and that backward's
            # temporaries (the first stage's: its embedding's gradient, emb_1); on the last stage also at
            # the step's last loss, the chunks still to run backward in flight (the warm-up's count)
            sent = hidden_1 * m * (2 * vpp - first - last)
            end = {**cache, "gradients": grads, "pp_sends": sent}
            end.update({"grads_transient": emb_1} if first else
                       {"backward_temp": temp_1, "grads_transient": mlp_matrix * G})
            events["backward_last"] = end
            if _same(first_chunk_ckpt != 0):
                # the rank's last backward (its first chunk's, of the step's last micro-batch) rebuilds
                # that chunk's last checkpointed block beside every send but its own (made by it)
                chunk_full = per_stage // vpp - first_chunk_ckpt
                events["backward_last_rebuild"] = {
                    **cache, **gradients(top, True), "pp_sends": sent - (0.0 if first else hidden_1),
                    "act_replicated": rep_1 * chunk_full, "act_parallel": par_1 * chunk_full,
                    "act_scores": scores_1 * chunk_full, "act_fused": fused_1 * chunk_full,
                    "act_checkpointed": hidden_1 * first_chunk_ckpt, "act_selective": sel_1 * first_chunk_ckpt,
                    "recompute": recompute, "backward_temp": temp_1}
            if last:
                waiting = _min(_each(interleaved_warmup, pp, vpp, m, stage), m * vpp - 1)
                events["loss_last"] = {**cache, "gradients": grads, "pp_sends": sent - hidden_1 * waiting,
                                       **{k: v * waiting / vpp for k, v in per_mb.items()},
                                       "logits": logits_1, "logits_grad": grad_1}
        if not sharded:
            # replicated data parallelism averages the fp32 gradients through flat buckets (a bucket
            # holds 32 MiB of gradients, or one larger gradient)
            sync = {grads_key: grads,
                    "dp_buckets": _pick(dp > 1, _min(grads, _max(DP_BUCKET_BYTES, largest * G)), 0.0)}
        elif level == 1:
            # the stage's one reduce-scatter, once its gathered parameters are freed
            unsharded = {"gradients": grads} if accumulating else {"gradients_single": params * Pb}
            sync = {**reduce_scatter(params, sum(unsharded.values())), **({} if gloo else unsharded)}
        elif deferred:
            # the step's last backward reduce-scatters block by block the gradients accumulated whole
            # (the first block's move into the reduce-scatter's input), the rest of the stage still
            # gathered: every block at level 2 and after GPipe's backwards; 1F1B's last stage has
            # just resharded everything in its last forward and gathers again
            regathered = level == 3 and not gpipe and _same(fresh == 1)
            sync = {"gradients": grads - (block * G if gloo else 0.0), **after_top(1),
                    **({"gathered": root, "ag_buffer": one} if regathered else {"gathered": whole - one}),
                    **reduce_scatter(block, block * G)}
        else:
            # the root's reduce-scatter ends the backward, beside every block's gradient shards
            sync = {grads_key: grad_shards,
                    **reduce_scatter(ends, ends * Pb), "grads_unsharded": 0.0 if gloo else ends * Pb}
        events["gradient_sync"] = sync
        # AdamW's temporaries (fp32: it steps fp32 parameters or masters), once activations are gone
        step_grads = {"gradients": grad_shards} if sharded else {grads_key: grads}
        events["optimizer"] = {"optimizer_temp": largest / (dp if sharded else 1) * 4, **step_grads}
        return StageTerms(stage, _int(shard), base, events)

    return stage_terms


def dominant_stages(layout: ModelLayout, point: Mapping[str, Any]) -> list[int]:
    """The pipeline stages one of which has the peak, whatever the (non-negative) weights: the
    first and the last, and of the stages between, the first of those checkpointing the same
    blocks. Those hold no embeddings, head or logits, so their terms differ only in what they
    checkpoint and in the micro-batches they hold, which never grow with the stage's index."""
    return list(_dominant_stages(layout.layers, point["pp"], point["ckpt_ratio"], knob_value(point, "vpp")))


@functools.lru_cache(maxsize=4096)
def _dominant_stages(layers: int, pp: int, ratio: float, vpp: int) -> tuple[int, ...]:
    chosen, seen = [0], set()
    for stage in range(1, pp - 1):
        # interleaved, too: a later rank's warm-up holds a prefix of an earlier one's chunk forwards
        # and as many blocks (an uneven split: the middle stages hold one more than the ends)
        positions = (_stage_ckpt_positions(ratio, layers, pp, stage, vpp), rank_block_count(layers, pp, stage, vpp))
        if positions not in seen:
            seen.add(positions)
            chosen.append(stage)
    return tuple(chosen + [pp - 1] if pp > 1 else chosen)


def _nonzero(terms: dict[str, float]) -> dict[str, float]:
    """The terms that hold bytes (events stay small: plan evaluates ~100k of them)."""
    return {k: v for k, v in terms.items() if (v.any() if isinstance(v, np.ndarray) else v)}


def _at_least_zero(x):
    return _max(0.0, x)


# stage_builder's knobs may be array columns, one element per row (a point and a stage) of a batch
# evaluated together (CostModel.group_verdicts): each row's terms are then the same float operations
# as its own. A branch on the knobs runs one way for all of a batch's rows, or the rows are split by
# it (_Split) and each side run apart; these helpers are the scalar code where nothing is an array.
class _Split(Exception):
    """A branch condition ``mask`` that differs between the rows of a batch: run its sides apart."""

    def __init__(self, mask: np.ndarray):
        super().__init__("rows differ in a branch")
        self.mask = mask


def by_branches(columns: dict[str, np.ndarray], run: Callable[[dict[str, np.ndarray]], Any]
                ) -> list[tuple[np.ndarray, Any]]:
    """``run`` of a batch of rows (``columns``: arrays, one element per row) as ``(rows, result)``:
    of all of them, or where a branch of ``run`` splits them (:class:`_Split`), of each side apart."""
    pending, done = [np.arange(len(next(iter(columns.values()))))], []
    while pending:
        rows = pending.pop()
        try:
            done.append((rows, run({k: v[rows] for k, v in columns.items()})))
        except _Split as split:
            pending += [rows[split.mask], rows[~split.mask]]
    return done


def _same(condition) -> bool:
    """A branch condition's truth, shared by every row of a batch (else :class:`_Split`)."""
    if isinstance(condition, np.ndarray):
        if condition.all():
            return True
        if condition.any():
            raise _Split(condition.astype(bool))
        return False
    return bool(condition)


def _scalar(value):
    """A knob-derived value every row of a batch shares, as a Python scalar (else :class:`_Split`
    by whether a row's is the first row's)."""
    if isinstance(value, np.ndarray):
        first = value.flat[0]
        if (value == first).all():
            return first.item()
        raise _Split(value == first)
    return value


def _pick(condition, if_true, if_false):
    """``if_true if condition else if_false``, row by row for a batch."""
    if isinstance(condition, np.ndarray):
        return np.where(condition, if_true, if_false)
    return if_true if condition else if_false


def _min(a, b):
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def _max(a, b):
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def _any(x) -> bool:
    """Whether a term holds bytes in any row (adding one that holds none changes no sum)."""
    return bool(x.any()) if isinstance(x, np.ndarray) else bool(x)


def _int(x):
    return x.astype(np.int64) if isinstance(x, np.ndarray) else int(x)


def _each(fn: Callable, *args):
    """``fn(*args)``, or for a batch ``fn`` of each row's scalars (once per distinct row), as an
    array (a tuple of arrays where ``fn`` returns tuples)."""
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    if not arrays:
        return fn(*args)
    n = len(arrays[0])
    if n > 512:  # the distinct rows by array operations: each column's values coded, the codes combined
        code = np.zeros(n, dtype=np.int64)
        for a in arrays:
            values, inverse = np.unique(a, return_inverse=True)
            code = code * len(values) + inverse.reshape(-1)
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        columns = [a[first].tolist() if isinstance(a, np.ndarray) else [a] * len(first) for a in args]
        results = [fn(*row) for row in zip(*columns)]
    else:  # few rows: a dictionary of the distinct ones
        columns = [a.tolist() if isinstance(a, np.ndarray) else [a] * n for a in args]
        distinct: dict[tuple, int] = {}
        inverse = np.array([distinct.setdefault(row, len(distinct)) for row in zip(*columns)])
        results = [fn(*row) for row in distinct]
    if isinstance(results[0], tuple):
        return tuple(np.array(column)[inverse] for column in zip(*results))
    return np.array(results)[inverse]


def vector_peak(st: StageTerms, weights: Mapping[str, float], n: int) -> np.ndarray:
    """:meth:`StageTerms.peak`'s total for terms that are arrays of ``n`` points (see
    :func:`stage_builder`): per point, the same float operations in the same order (a zero term
    :func:`combine` skips adds zero here)."""
    best = np.full(n, -1.0)
    for terms in st.moments.values():
        value = 0.0
        for k, v in terms.items():
            if v.__class__ is float and not v:
                continue  # adds nothing
            w = weights[k]
            value = value + (v if w == 1.0 else w * v)  # 1.0 * v is v, bit for bit
        best = np.maximum(best, value)
    return best + sum(weights[k] * v for k, v in st.base.items())


class LinearFeatures(NamedTuple):
    """What the terms of a ``linear`` :func:`stage_builder` are multiples of, for one point: a
    constant, the fields of :class:`BlockActivations` the terms read and the activations a
    checkpointed block's backward rebuilds."""

    constant: float
    replicated: float
    parallel: float
    scores: float
    fused: float
    input: float
    selective: float
    recompute: float
    score_grads: float

    @classmethod
    def of(cls, acts: BlockActivations) -> LinearFeatures:
        rebuilt = _at_least_zero(acts.replicated + acts.parallel + acts.scores + acts.fused - acts.selective_parallel)
        return cls(1.0, acts.replicated, acts.parallel, acts.scores, acts.fused, acts.input, acts.selective, rebuilt,
                   acts.score_grads)


UNIT_ACTIVATIONS = BlockActivations(*[1.0] * len(BlockActivations._fields))
# the feature (index in LinearFeatures) each term is a multiple of; every other term is a constant
LINEAR_FIELD = MappingProxyType({"act_replicated": 1, "act_parallel": 2, "act_scores": 3, "act_fused": 4,
                                 "act_checkpointed": 5, "pp_recv": 5, "pp_sends": 5, "act_selective": 6, "recompute": 7,
                                 "score_grads": 8})
_TERM_FIELD = MappingProxyType({k: LINEAR_FIELD.get(k, 0) for k in MEMORY_TERMS})


def linear_terms(st: StageTerms, weights: Mapping[str, float], n: int
                 ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The events of a ``linear`` stage (:func:`stage_builder`) of a batch of ``n`` rows as an
    (n, events, features) array: each row's events' weighted multiples of :class:`LinearFeatures`,
    the base's included, whose product with a point's features is :meth:`StageTerms.peak`'s sum
    for that event, the same products added in another order; and where a weighted term is
    negative, the array of their magnitudes (the rounding of either sum is bounded by its
    product, no more by the total's). None where a term is unknown."""
    field = _TERM_FIELD
    try:  # each term as (its feature, its weighted bytes)
        base = [(field[k], weights[k] * v) for k, v in st.base.items()]
        moments = [[(field[k], weights[k] * v) for k, v in terms.items()] for terms in st.moments.values()]
    except KeyError:  # a term without a feature or a weight
        return None

    def matrix(size: Callable = lambda t: t) -> np.ndarray:
        rows = np.zeros((n, len(LinearFeatures._fields)))
        for f, t in base:
            rows[:, f] += size(t)
        events = np.repeat(rows[:, None, :], len(moments), axis=1)
        for j, terms in enumerate(moments):
            for f, t in terms:
                events[:, j, f] += size(t)
        return events

    negative = any(np.any(t < 0) for _, t in itertools.chain(base, *moments))
    return matrix(), matrix(np.abs) if negative else None


def _ckpt_positions(point: Mapping[str, Any], layout: ModelLayout, stage: int) -> frozenset[int]:
    return _stage_ckpt_positions(point["ckpt_ratio"], layout.layers, point["pp"], stage, knob_value(point, "vpp"))


@functools.lru_cache(maxsize=4096)
def _stage_ckpt_summary(ratio: float, total_layers: int, pp: int, stage: int, vpp: int = 1
                        ) -> tuple[int, int, int, bool, int]:
    """What :func:`stage_builder` reads of a rank's checkpointed blocks: the first and the last
    local position (-1: none), how many, whether the block before the rank's last is one, and how
    many its first chunk holds."""
    positions = sorted(_stage_ckpt_positions(ratio, total_layers, pp, stage, vpp))
    top = rank_block_count(total_layers, pp, stage, vpp) - 1
    return (positions[0] if positions else -1, positions[-1] if positions else -1, len(positions),
            top - 1 in positions, checkpointed_per_chunk(ratio, total_layers, pp, stage, vpp)[0])


@functools.lru_cache(maxsize=4096)
def _stage_ckpt_positions(ratio: float, total_layers: int, pp: int, stage: int, vpp: int = 1) -> frozenset[int]:
    """The local indices (in :func:`rank_blocks` order) of the checkpointed blocks of a rank."""
    from .._partition import checkpointed_indices

    chosen = set(checkpointed_indices(total_layers, ratio, "uniform"))
    return frozenset(j for j, i in enumerate(rank_blocks(total_layers, pp, stage, vpp)) if i in chosen)


@dataclass
class MemoryPrediction:
    """Peak bytes per stage, the worst stage and its breakdown, and the model's uncertainty.

    Only the stages that can hold the peak are evaluated up front (:func:`dominant_stages`); the
    others are when ``per_stage`` is first read."""

    peaks: dict[int, int]  # peak bytes of the stages evaluated so far
    breakdown: dict[str, int]
    uncertainty: float
    params_per_rank: int
    worst_stage: int = 0
    stages: int = 1
    rest: Callable[[list[int]], dict[int, int]] | None = field(default=None, repr=False, compare=False)

    @property
    def per_stage(self) -> list[int]:
        missing = [s for s in range(self.stages) if s not in self.peaks]
        if missing:
            self.peaks.update(self.rest(missing))
        return [self.peaks[s] for s in range(self.stages)]

    @property
    def peak(self) -> int:
        return self.peaks[self.worst_stage]

    @property
    def upper(self) -> int:
        return int(self.peak * (1 + self.uncertainty))

    @property
    def lower(self) -> int:
        return optimistic(self.peak, self.uncertainty)


def optimistic(peak: float, uncertainty: float) -> int:
    """The optimistic end of a predicted peak: what pruning compares with the budget."""
    return int(peak * (1 - uncertainty))


def predict_memory(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                   weights: Mapping[str, float] | None = None,
                   uncertainty: float = DEFAULT_UNCERTAINTY, backend: str = "nccl") -> MemoryPrediction:
    w = {**DEFAULT_WEIGHTS, **(weights or {})}

    def peaks_of(stages: Iterable[int]) -> tuple[list[StageTerms], list[tuple[float, str]]]:
        terms = memory_terms(layout, point, workload, backend, stages)
        return terms, [st.peak(w) for st in terms]

    stages, peaks = peaks_of(dominant_stages(layout, point))
    worst = max(range(len(peaks)), key=lambda i: peaks[i][0])
    st, event = stages[worst], peaks[worst][1]
    breakdown = {k: int(w[k] * v) for k, v in {**st.base, **st.moments[event]}.items() if v}
    return MemoryPrediction({s.stage: int(total) for s, (total, _) in zip(stages, peaks)}, breakdown, uncertainty,
                            st.params, st.stage, point["pp"],
                            lambda missing: {s.stage: int(total) for s, (total, _) in zip(*peaks_of(missing))})


# ---------------------------------------------------------------- time
TIME_TERMS = ("compute", "attention", "elementwise", "overhead", "grad_accumulation", "tp_comm", "dp_comm", "pp_comm")
DEFAULT_TIME_WEIGHTS = {k: 1.0 for k in TIME_TERMS}


@dataclass
class TimePrediction:
    step: float  # seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)

    def throughput(self, workload: Workload) -> float:
        """Samples per second."""
        return float(samples_per_second(workload.global_batch, self.step))


def samples_per_second(global_batch: int, step: Any) -> Any:
    """Samples per second of a step of ``step`` seconds (0 where it takes none); elementwise over
    arrays of points."""
    return choose(step > 0, global_batch / choose(step > 0, step, 1.0), 0.0)


def _ring(bytes_: Any, n: Any, hw: Hardware, kind: str = "all_reduce", stride: Any = 1) -> Any:
    """A ring collective over ``n`` ranks ``stride`` apart (alpha-beta): across nodes once the
    ring spans more devices than a node holds. Elementwise over arrays of points (see
    :func:`time_columns`)."""
    spans = n * stride > hw.devices_per_node
    # the ring's ranks in one node (ranks stride apart: a node holds devices_per_node / stride of them)
    per_node = _min(n, _max(hw.devices_per_node // stride, 1))
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return choose((n <= 1) | (bytes_ <= 0), 0.0,
                  steps * hw.latency + factor * bytes_ / hw.bandwidth(n, spans, per_node))


def fsdp_collectives(level: Any, micro_batches: Any, pp: Any, schedule: Any) -> tuple[Any, Any]:
    """(all-gathers, reduce-scatters) of a stage's parameters per step at ZeRO ``level`` 1-3.

    One stage: level 1 gathers once and reduces once per step; level 2 gathers and reduces every
    micro-batch; level 3 gathers twice (forward, backward) and reduces every micro-batch. A
    pipeline defers reduction and resharding after backward to the step's last backward: level 1
    and 2 gather once; level 3 still reshards after every forward, so each forward gathers and a
    1F1B backward gathers again (GPipe's backwards all follow the last forward: one gathering).
    Elementwise over arrays of points (the first case that holds, in that order).
    """
    m = micro_batches
    one_stage = (pp == 1) | (m == 1)
    gathers = choose(level == 1, 1, choose(one_stage, choose(level == 2, m, 2 * m),
                                           choose(level == 2, 1, choose(schedule == "gpipe", m + 1, 2 * m))))
    return gathers, choose(level == 1, 1, choose(one_stage, m, 1))


# Elements a block's non-matmul kernels read and write per token in forward, in Hugging Face's eager
# code (each op a pass: it reads its inputs and writes its output), counted from the modules:
# LayerNorm is one kernel (read, write: 2 h); Llama's RMSNorm six ops in fp32 (to, pow, mean, rsqrt,
# mul, weight mul: ~12 h); two residual additions (read 2, write 1: 6 h); rotary embeddings on q and
# k (rotate_half's slices and cat, two products, a sum: ~8 per element); the MLP's activation over
# its width (:func:`activation_passes`); fused (bias + activation in one compiled kernel): one read
# and one write (2, gated 3). Eager attention adds its score passes
# per score element (scale, mask, softmax, dropout, cast: ~8); fused SDPA keeps the scores on chip.
# Backward makes about 1.5 times the forward's traffic: an op's gradient reads its saved input and
# the incoming gradient and writes one (3 passes where forward makes 2).
NORM_PASSES = {"layer": 2, "rms": 12}
RESIDUAL_PASSES = 6
ROTARY_PASSES = 8
# An activation torch runs as one kernel (exact GELU, tanh GELU as ``gelu_pytorch_tanh``, ReLU, SiLU)
# reads and writes once: 2 passes; Hugging Face's Python compositions read and write per op: GPT-2's
# ``gelu_new`` (NewGELU: mul, pow, mul, add, mul, tanh, add, mul) 18, ``gelu_fast`` (nine ops) 21,
# ``quick_gelu`` (mul, sigmoid, mul) 7. A gated MLP adds the gate's product (reads 2, writes 1)
ACTIVATION_OP_PASSES = {"gelu_new": 18, "gelu_fast": 21, "quick_gelu": 7}
ONE_KERNEL_PASSES = 2
GATE_PASSES = 3
FUSED_ACTIVATION_PASSES = {False: 2, True: 3}
SCORE_PASSES = 8
BACKWARD_TRAFFIC = 1.5
# The share of FSDP's prefetched traffic that compute hides on a GPU: half. The collectives run on
# their own streams beside the blocks' kernels but not free of them: NCCL's kernels take SMs and HBM
# bandwidth from the products they overlap, all-gathers queue behind the reduce-scatters on the one
# communicator in backward, and each prefetch waits for the memory its limiter frees. Fitted on the
# published runs not held out (benchmarks/published_runs.py), with the per-block cost and the
# products' shape efficiency (Hardware.overhead_per_layer, gemm_half_dim): 0.25-0.75 fit within a few
# per cent on median, 1.0 (everything hidden) made 13B FSDP on 8 H100s 34 % too fast
FSDP_OVERLAP = 0.5
# A GPU's fused attention (SDPA: FlashAttention-2 / memory-efficient kernels) runs its FLOPs at
# about 0.75 of a large GEMM's rate (FlashAttention-2, Dao 2023: 50-73 % of A100 peak forward and
# backward, against ~80 % for cuBLAS GEMMs)
FLASH_EFFICIENCY = 0.75


def block_traffic(layout: ModelLayout, point: Mapping[str, Any], seq_len: int, precision: str,
                  gpu: bool = False) -> Any:
    """Elements one block's memory-bound kernels read and write in forward, per token (see
    :data:`NORM_PASSES`); tensor parallelism divides what is inside its regions. On a GPU, SDPA is
    a fused kernel (no score passes); on a CPU it writes scores where the probe found them kept
    in ``precision``. Fusion saves passes on a GPU only: on a CPU the templates fuse with the eager
    backend (inductor would need a C++ toolchain and minutes of compilation per trial), which runs
    the same element-wise operators (measured on the recorded GPT-2 grid: fused / unfused step time
    1.00 on median over 58 pairs). Elementwise over arrays of points (:func:`time_columns`)."""
    tp, attn = point["tp"], point["attn"]
    gated = layout.gated_mlp
    q, kv = layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    outside = (2 * NORM_PASSES["rms" if gated else "layer"] + RESIDUAL_PASSES) * layout.hidden
    passes = FUSED_ACTIVATION_PASSES[gated], activation_passes(layout)
    inside = choose((point["fuse"] == "on") & gpu, *passes) * layout.intermediate
    if gated:
        inside += ROTARY_PASSES * (q + kv)
    kernels = set(attn.tolist()) if isinstance(attn, np.ndarray) else {attn}
    written = [a for a in kernels if scores_materialised(layout, a, precision, gpu)]
    scores = np.isin(attn, written) if isinstance(attn, np.ndarray) else attn in written
    inside += choose(scores, SCORE_PASSES * layout.heads * seq_len, 0)
    # sequence parallelism runs what is outside the regions on a sequence shard
    sp = (tp > 1) & (point["sp"] == "on")
    return outside / choose(sp, tp, 1) + inside / tp


def activation_passes(layout: ModelLayout) -> int:
    """Element-wise passes of the MLP's activation (and a gated MLP's product) per element of its
    width, unfused (see :data:`ACTIVATION_OP_PASSES`). A layout from before the activation was
    recorded (``""``) counts GPT-2's composition, or a gated MLP's SiLU."""
    name = layout.activation or ("silu" if layout.gated_mlp else "gelu_new")
    return ACTIVATION_OP_PASSES.get(name, ONE_KERNEL_PASSES) + (GATE_PASSES if layout.gated_mlp else 0)


def scores_materialised(layout: ModelLayout, attn: str, precision: str, gpu: bool = False) -> bool:
    """Does the attention kernel write the score matrix? Eager does; SDPA never on a GPU (a fused
    kernel: FlashAttention-2 or the memory-efficient one, attention dropout included), on a CPU
    where the activation probe found it keeping scores in ``precision`` (torch's math fallback:
    attention dropout)."""
    from ..precision import precision as precision_named

    if attn == "eager":
        return True
    return not gpu and layout.score_bytes.get(precision_named(precision).measured_as, {}).get(attn, 0.0) > 0


def gemm_seconds(hw: Hardware, m: Any, k: Any, n: Any, dtype_bytes: int, ranks: Any = 1, fp8: bool = False,
                 linear: bool = False) -> Any:
    """One ``m x k @ k x n`` product: a GPU's roofline (FLOPs at its large-GEMM rate, or its
    operands' bytes at memory bandwidth, whichever is longer); a CPU's measured rate by the
    product's rows (:meth:`Hardware.gemm_rate`) on a rank's share of the cores when ``ranks`` run
    on it at once: ``cores // ranks`` threads each, time-sliced when there are more ranks than cores.
    ``fp8``: FP8 operands (1 byte each, the output in ``dtype_bytes``) at the GPU's FP8 rate
    (:attr:`Hardware.fp8_flops`). ``linear``: a linear layer's product, whose smallest dimension sets
    the share of the GPU's rate it reaches (:attr:`Hardware.gemm_half_dim`); attention's batched
    products over a head's few dimensions are bound by their traffic instead (the roofline).
    Elementwise over arrays of points (:func:`time_columns`)."""
    flops = 2 * m * k * n
    if hw.cores:
        return flops / hw.gemm_rate(m, larger(1, hw.cores // ranks)) * larger(1.0, ranks / hw.cores)
    if fp8:
        if not hw.fp8_flops:
            raise ValueError(f"{hw.name} has no FP8 rate (fp8_flops)")
        traffic, rate = (m * k + k * n) + dtype_bytes * m * n, hw.fp8_flops
    else:
        traffic, rate = dtype_bytes * (m * k + k * n + m * n), hw.flops
    if linear and hw.gemm_half_dim:
        # a product's smallest dimension D sets the share of the rate its tiles reach, D^2 / (D^2 + D0^2)
        # (tiles' fixed costs and the last partial wave weigh less as the product grows; the backward's
        # two products have the same three dimensions: the same share)
        smallest = _min(_min(m, k), n) / hw.gemm_half_dim
        rate = rate * smallest**2 / (smallest**2 + 1)
    return larger(flops / rate, traffic / hw.memory_bandwidth if hw.memory_bandwidth else 0.0)


# what the time terms read of a point
TIME_KNOBS = ("tp", "pp", "cp", "sp", "dp", "zero", "micro_batch", "ckpt_ratio", "ckpt_policy", "pipeline_schedule", "vpp",
              "attn", "fuse", "loss_parallel")


def point_columns(points: Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The :data:`TIME_KNOBS` of ``points`` as one array per knob (:func:`time_columns`' input; a
    point without a knob added since means what it always meant: :data:`~slapo_tune.plan.KNOB_DEFAULTS`)."""
    points = list(points)
    return {k: np.array([knob_value(p, k) for p in points]) for k in TIME_KNOBS}


def time_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware) -> dict[str, float]:
    """Seconds per step of each time term (before weights) of one point (:func:`time_columns` of
    its knobs' values)."""
    point = {k: knob_value(point, k) for k in TIME_KNOBS}
    return {k: float(v) for k, v in time_columns(layout, point, workload, hw).items()}


def time_columns(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware) -> dict[str, Any]:
    """Seconds per step of each time term (before weights), of one point or of many at once:
    ``point`` holds a value or one array per knob of :data:`TIME_KNOBS` (:func:`point_columns`);
    the terms are then arrays of as many elements, each the float operations of that point's own
    evaluation (branches on the knobs are selections: :func:`~.hardware.choose`).

    The slowest stage's ``m + (pp - 1) / vpp`` slots (its micro-batches and the bubble) of:
    ``compute``, its blocks' and head's matrix products (by each product's shape: a GPU's
    roofline, a CPU's measured rate by rows), forward, backward (twice the forward) and the
    recomputation of checkpointed blocks; ``attention``, the attention core (eager: batched
    products at the GEMM rate; SDPA on a GPU: a fused kernel at :data:`FLASH_EFFICIENCY`);
    ``elementwise``, the memory-bound kernels' traffic (:func:`block_traffic`) at memory bandwidth;
    ``overhead``, a fixed cost per block and micro-batch and per collective call. Then
    ``grad_accumulation`` (a pass over the stage's gradients per micro-batch) and communication:
    ``tp_comm`` (not overlapped), ``pp_comm`` and ``dp_comm`` (on a GPU, what the runtime overlaps
    with compute is left out: a pipeline's steady-state sends, FSDP's prefetched gathers and
    reductions after the first and before the last).
    """
    from ..precision import precision

    mode = precision(workload.precision)
    tp, pp, dp, cp = point["tp"], point["pp"], point["dp"], point["cp"]
    b, s, B = point["micro_batch"], workload.seq_len, mode.activation_bytes
    m = accumulation(workload, dp, b)
    sp = (tp > 1) & (point["sp"] == "on")
    selective = point["ckpt_policy"] == "selective"
    vpp = choose(pp > 1, point["vpp"], 1)
    gpu = not hw.cores
    # the slowest stage: the most blocks any holds (an uneven split: one more than the ends hold)
    per_stage = -(-layout.layers // pp)
    if isinstance(pp, np.ndarray):  # few distinct (ratio, pp, vpp) of many points
        ckpt = np.array([checkpointed_count(0, r, layout.layers, n, v) for r, n, v in
                         zip(point["ckpt_ratio"].tolist(), pp.tolist(), vpp.tolist())], dtype=np.int64)
    else:
        ckpt = checkpointed_count(per_stage, point["ckpt_ratio"], layout.layers, pp, vpp)
    tokens = b * s / cp  # context parallelism: this rank's chunk of each sequence
    world = tp * pp * dp * cp
    # CPU: ranks share the cores (threads each, see gemm_seconds) and the memory bandwidth; more
    # ranks than cores time-slice
    sliced = larger(1.0, world / hw.cores) if hw.cores else 1.0
    bandwidth = hw.memory_bandwidth / sliced
    q, kv = layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    width = layout.intermediate * (2 if layout.gated_mlp else 1)
    gemm = functools.partial(gemm_seconds, hw, dtype_bytes=B, ranks=world)
    # the blocks' linear layers (forward and both backward products) in FP8 under precision fp8;
    # the LM head and the attention core in bf16
    linear_gemm = functools.partial(gemm, fp8=mode.fp8, linear=True)
    block_gemms = (linear_gemm(tokens, layout.hidden, (q + 2 * kv) / tp) + linear_gemm(tokens, q / tp, layout.hidden)
                   + linear_gemm(tokens, layout.hidden, width / tp)
                   + linear_gemm(tokens, layout.intermediate / tp, layout.hidden))
    vocab = (layout.pre_sharded if layout.tied_head else layout.post_sharded) / layout.hidden
    head_gemm = gemm(tokens, layout.hidden, vocab / tp, linear=True)
    heads = layout.heads / tp
    # SDPA on a GPU: a fused kernel, FlashAttention-2 keeps scores on chip, dropout too; else QK^T
    # and AV: per head, an s x d @ d x s and an s x s @ s x d product
    # (context parallelism: the chunk's s / cp queries against the whole sequence's s keys)
    attn_fwd = choose((point["attn"] == "sdpa") & gpu,
                        4 * b * heads * (s / cp) * s * layout.head_dim / (hw.flops * FLASH_EFFICIENCY),
                        b * heads * (gemm(s / cp, layout.head_dim, s) + gemm(s / cp, s, layout.head_dim)))
    traffic_fwd = (tokens * block_traffic(layout, point, s, workload.precision, gpu) * B / bandwidth
                   if hw.memory_bandwidth else 0.0)
    # forward and backward (twice the forward), and recomputation: a fully checkpointed block runs
    # its forward again, a selectively checkpointed one all but its matrix products
    passes = 1 + BACKWARD_TRAFFIC
    compute_mb = 3 * (per_stage * block_gemms + head_gemm) + choose(selective, 0, ckpt * block_gemms)
    attention_mb = 3 * per_stage * attn_fwd + ckpt * attn_fwd
    elementwise_mb = passes * per_stage * traffic_fwd + ckpt * traffic_fwd
    # the slowest stage's time slots: its m micro-batches and the pipeline's fill and drain, pp - 1
    # slots of a stage's work, each 1 / vpp as long when a rank's blocks are cut into vpp chunks
    # (the bubble (pp - 1) / m, interleaved (pp - 1) / (vpp m): Narayanan et al. 2021)
    slots = m + (pp - 1) / vpp
    compute, attention, elementwise = slots * compute_mb, slots * attention_mb, slots * elementwise_mb
    # a fixed cost per block and micro-batch, and per two collective calls: tensor parallelism's
    # four all-reduces per block (forward and backward), sequence parallelism's ten (below). A GPU's
    # host runs ahead of the kernels it launches, except where FSDP (ZeRO-2 and 3: a unit per block)
    # makes it wait: once per block, its hooks before and after each forward and backward
    level = choose(dp > 1, point["zero"], 0)
    calls = choose(tp > 1, choose(sp, 5, 2), 0)
    per_block = choose(level >= 2, 1, 0) if gpu else 1 + calls
    overhead = slots * per_stage * hw.overhead_per_layer * per_block
    # every micro-batch's backward writes a gradient for each of the stage's parameters and adds
    # it to the accumulated one: a pass over the stage's parameters that smaller micro-batches
    # repeat more often
    block_params = layout.block_sharded / tp + layout.block_replicated
    edges = [layout.pre_sharded / tp + layout.pre_replicated, layout.post_sharded / tp + layout.post_replicated]
    stage_params = per_stage * block_params + choose(pp == 1, sum(edges), larger(*edges))
    grad_accumulation = m * 3 * stage_params * GRAD_BYTES / bandwidth if hw.memory_bandwidth else 0.0
    act_bytes = tokens * layout.hidden * B
    # forward and backward, two regions per block: all-reduces, or under sequence parallelism as
    # many all-gathers and reduce-scatters, which move the same bytes in as many ring steps where
    # the backend reduce-scatters on a ring (NCCL); gloo's (CPU ranks) costs what an all-reduce does
    # (measured, 4 MB over 2 ranks: 8.4 ms, all-reduce 9.5, all-gather 7.6). Sequence parallelism
    # also keeps a region's input as a shard and gathers it again in backward (at least once per
    # region: separate Q, K and V projections gather it each). Tensor-parallel ranks are adjacent
    # (the mesh is (pp, dp, tp)): inside a node unless tp is larger
    scatter = _ring(act_bytes, tp, hw) if hw.cores else _ring(act_bytes, tp, hw, "reduce_scatter")
    gather = _ring(act_bytes, tp, hw, "all_gather")
    tp_comm = choose(sp, slots * per_stage * (6 * gather + 4 * scatter), slots * per_stage * 4 * _ring(act_bytes, tp, hw))
    # the last stage's LM head all-gathers each micro-batch's logits over the vocabulary; under
    # loss_parallel they stay sharded and the loss all-reduces three numbers per token instead
    sharded_loss = (tp > 1) & (point["loss_parallel"] == "on")
    tp_comm = tp_comm + m * choose(sharded_loss, 3 * _ring(tokens * 4, tp, hw),
                                   _ring(tokens * layout.vocab * B, tp, hw, "all_gather"))
    # context parallelism (counted with tp_comm: the blocks' collectives on the critical path, not
    # overlapped): each attention all-gathers K and V of the whole sequence over the cp group (ranks
    # tp apart), again when a checkpointed block recomputes, and its backward all-reduces their
    # gradients; the loss all-reduces its token count
    kv_bytes = b * s * kv / tp * B
    cp_gather = _ring(kv_bytes, cp, hw, "all_gather", stride=tp)
    cp_reduce = _ring(kv_bytes, cp, hw, "all_reduce", stride=tp)
    tp_comm = tp_comm + choose(cp > 1, 2 * slots * ((per_stage + ckpt) * cp_gather + per_stage * cp_reduce)
                               + m * _ring(4, cp, hw, stride=tp), 0.0)
    # a hidden state (a sequence shard under sequence parallelism) and its gradient cross each rank
    # boundary; interleaved, each micro-batch crosses vpp times as many. Stages are tp x dp ranks
    # apart: across nodes once that fills one. On a GPU the steady state's sends run beside compute;
    # the fill and drain's do not
    pp_bytes = choose(sp, act_bytes / tp, act_bytes)
    pp_link = choose(gpu & (tp * dp >= hw.devices_per_node), hw.inter_bandwidth, hw.intra_bandwidth)
    transfers = 2 * (pp - 1) if gpu else 2 * (vpp * m + pp - 1)
    pp_comm = choose(pp > 1, transfers * (hw.latency + pp_bytes / pp_link), 0.0)
    # data parallelism: level 0 all-reduces the fp32 gradients once per step, after the backward;
    # FSDP all-gathers the parameters in the compute dtype and reduce-scatters fp32 gradients, as
    # often as its level reshards (see memory_terms); a data-parallel group's ranks are tp apart
    dp_stride = tp
    gathers, reduces = fsdp_collectives(level, m, pp, point["pipeline_schedule"])
    gather_s = _ring(stage_params * mode.param_bytes, dp, hw, "all_gather", stride=dp_stride)
    reduce_s = _ring(stage_params * GRAD_BYTES, dp, hw, "reduce_scatter", stride=dp_stride)
    fsdp = gathers * gather_s + reduces * reduce_s
    if gpu:
        # FSDP prefetches the next block's gathers and reduces the previous block's gradients on
        # their own streams (level 2 and 3): all but one block's first gather and last reduction
        # hide behind compute, as long as there is compute to hide behind
        units = larger(1, per_stage)
        exposed = (gather_s + reduce_s) / units
        prefetched = larger(fsdp - exposed, 0.0)
        hidden_behind = FSDP_OVERLAP * (compute + attention + elementwise)
        fsdp = choose(level >= 2, exposed + larger(prefetched - hidden_behind, (1 - FSDP_OVERLAP) * prefetched), fsdp)
    dp_comm = choose(level == 0, _ring(stage_params * GRAD_BYTES, dp, hw, stride=dp_stride), fsdp)
    # context-parallel ranks sum their gradients (after FSDP's reduction: a dp shard of them)
    dp_comm = dp_comm + _ring(stage_params * GRAD_BYTES / choose(level > 0, dp, 1), cp, hw, stride=tp)
    return {"compute": compute, "attention": attention, "elementwise": elementwise, "overhead": overhead,
            "grad_accumulation": grad_accumulation, "tp_comm": tp_comm, "dp_comm": dp_comm, "pp_comm": pp_comm}


def weighted_time(terms: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> tuple[dict[str, Any], Any]:
    """The time terms weighted (calibrated weights over the defaults), and their sum: the step's
    seconds (floats, or arrays of points)."""
    w = {**DEFAULT_TIME_WEIGHTS, **(weights or {})}
    breakdown = {k: w[k] * v for k, v in terms.items()}
    return breakdown, sum(breakdown.values())


def predict_time(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                 weights: Mapping[str, float] | None = None) -> TimePrediction:
    breakdown, step = weighted_time(time_terms(layout, point, workload, hw), weights)
    return TimePrediction(step, breakdown)


def predict_steps(layout: ModelLayout, points: Mapping[str, np.ndarray], workload: Workload, hw: Hardware,
                  weights: Mapping[str, float] | None = None) -> np.ndarray:
    """:func:`predict_time`'s step seconds of many points at once (``points``: :func:`point_columns`)."""
    return weighted_time(time_columns(layout, points, workload, hw), weights)[1]


def model_flops_per_step(layout: ModelLayout, workload: Workload) -> float:
    """Useful training FLOPs of one step (6 x parameters x tokens + attention), for MFU."""
    tokens = workload.global_batch * workload.seq_len
    attn = 12 * layout.layers * layout.hidden * workload.seq_len * tokens
    return 6 * layout.parameters * tokens + attn


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf


# ---------------------------------------------------------------- published reference
# The closed forms the techniques were published with, for comparison (benchmarks.techniques, and a
# test that the analytic model moves the same way). Megatron's counts are for its fused kernels and
# 2-byte activations; the analytic model counts what Hugging Face blocks keep (the activation probe).
RECOMPUTE = ("none", "selective", "full")


def megatron_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False,
                              recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps, Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", Table 2), 16-bit activations:
    ``sbh (34 + 5as/h)`` without parallelism, ``sbh (10 + 24/t + 5as/(ht))`` with tensor
    parallelism, ``sbh/t (34 + 5as/h)`` with tensor and sequence parallelism; selective
    recomputation drops the attention-score term ``5as/h``; full recomputation keeps only the
    layer's input, ``2sbh`` (``/t`` with sequence parallelism)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def pipeline_bubble(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """The pipeline bubble's share of a step's ideal time, Narayanan et al. 2021 (§2.2): ``(p - 1) / m``
    for GPipe and 1F1B, ``(p - 1) / (v m)`` interleaved over ``v`` chunks per rank."""
    return (pp - 1) / (vpp * micro_batches)


def megatron_microbatches_in_flight(pp: int, vpp: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at the most (in micro-batches of the
    rank's whole set of layers): ``p`` under 1F1B, ``p (1 + (p - 1) / (p v))`` under the interleaved
    schedule of Narayanan et al. 2021 (§2.2.2), as Korthikanti et al. 2022 (§4.2.3) count it.
    torch's schedule, which is what runs, holds as many when the micro-batches come in whole
    rounds of ``p`` (:func:`interleaved_warmup`, :func:`flights`)."""
    return pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(pp)
