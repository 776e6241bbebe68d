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
* head-count and width attributes of the attention module are divided by tp.

Checkpointing and pipeline cuts need only the block list. Run ``slapo-tune verify`` on a new
family before tuning: the plan is a heuristic, and verify is the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slapo_tune.errors import ScheduleError
from slapo_tune.styles import Colwise, DivideAttr, ReduceInputGrad, Rowwise, VocabParallel
from slapo_tune.template import Template

if TYPE_CHECKING:  # the space needs no torch: what reads the model imports it
    from torch import nn

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads",
               "num_kv_heads", "split_size", "all_head_size", "embed_dim", "hidden_size")
_MLP_NAMES = ("mlp", "ffn", "feed_forward", "feedforward")


def _linear_order(model: nn.Module, prefix: str) -> list[str]:
    """Paths of the nn.Linear layers under ``prefix`` in the order the forward calls them."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slapo_tune._comm import communication_disabled
    from slapo_tune._pipeline import _recorded_calls

    with _recorded_calls(model) as calls, communication_disabled(), torch.no_grad(), \
            FakeTensorMode(allow_non_fake_inputs=True):
        device = next(model.parameters()).device
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and p.startswith(prefix + ".")]
    return sorted((p for p in linears if p in calls), key=lambda p: calls[p].order)


def _module_path(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((p for p, m in model.named_modules() if m is module), None) if module is not None else None


class GenericDecoderTemplate(Template):
    name = "generic"
    version = "1"
    families = ()

    def blocks_path(self, model: nn.Module) -> str:
        from slapo_tune._data_parallel import largest_module_list

        found = largest_module_list(model)
        if found is None:
            raise ScheduleError(f"generic template: {type(model).__name__} has no repeated block list (nn.ModuleList)")
        return found[0]

    def plan(self, model: nn.Module, fused: bool = False) -> dict:
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
        plan: dict = {}
        order = _linear_order(model, f"{blocks}.0")
        for name, module in (attn, mlp):
            inner = [p for p in order if p.startswith(f"{blocks}.0.{name}.")]
            if len(inner) < 2:
                raise ScheduleError(f"generic template: '{blocks}.0.{name}' has fewer than two linear layers")
            styles = [ReduceInputGrad()]
            attrs = tuple(a for a in _HEAD_ATTRS if isinstance(module.__dict__.get(a), int))
            if module is attn[1] and attrs:
                styles.insert(0, DivideAttr(*attrs))
            plan[f"{blocks}.*.{name}"] = styles
            for path in inner[:-1]:
                plan[f"{blocks}.*.{path[len(blocks) + 3:]}"] = Colwise(reduce_input_grad=False)
            plan[f"{blocks}.*.{inner[-1][len(blocks) + 3:]}"] = Rowwise()
        embed = _module_path(model, model.get_input_embeddings())
        head = _module_path(model, model.get_output_embeddings())
        if embed is None or head is None:
            raise ScheduleError("generic template: the model has no input/output embeddings to shard")
        return {embed: VocabParallel(), **plan, head: Colwise(gather_output=True)}


TEMPLATE = GenericDecoderTemplate()
