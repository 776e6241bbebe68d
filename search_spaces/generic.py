"""The generic decoder template: a plan found by inspecting the module tree.

For a decoder family nobody wrote a template for, the tensor-parallel plan is derived from one
shape-only forward pass (``FakeTensorMode``) of the model:

* the repeated block list is the ``nn.ModuleList`` holding the most parameters;
* in the first block, the child whose class name says *attention* and the child that is the MLP
  (*MLP*, *FeedForward*, ``mlp``/``ffn``); in each, the linear layers in the order they run: the
  last one projects back to the hidden size (row parallel), the others are column parallel, and
  the module reduces its input gradient once;
* the input embedding (``get_input_embeddings``) is vocabulary parallel, the output embedding
  (``get_output_embeddings``) column parallel with its output gathered;
* head-count and width attributes of the attention module are divided by tp;
* a fused projection (Q|K|V in one linear, gate|up in one) is recognised in the same forward by the
  first use of its output: cut along its features rather than viewed as heads. Cut into equal
  parts relative to its own width (``chunk(n)``: Phi-3's and GLM's gate|up), it is sharded part by
  part (``Colwise(num_fused=n)``), so each rank's shard is cut into its own parts. Cut at fixed
  offsets (slices, ``split(sizes)``: Phi-3's Q|K|V at offsets from its config), a shard would be
  cut at the full model's offsets: the template refuses tp > 1 for the model with the reason, and
  the space offers tp=1 only. (GPT-NeoX's fused QKV is viewed head by head first: each rank's
  columns are whole heads, and it is sharded as any column-parallel layer.)

Checkpointing and pipeline cuts need only the block list. Run ``slapo-tune verify`` on a new
family before tuning: the plan is a heuristic, and verify is the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slapo_tune.errors import ScheduleError
from slapo_tune.models import config_fingerprint, model_from_config
from slapo_tune.styles import Colwise, DivideAttr, ReduceInputGrad, Rowwise, Unshardable, VocabParallel
from slapo_tune.template import Template

if TYPE_CHECKING:  # the space needs no torch: what reads the model imports it
    from torch import nn

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads",
               "num_kv_heads", "split_size", "all_head_size", "embed_dim", "hidden_size")
_MLP_NAMES = ("mlp", "ffn", "feed_forward", "feedforward")


def _module_path(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((p for p, m in model.named_modules() if m is module), None) if module is not None else None


class GenericDecoderTemplate(Template):
    name = "generic"
    version = "1"
    families = ()

    def blocks_path(self, model: nn.Module) -> str:
        # torch-free: plan, space and every --help import this module; _data_parallel imports torch
        from slapo_tune.parallel._data_parallel import largest_module_list

        found = largest_module_list(model)
        if found is None:
            raise ScheduleError(f"generic template: {type(model).__name__} has no repeated block list (nn.ModuleList)")
        return found[0]

    def tp_refusal(self, config) -> str:
        return _tp_refusal(self, config)

    def tensor_parallel_plan(self, model: nn.Module, fused: bool = False) -> dict:
        blocks = self.blocks_path(model)
        first = model.get_submodule(f"{blocks}.0")
        attn = next(((n, m) for n, m in first.named_children() if "attention" in type(m).__name__.lower()
                     or n in ("attn", "attention", "self_attn")), None)
        mlp = next(((n, m) for n, m in first.named_children() if n in _MLP_NAMES
                    or any(k in type(m).__name__.lower() for k in ("mlp", "feedforward"))), None)
        if attn is None or mlp is None:
            raise ScheduleError(
                f"generic template: cannot find the attention and MLP modules in '{blocks}.0' "
                f"(children: {', '.join(n for n, _ in first.named_children())}); write a template"
            )
        # torch-free: plan, space and every --help import this module; _shape_walk imports torch
        from ._shape_walk import shape_walk

        plan: dict = {}
        order, fused_parts = shape_walk(model, f"{blocks}.0")
        for name, module in (attn, mlp):
            inner = [p for p in order if p.startswith(f"{blocks}.0.{name}.")]
            if len(inner) < 2:
                raise ScheduleError(f"generic template: '{blocks}.0.{name}' has fewer than two linear layers")
            styles = [ReduceInputGrad()]
            attrs = tuple(a for a in _HEAD_ATTRS if isinstance(module.__dict__.get(a), int))
            if module is attn[1] and attrs:
                styles.insert(0, DivideAttr(*attrs))
            plan[f"{blocks}.*.{name}"] = styles
            width = model.get_submodule(inner[-1]).in_features  # what the parts are split back to
            for path in inner[:-1]:
                key = f"{blocks}.*.{path[len(blocks) + 3:]}"
                cut = fused_parts.get(path)
                if cut is None or cut.parts is not None:  # plain, or cut into equal parts: each sharded
                    plan[key] = Colwise(reduce_input_grad=False, num_fused=1 if cut is None else cut.parts)
                else:
                    out = model.get_submodule(path).out_features
                    plan[key] = Unshardable(
                        f"'{key}' is a fused projection ({out} output features for a width of {width}) that "
                        f"the model {cut.how}, which a shard would not shrink: tp=1 only, or write a template "
                        "that shards it with Colwise(num_fused=[...]) and divides those offsets")
            plan[f"{blocks}.*.{inner[-1][len(blocks) + 3:]}"] = Rowwise()
        embed = _module_path(model, model.get_input_embeddings())
        head = _module_path(model, model.get_output_embeddings())
        if embed is None or head is None:
            raise ScheduleError("generic template: the model has no input/output embeddings to shard")
        return {embed: VocabParallel(), **plan, head: Colwise(gather_output=True)}


def _tp_refusal(template: GenericDecoderTemplate, config) -> str:
    """The reasons the tensor-parallel plan of ``config``'s model (built on the meta device) cannot be sharded."""
    key = config_fingerprint(config)
    if key not in _REFUSALS:
        try:
            plan = template.tensor_parallel_plan(model_from_config(config, device="meta"))
        except Exception:  # noqa: BLE001 - no plan at all: applying the template says why, with the path
            plan = {}
        _REFUSALS[key] = "; ".join(s.reason for s in plan.values() if isinstance(s, Unshardable))
    return _REFUSALS[key]


_REFUSALS: dict[str, str] = {}  # config fingerprint -> refusal (a shape-only forward per model)

TEMPLATE = GenericDecoderTemplate()
