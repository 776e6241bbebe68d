"""OPT: Q/K/V and fc1/fc2 with biases, learned positions, LM head tied to the token embedding.
Fusion: Q/K/V into one projection."""

from slapo_tune.styles import Colwise, DivideAttr, ReduceInputGrad, Rowwise, VocabParallel
from slapo_tune.template import Template

BLOCKS = "model.decoder.layers"

_QKV = Colwise(reduce_input_grad=False)

TP_PLAN = {
    "model.decoder.embed_tokens": VocabParallel(),
    "model.decoder.layers.*.self_attn": [DivideAttr("num_heads"), ReduceInputGrad()],
    "model.decoder.layers.*.self_attn.q_proj": _QKV,
    "model.decoder.layers.*.self_attn.k_proj": _QKV,
    "model.decoder.layers.*.self_attn.v_proj": _QKV,
    "model.decoder.layers.*.self_attn.out_proj": Rowwise(),
    "model.decoder.layers.*.fc1": Colwise(),
    "model.decoder.layers.*.fc2": Rowwise(),
    "lm_head": Colwise(gather_output=True),
}


class OPTTemplate(Template):
    name = "opt"
    version = "1"
    families = ("opt",)
    blocks = BLOCKS
    tp_plan = TP_PLAN
    fusion_groups = {"model.decoder.layers.*.self_attn": (("q_proj", "k_proj", "v_proj"), "qkv_proj")}


TEMPLATE = OPTTemplate()
