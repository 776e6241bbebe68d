"""Analytic memory and time: closed-form terms, microseconds per point.

Memory per pipeline stage is a weighted sum of *terms*, each a byte count derived from the model's
sizes and the point's knobs (tensor parallelism divides what it shards, checkpointed blocks keep
only their input, a GPipe stage holds all its micro-batches in flight, a 1F1B stage ``s`` holds
``pp - s``, the last stage also holds the logits...). The weights are how many times a term's
bytes are alive at the peak; defaults come from the textbook counts and :mod:`.calibration`
fits them to exact-mode (or measured) points per device, model family and dtype.

Time is compute (FLOPs at an achievable rate, recomputation included) plus a fixed cost per block
and micro-batch, plus tensor-parallel, data-parallel and pipeline communication (alpha-beta), with
the pipeline bubble: good enough to rank points.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .._atomic import atomic_write_text
from ..plan import Workload, accumulation
from ..template import Template
from .hardware import Hardware, _cache_dir

MEMORY_TERMS = (
    "weights",  # parameters held by the rank (sharded by tp, and by dp under zero=3)
    "gradients",  # their gradients, alive from the first micro-batch on when accumulating
    "gradients_single",  # the same without accumulation: created while activations are freed
    "optimizer",  # AdamW's two moments per held parameter
    "optimizer_temp",  # the optimizer step's temporaries: a few copies of the largest parameter
    "gathered",  # zero=3: a block (and its prefetched successor) plus the stage root, unsharded
    "act_replicated",  # per-token activations every tp rank keeps (norm inputs, residuals)
    "act_parallel",  # per-token activations inside the tensor-parallel region (Q/K/V, MLP width)
    "act_scores",  # what attention keeps per score element (eager: softmax; fused SDPA: none)
    "act_fused",  # extra per-token tensors of decomposed / fused layers (fuse=on)
    "act_checkpointed",  # inputs of checkpointed blocks
    "recompute",  # one block's activations rebuilt during its backward
    "backward_temp",  # a block's backward temporaries: MLP-wide gradients
    "logits",  # logits and the loss's softmax saved per micro-batch in flight (last stage)
    "logits_grad",  # the gradient of one micro-batch's logits (last stage, loss phase)
    "pp_recv",  # pipeline receive buffers, one per micro-batch (stages after the first)
    "dp_buckets",  # the flat buffer gradients are averaged through (replicated data parallelism)
    "constant",  # 1 MiB units (none by default; a calibration may find some)
)

# Activations: what forward passes keep for their backward (the logits included).
ACTIVATION_TERMS = ("act_replicated", "act_parallel", "act_scores", "act_fused", "act_checkpointed", "logits")


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
    "gradients": 1.0,
    "gradients_single": 1.0,
    "optimizer": 1.0,
    "optimizer_temp": 2.0,
    "gathered": 1.0,
    "act_replicated": 1.0,
    "act_parallel": 1.0,
    "act_scores": 1.0,
    "act_fused": 1.0,
    "act_checkpointed": 1.0,
    "recompute": 1.0,
    "backward_temp": 2.0,
    "logits": 2.0,
    "logits_grad": 2.0,
    "pp_recv": 1.0,
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
    # measured by :func:`activation_probe`, per attention kernel: bytes one block saves for its
    # backward per token (fp32), and per attention-score element (per head, per query and key)
    token_bytes: dict[str, float] = field(default_factory=dict)
    score_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        return (self.layers * (self.block_sharded + self.block_replicated) + self.pre_sharded
                + self.pre_replicated + self.post_sharded + self.post_replicated)


_LAYOUTS: dict[tuple[str, str, str], ModelLayout] = {}
LAYOUT_VERSION = 2  # bump when what a layout measures changes: cached layouts are then remeasured


def layout_of(config, template: Template) -> ModelLayout:
    """Measure a model from its config: which parameters sit in a block, before and after the
    blocks, and what a block keeps for its backward (:func:`activation_probe`). Only one- and
    two-block copies are built (meta device, fake tensors); blocks are alike. Cached per config."""
    import torch

    from ..models import config_fingerprint

    key = (config_fingerprint(config), template.name, str(template.version))
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
    token_bytes, score_bytes = activation_probe(config, template, fusion=bool(template.has_fusion))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None) or 4 * hidden)
    gated = any(hasattr(m, "gate_proj") for _, m in block0.named_modules())
    return ModelLayout(
        family=getattr(config, "model_type", "model"), layers=layers, hidden=hidden, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=inter, vocab=config.vocab_size, gated_mlp=gated,
        block_sharded=block_sharded, block_replicated=block_rep, pre_sharded=pre_sharded,
        pre_replicated=pre_rep, post_sharded=post_sharded, post_replicated=post_rep, tied_head=tied,
        token_bytes=token_bytes, score_bytes=score_bytes,
    )


PROBE_SEQ = (64, 128)


def _saved_bytes(config, template: Template | None, layers: int, seq: int, point: Mapping[str, Any]) -> int:
    """Bytes a ``layers``-block copy of the model, scheduled for ``point`` (attention kernel,
    fusion, tensor parallelism over a fake group), saves for its backward in one training-mode
    forward of one sequence, parameters excluded. Fake tensors: shapes only, no compute."""
    import copy

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .._build import build
    from ..models import model_from_config
    from ..template import set_attention
    from ..topology import init_topology
    from .exact import fake_mask_decisions

    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    tp = point["tp"]
    if tp > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        topology = init_topology(pp=1, tp=tp) if tp > 1 else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            if template is None:
                model = model_from_config(small, "cpu")
                set_attention(model, point["attn"])
            else:
                meta = model_from_config(small, "meta")
                meta.config.use_cache = False
                sch = template.schedule(meta, {**point, "ckpt_ratio": 0.0, "pp": 1}, topology)
                model = build(sch, seed=0)
            model.config.use_cache = False
            model.train()
            params = {id(p.untyped_storage()) for p in model.parameters()}
            saved: dict[int, tuple[object, int]] = {}

            def pack(t):
                storage = t.untyped_storage()
                if id(storage) not in params:
                    saved[id(storage)] = (storage, storage.nbytes())  # holding it keeps ids unique
                return t

            ids = torch.zeros(1, seq, dtype=torch.long)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fake_mask_decisions():
                model(input_ids=ids)
    finally:
        if tp > 1:
            dist.destroy_process_group()
    return sum(n for _, n in saved.values())


def activation_probe(config, template: Template | None = None, fusion: bool = False
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """What one block keeps for its backward, measured rather than assumed: dropout masks,
    softmax copies, kernels that fall back to materialising the scores (SDPA with attention
    dropout), fused layers, what tensor parallelism really divides: all differ by family.

    The saved bytes of a one- and a two-block copy, at two sequence lengths, give a block's bytes
    per score element (per head) and per token. With ``template``, the block is scheduled: per
    token bytes for each ``attn/fuse`` and for tp 1 and 2 (keys ``"sdpa/off/1"``...), from which
    the replicated part (``.../rep``) and the part tensor parallelism divides (``.../par``) follow.
    Returns ``({}, {})`` where the model cannot run on fake tensors (the textbook counts apply).
    """
    import torch.distributed as dist

    heads = config.num_attention_heads
    token_bytes, score_bytes = {}, {}
    s1, s2 = PROBE_SEQ
    tps = (1, 2) if template is not None and not dist.is_initialized() and heads % 2 == 0 else (1,)
    try:
        for attn in ("eager", "sdpa"):
            base = {"attn": attn, "fuse": "off", "tp": 1}
            per_block = [_saved_bytes(config, template, 2, s, base) - _saved_bytes(config, template, 1, s, base)
                         for s in (s1, s2)]
            # bytes(s) = s * token + heads * s^2 * score
            score = max(0.0, (per_block[1] / s2 - per_block[0] / s1) / (heads * (s2 - s1)))
            score_bytes[attn] = score
            for fuse in ("off", "on") if fusion and template is not None else ("off",):
                tokens = {}
                for tp in tps:
                    point = {"attn": attn, "fuse": fuse, "tp": tp}
                    block = _saved_bytes(config, template, 2, s1, point) - _saved_bytes(config, template, 1, s1, point)
                    tokens[tp] = max(0.0, block / s1 - heads / tp * s1 * score)
                rep = min(tokens[1], max(0.0, 2 * tokens[2] - tokens[1])) if 2 in tokens else tokens[1]
                token_bytes[f"{attn}/{fuse}/rep"] = rep
                token_bytes[f"{attn}/{fuse}/par"] = tokens[1] - rep
    except Exception:  # noqa: BLE001 - a model that cannot run on fake tensors keeps the textbook counts
        return {}, {}
    return token_bytes, score_bytes


from .._data_parallel import _BUCKET_BYTES as DP_BUCKET_BYTES  # noqa: E402

PARAM_BYTES = 4  # parameters and gradients are fp32 (16-bit training computes under autocast)
MOMENT_BYTES = 8  # AdamW's two fp32 moments: with them, 16 bytes of model state per parameter


def activation_bytes(name: str) -> int:
    """Bytes per element of the activations a precision keeps."""
    from ..precision import precision

    return precision(name).activation_bytes


def flights(point: Mapping[str, Any], stage: int, micro_batches: int) -> tuple[int, int]:
    """Micro-batches whose activations a stage holds: at most, before its first backward; and
    at most once gradients exist (after the first backward, when accumulating).

    GPipe runs every forward first; 1F1B's warm-up holds ``pp - stage``, and every later forward
    refills that many, as long as forwards remain.
    """
    pp, m = point["pp"], micro_batches
    if pp == 1:
        return 1, 1
    if point["pipeline_schedule"] == "gpipe":
        return m, max(1, m - 1)
    warmup = min(pp - stage, m)
    return warmup, warmup if m > warmup else max(1, warmup - 1)


@functools.lru_cache(maxsize=4096)
def checkpointed_per_stage(ratio: float, total_layers: int, pp: int) -> tuple[int, ...]:
    """How many of each pipeline stage's blocks are checkpointed (uniform spreading)."""
    from ..parallelize import checkpointed_indices

    chosen = checkpointed_indices(total_layers, ratio, "uniform")
    per_stage = total_layers // pp
    return tuple(sum(1 for i in chosen if s * per_stage <= i < (s + 1) * per_stage) for s in range(pp))


def checkpointed_count(layers_on_stage: int, ratio: float, total_layers: int, pp: int) -> int:
    """The most checkpointed blocks on any stage (the recomputation the slowest stage does)."""
    return max(checkpointed_per_stage(ratio, total_layers, pp))


@dataclass
class StageTerms:
    stage: int
    terms: dict[str, float]  # each term's largest byte count over the events
    params: int  # parameters held by the rank
    events: dict[str, dict[str, float]] = field(default_factory=dict)  # what is alive at each moment


def memory_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload) -> list[StageTerms]:
    """The byte count of every memory term, per pipeline stage."""
    tp, pp, dp = point["tp"], point["pp"], point["dp"]
    b, s, B = point["micro_batch"], workload.seq_len, activation_bytes(workload.precision)
    P = PARAM_BYTES
    m = accumulation(workload, point["dp"], point["micro_batch"])
    per_stage = layout.layers // pp
    ckpt_per_stage = checkpointed_per_stage(point["ckpt_ratio"], layout.layers, pp)
    sharded = point["zero"] == 3 and dp > 1
    zero_div = dp if sharded else 1
    q = layout.heads * layout.head_dim
    kv = layout.kv_heads * layout.head_dim
    attn_width = 2 * q + 2 * kv  # q, k, v and the attention output
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    tokens = b * s
    # a block's saved bytes per token, measured by the probe (fp32): the part every tensor-parallel
    # rank keeps and the part it divides; the textbook counts where the model could not be probed
    key = f"{point['attn']}/{point['fuse']}"
    fused_extra = 0.0
    if f"{key}/rep" in layout.token_bytes:
        rep_bytes, par_bytes = layout.token_bytes[f"{key}/rep"], layout.token_bytes[f"{key}/par"]
    elif f"{point['attn']}/off/rep" in layout.token_bytes:
        rep_bytes, par_bytes = layout.token_bytes[f"{point['attn']}/off/rep"], layout.token_bytes[f"{point['attn']}/off/par"]
        fused_extra = layout.intermediate * 4 if point["fuse"] == "on" else 0.0
    else:
        rep_bytes, par_bytes = 4 * 5 * layout.hidden, 4 * (attn_width + mlp_width)
        fused_extra = layout.intermediate * 4 if point["fuse"] == "on" else 0.0
    scale = B / 4
    rep_1 = tokens * rep_bytes * scale
    par_1 = tokens * par_bytes / tp * scale
    score_bytes = layout.score_bytes.get(point["attn"], 8.0 if point["attn"] == "eager" else 0.0)
    scores_1 = b * (layout.heads / tp) * s * s * score_bytes * scale
    fused_1 = tokens * fused_extra / tp * scale
    temp_1 = tokens * layout.intermediate / tp * B  # one MLP-wide gradient, alive in a block's backward
    hidden_1 = tokens * layout.hidden * B
    block = layout.block_sharded / tp + layout.block_replicated
    largest = max(layout.block_sharded / 4, layout.pre_sharded, layout.post_sharded) / tp
    out = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        ckpt = ckpt_per_stage[stage]
        full = per_stage - ckpt
        ends = 0.0
        if first:
            ends += layout.pre_sharded / tp + layout.pre_replicated
        if last:
            ends += layout.post_sharded / tp + layout.post_replicated
            if layout.tied_head and not first:
                ends += layout.pre_sharded / tp  # the last stage's copy of the tied embedding
        params = per_stage * block + ends
        # The pipeline schedule runs every backward of a step without FSDP's gradient sync or
        # resharding (torch.distributed.pipelining), then reduce-scatters once: until then, a
        # zero=3 rank accumulates whole gradients, and the blocks it gathered in backward stay whole.
        grads = params * P
        grad_shards = params / dp * P if sharded else 0.0
        # FSDP keeps the stage root (embeddings, head) gathered after forward; a block is gathered
        # while it runs, next to the one prefetched
        gathered_root = ends * P if sharded else 0.0
        gathered_running = (2 * block + ends) * P if sharded else 0.0
        fresh, held = flights(point, stage, m)
        logits_fresh, logits_held = (fresh, held) if point["pipeline_schedule"] == "gpipe" and pp > 1 else (1, 1)
        per_mb = {
            "act_replicated": rep_1 * full, "act_parallel": par_1 * full, "act_scores": scores_1 * full,
            "act_fused": fused_1 * full, "act_checkpointed": hidden_1 * ckpt,
        }
        base = {
            "weights": params / zero_div * P,
            "optimizer": params / zero_div * MOMENT_BYTES,
            "gathered": gathered_root,
            # torch's pipeline stages keep a receive buffer per micro-batch for the whole step
            "pp_recv": hidden_1 * m if not first else 0.0,
            "constant": 2**20,
        }
        logits_1 = tokens * layout.vocab * B if last else 0.0
        accumulated = {"gradients": grads if m > 1 else 0.0}
        events = {
            # the most micro-batches in flight, before this step's first backward: no gradients yet
            "forward": {**base, **{k: v * fresh for k, v in per_mb.items()}, "logits": logits_1 * logits_fresh,
                        "gathered": gathered_running},
        }
        recompute = (rep_1 + par_1 + scores_1 + fused_1) if ckpt else 0.0
        positions = sorted(_ckpt_positions(point, layout, stage))
        head_grads = ends * P if last else 0.0  # the first gradients a last stage's backward makes
        # the first backward runs with the most micro-batches in flight but no gradients yet; later
        # ones with gradients (accumulating) beside fewer micro-batches
        for suffix, flight, logits_flight, grads_alive in (("_first", fresh, logits_fresh, {}),
                                                            ("", held, logits_held, accumulated)):
            acts = {k: v * flight for k, v in per_mb.items()}
            # the loss of a micro-batch: its logits' gradient (and a temporary) beside the logits
            events["loss" + suffix] = {**base, **grads_alive, **acts, "logits": logits_1 * logits_flight,
                                       "logits_grad": logits_1}
            # the stage's backward starts: every activation alive, the block's gradient temporaries
            # (and, under zero=3, the block gathered with the next one prefetched)
            events["backward_start" + suffix] = {
                **base, **grads_alive, **acts, "logits": logits_1 * logits_flight, "backward_temp": temp_1,
                "gathered": gathered_running, **_fresh_gradients(m, bool(grads_alive), head_grads)}
            # The backward walks the blocks last to first, freeing each one's activations. A
            # checkpointed block is rebuilt beside the full blocks before it and the gradients of
            # the blocks after it: the last such block has the most activations beside it, the
            # first the most gradients.
            for name, position in (("backward", positions[-1] if positions else -1),
                                   ("backward_early", positions[0] if positions else -1)):
                if position < 0 or (name == "backward_early" and position == positions[-1]):
                    continue
                inputs_before = sum(1 for i in positions if i <= position)
                full_before = position + 1 - inputs_before
                after_grads = (per_stage - 1 - position) * block * P + head_grads
                current = {k: v * (flight - 1) + v * full_before / full if full else v * (flight - 1)
                           for k, v in per_mb.items() if k != "act_checkpointed"}
                current["act_checkpointed"] = hidden_1 * (ckpt * (flight - 1) + inputs_before)
                # zero=3 keeps what its backward gathered: every block from the last to this one
                gathered = (min(per_stage, per_stage - position + 1) * block + ends) * P if sharded else 0.0
                # the stage holds a micro-batch's output (the logits) until its backward is done
                events[name + suffix] = {**base, **grads_alive, **current, "logits": logits_1 * logits_flight,
                                         "recompute": recompute, "backward_temp": temp_1, "gathered": gathered,
                                         **_fresh_gradients(m, bool(grads_alive), after_grads)}
        events.update({
            # replicated data parallelism averages the gradients through flat buckets; zero=3
            # reduce-scatters them block by block, every block still gathered from its backward
            "gradient_sync": {**base, "gradients": grads + grad_shards if m > 1 else grad_shards,
                              "gradients_single": grads if m == 1 else 0.0,
                              "gathered": params * P if sharded else 0.0,
                              "dp_buckets": min(grads, DP_BUCKET_BYTES) if dp > 1 and not sharded else 0.0},
            # AdamW's temporaries, once activations are gone (zero=3: beside the gradient shards only)
            "optimizer": {**base, "optimizer_temp": largest / zero_div * P,
                          **({"gradients": grad_shards} if sharded else
                             {"gradients": grads if m > 1 else 0.0, "gradients_single": grads if m == 1 else 0.0})},
        })
        # each term at its largest (the breakdown of a stage, and what tests check in closed form)
        terms = {**base, **{k: v * fresh for k, v in per_mb.items()}, "logits": logits_1 * logits_fresh,
                 "logits_grad": logits_1, "recompute": recompute, "backward_temp": temp_1, **events["optimizer"], **accumulated,
                 "gradients_single": grads if m == 1 else 0.0, **events["gradient_sync"]}
        out.append(StageTerms(stage, terms, int(params / zero_div), events))
    return out


def _fresh_gradients(micro_batches: int, accumulated: bool, nbytes: float) -> dict[str, float]:
    """Gradients created so far in this backward, when none were accumulated before it."""
    if accumulated:
        return {}
    return {"gradients_single" if micro_batches == 1 else "gradients": nbytes}


def _ckpt_positions(point: Mapping[str, Any], layout: ModelLayout, stage: int) -> frozenset[int]:
    return _stage_ckpt_positions(point["ckpt_ratio"], layout.layers, point["pp"], stage)


@functools.lru_cache(maxsize=4096)
def _stage_ckpt_positions(ratio: float, total_layers: int, pp: int, stage: int) -> frozenset[int]:
    from ..parallelize import checkpointed_indices

    per_stage = total_layers // pp
    return frozenset(i - stage * per_stage for i in checkpointed_indices(total_layers, ratio, "uniform")
                     if stage * per_stage <= i < (stage + 1) * per_stage)


@dataclass
class MemoryPrediction:
    """Peak bytes per stage, the worst stage and its breakdown, and the model's uncertainty."""

    per_stage: list[int]
    breakdown: dict[str, int]
    uncertainty: float
    params_per_rank: int
    worst_stage: int = 0

    @property
    def peak(self) -> int:
        return max(self.per_stage)

    @property
    def upper(self) -> int:
        return int(self.peak * (1 + self.uncertainty))

    @property
    def lower(self) -> int:
        return int(self.peak * (1 - self.uncertainty))


def predict_memory(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                   weights: Mapping[str, float] | None = None,
                   uncertainty: float = DEFAULT_UNCERTAINTY) -> MemoryPrediction:
    w = {**DEFAULT_WEIGHTS, **(weights or {})}
    stages = memory_terms(layout, point, workload)
    peaks = [combine(st.events, w) for st in stages]
    totals = [total for total, _ in peaks]
    worst = max(range(len(totals)), key=totals.__getitem__)
    event = peaks[worst][1]
    breakdown = {k: int(w[k] * v) for k, v in stages[worst].events[event].items() if v}
    return MemoryPrediction([int(t) for t in totals], breakdown, uncertainty, stages[worst].params, worst)


# ---------------------------------------------------------------- time
TIME_TERMS = ("compute", "overhead", "grad_accumulation", "tp_comm", "dp_comm", "pp_comm")
DEFAULT_TIME_WEIGHTS = {k: 1.0 for k in TIME_TERMS}


@dataclass
class TimePrediction:
    step: float  # seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)

    def throughput(self, workload: Workload) -> float:
        """Samples per second."""
        return workload.global_batch / self.step if self.step > 0 else 0.0


def _ring(bytes_: float, n: int, hw: Hardware, kind: str = "all_reduce") -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    spans = n > hw.devices_per_node
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * hw.latency + factor * bytes_ / hw.bandwidth(n, spans)


def time_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware) -> dict[str, float]:
    """Seconds per step of each time term (before weights)."""
    tp, pp, dp = point["tp"], point["pp"], point["dp"]
    b, s, B = point["micro_batch"], workload.seq_len, activation_bytes(workload.precision)
    m = accumulation(workload, point["dp"], point["micro_batch"])
    per_stage = layout.layers // pp
    ckpt = checkpointed_count(per_stage, point["ckpt_ratio"], layout.layers, pp)
    tokens = b * s
    block_params = layout.block_sharded / tp + layout.block_replicated
    attn_flops = 4 * b * s * s * layout.heads * layout.head_dim / tp  # QK^T and AV, forward
    block_fwd = 2 * tokens * block_params + attn_flops
    stage_fwd = per_stage * block_fwd
    head_fwd = 2 * tokens * (layout.pre_sharded if layout.tied_head else layout.post_sharded) / tp
    flops_mb = 3 * (stage_fwd + head_fwd) + ckpt * block_fwd  # forward + backward, recomputation
    world = tp * pp * dp
    # CPU: ranks share the cores (threads each); more ranks than cores time-slice
    sliced = max(1.0, world / hw.cores) if hw.cores else 1.0
    rate = hw.gemm_rate(tokens, max(1, hw.cores // world)) / sliced
    bandwidth = hw.memory_bandwidth / sliced
    compute = (m + pp - 1) * flops_mb / rate
    overhead = (m + pp - 1) * per_stage * hw.overhead_per_layer * (1 + (2 if tp > 1 else 0))
    # every micro-batch's backward writes a gradient for each of the stage's parameters and adds
    # it to the accumulated one: a pass over the stage's parameters that smaller micro-batches
    # repeat more often
    edges = [layout.pre_sharded / tp + layout.pre_replicated, layout.post_sharded / tp + layout.post_replicated]
    stage_params = per_stage * block_params + (sum(edges) if pp == 1 else max(edges))
    grad_accumulation = m * 3 * stage_params * PARAM_BYTES / bandwidth if bandwidth else 0.0
    act_bytes = tokens * layout.hidden * B
    tp_comm = (m + pp - 1) * per_stage * 4 * _ring(act_bytes, tp, hw)
    pp_comm = 2 * (m + pp - 1) * (hw.latency + act_bytes / hw.intra_bandwidth) if pp > 1 else 0.0
    stage_param_bytes = per_stage * block_params * PARAM_BYTES
    if dp > 1 and point["zero"] == 3:
        dp_comm = (2 * m * _ring(stage_param_bytes, dp, hw, "all_gather")
                   + _ring(stage_param_bytes, dp, hw, "all_gather"))
    else:
        dp_comm = _ring(stage_param_bytes, dp, hw)
    return {"compute": compute, "overhead": overhead, "grad_accumulation": grad_accumulation, "tp_comm": tp_comm,
            "dp_comm": dp_comm, "pp_comm": pp_comm}


def predict_time(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                 weights: Mapping[str, float] | None = None) -> TimePrediction:
    w = {**DEFAULT_TIME_WEIGHTS, **(weights or {})}
    terms = time_terms(layout, point, workload, hw)
    breakdown = {k: w[k] * v for k, v in terms.items()}
    return TimePrediction(sum(breakdown.values()), breakdown)


def model_flops_per_step(layout: ModelLayout, workload: Workload) -> float:
    """Useful training FLOPs of one step (6 x parameters x tokens + attention), for MFU."""
    tokens = workload.global_batch * workload.seq_len
    attn = 12 * layout.layers * layout.hidden * workload.seq_len * tokens
    return 6 * layout.parameters * tokens + attn


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
