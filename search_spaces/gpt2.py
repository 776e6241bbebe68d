"""GPT-2: fused QKV in one Conv1D (weights stored [in, out]), LM head tied to the token embedding."""

from slapo_tune.parallelize import Colwise, DivideAttr, ReduceInputGrad, Rowwise, VocabParallel

BLOCKS = "transformer.h"

TP_PLAN = {
    "transformer.wte": VocabParallel(),  # also shards the tied lm_head.weight
    "transformer.h.*.attn": DivideAttr("split_size", "num_heads"),
    "transformer.h.*.attn.c_attn": Colwise(num_fused=3),
    "transformer.h.*.attn.c_proj": Rowwise(),
    # reduced at the MLP input, so c_fc can be decomposed and traced through for fusion
    "transformer.h.*.mlp": ReduceInputGrad(),
    "transformer.h.*.mlp.c_fc": Colwise(reduce_input_grad=False),
    "transformer.h.*.mlp.c_proj": Rowwise(),
    "lm_head": Colwise(gather_output=True),
}
