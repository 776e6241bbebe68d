"""BERT masked LM: Q/K/V in BertSelfAttention, MLM decoder tied to the word embedding (and its bias).
Fusion: Q/K/V into one projection."""

from slapo_tune.styles import Colwise, DivideAttr, ReduceInputGrad, Rowwise, VocabParallel
from slapo_tune.template import Template

BLOCKS = "bert.encoder.layer"

_QKV = Colwise(reduce_input_grad=False)

TP_PLAN = {
    "bert.embeddings.word_embeddings": VocabParallel(),
    "bert.encoder.layer.*.attention.self": [DivideAttr("num_attention_heads", "all_head_size"), ReduceInputGrad()],
    "bert.encoder.layer.*.attention.self.query": _QKV,
    "bert.encoder.layer.*.attention.self.key": _QKV,
    "bert.encoder.layer.*.attention.self.value": _QKV,
    "bert.encoder.layer.*.attention.output.dense": Rowwise(),
    "bert.encoder.layer.*.intermediate.dense": Colwise(),
    "bert.encoder.layer.*.output.dense": Rowwise(),
    "cls.predictions.decoder": Colwise(gather_output=True),
}


class BertTemplate(Template):
    name = "bert"
    causal_lm = False  # masked-LM loss: loss_parallel is not offered
    version = "1"
    families = ("bert",)
    blocks = BLOCKS
    tp_plan = TP_PLAN
    fusion_groups = {"bert.encoder.layer.*.attention.self": (("query", "key", "value"), "qkv")}


TEMPLATE = BertTemplate()
