"""Llama-style decoders (also Mistral, Qwen2): separate Q/K/V, gated (SwiGLU) MLP, untied head.
Fusion: Q/K/V into one projection, gate/up into one projection that a SwiGLU kernel reads, and
fused RMSNorms (Transformer Engine's and Megatron's Llama block: slapo_tune.op)."""

from slapo_tune.styles import Colwise, ReduceInputGrad, Rowwise, VocabParallel
from slapo_tune.template import Template

BLOCKS = "model.layers"

_QKV = Colwise(reduce_input_grad=False)  # the attention module reduces its input gradient once

TP_PLAN = {
    "model.embed_tokens": VocabParallel(),
    "model.layers.*.self_attn": ReduceInputGrad(),
    "model.layers.*.self_attn.q_proj": _QKV,
    "model.layers.*.self_attn.k_proj": _QKV,
    "model.layers.*.self_attn.v_proj": _QKV,
    "model.layers.*.self_attn.o_proj": Rowwise(),
    "model.layers.*.mlp": ReduceInputGrad(),
    "model.layers.*.mlp.gate_proj": _QKV,
    "model.layers.*.mlp.up_proj": _QKV,
    "model.layers.*.mlp.down_proj": Rowwise(),
    "lm_head": Colwise(gather_output=True),
}


class LlamaTemplate(Template):
    name = "llama"
    version = "1"
    families = ("llama", "mistral", "qwen2")
    blocks = BLOCKS
    tp_plan = TP_PLAN
    fusion_groups = {
        "model.layers.*.self_attn": (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
        "model.layers.*.mlp": (("gate_proj", "up_proj"), "gate_up_proj"),
    }
    fused_norms = ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm")
    swiglu_mlps = {"model.layers.*.mlp": ("gate_up_proj", "down_proj")}


TEMPLATE = LlamaTemplate()
