"""The activation probe: what one block keeps for its backward, measured rather than assumed, in
each precision as the training step runs it, on fake tensors (:func:`activation_probe`, one build
and forward per scheduled block: :func:`probe_block`). The model layout (:mod:`._layout`) records
what it finds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ..models import model_from_config
from ..plan import knob_value
from ..precision import Precision
from ..precision import precision as precision_named
from ..template import ModelInfo, Template, set_attention

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

    @property
    def mode(self) -> Precision:
        return precision_named(self.precision)


def probe_tp(config: Any, template: Template | None = None) -> int:
    """The tensor-parallel degree the probe measures what tensor parallelism divides at: the
    smallest above 1 that divides everything a block's tensor parallelism splits (the template's
    sizes but the vocabulary, which the probe picks: heads, KV heads, MLP width); 0 if none, or if
    the template refuses tensor parallelism for this model (``Template.tp_refusal``)."""
    from dataclasses import replace

    if template is not None and template.tp_refusal(config):
        return 0
    info = replace(ModelInfo.from_config(config), vocab=0)
    sizes = template.tp_divides(info) if template is not None else (info.heads, info.kv_heads, info.intermediate)
    return next((tp for tp in range(2, info.heads + 1) if all(n % tp == 0 for n in sizes)), 0)


def probe_config(config: Any, layers: int, tp: int = 1) -> Any:
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


def probe_block(config: Any, template: Template | None, point: Mapping[str, Any], runs: Iterable[ProbeRun], *,
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

    # torch-free: plan and every --help import this module; these import torch
    from ..parallel._data_parallel import largest_module_list
    from ..schedule._build import build
    from ..topology import init_topology

    tp = point["tp"]
    runs = sorted(set(runs), key=lambda r: r.mode.master)  # bf16 last: its cast is one-way
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
                    mode = run.mode
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

    # torch-free: plan and every --help import this module; .exact imports torch
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
            # torch-free: plan and every --help import this module; parallelize imports torch
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


def activation_probe(config: Any, template: Template | None = None, fusion: bool = False,
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
    a selectively checkpointed block (:meth:`~slapo_tune.schedule._schedule.Schedule.checkpoint`) keeps its
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
