"""GPT-2: fused QKV in one Conv1D (weights stored [in, out]), LM head tied to the token embedding.
Fusion: the MLP's bias addition and GELU fused into one call (``decompose`` + pattern)."""

from __future__ import annotations

from slapo_tune.styles import Colwise, DivideAttr, ReduceInputGrad, Rowwise, VocabParallel
from slapo_tune.template import Template

BLOCKS = "transformer.h"

TP_PLAN = {
    "transformer.wte": VocabParallel(),  # also shards the tied lm_head.weight
    # the input gradient is reduced (under sequence parallelism: the sequence gathered) at the
    # attention module, which sees the hidden state as the block holds it
    "transformer.h.*.attn": [DivideAttr("split_size", "num_heads"), ReduceInputGrad()],
    "transformer.h.*.attn.c_attn": Colwise(num_fused=3, reduce_input_grad=False),
    "transformer.h.*.attn.c_proj": Rowwise(),
    # reduced at the MLP input, so c_fc can be decomposed and traced through for fusion
    "transformer.h.*.mlp": ReduceInputGrad(),
    "transformer.h.*.mlp.c_fc": Colwise(reduce_input_grad=False),
    "transformer.h.*.mlp.c_proj": Rowwise(),
    "lm_head": Colwise(gather_output=True),
}


class GPT2Template(Template):
    name = "gpt2"
    version = "1"
    families = ("gpt2",)
    blocks = BLOCKS
    tp_plan = TP_PLAN

    @property
    def has_fusion(self) -> bool:
        return True

    def fuse(self, sch, model) -> None:
        import torch

        # torch-free: plan, space and every --help import this module; _graph imports torch
        from slapo_tune.schedule._graph import bias_then

        compiler = "inductor" if torch.cuda.is_available() else "eager"
        for block in self.block_nodes(sch):
            mlp = block["mlp"]
            act = mlp.mod.act
            mlp["c_fc"].decompose()
            mlp = mlp.trace()
            mlp.fuse(mlp.find(bias_then(act)), compiler=compiler, name="bias_act")


TEMPLATE = GPT2Template()
