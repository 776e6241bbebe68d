"""Analytic memory and time: closed-form terms, microseconds per point.

This module is the analytic cost model's public face: every name below is re-exported from the
module that holds it (patch a name where it is read, in that module, not here).

- :mod:`._layout`: the model layout (:class:`ModelLayout`, :func:`layout_of`), measured once per
  config, and whether an attention kernel writes its scores (:func:`scores_materialised`).
- :mod:`._probe`: the activation probe (:func:`activation_probe`, :func:`probe_block`,
  :func:`probe_tp`): what one block keeps for its backward, measured in each precision.
- :mod:`._schedule_math`: pipeline schedule arithmetic (:func:`flights`,
  :func:`interleaved_warmup`, :func:`rank_blocks`, :func:`blocks_in_flight`, the ``checkpointed_*`` counts,
  :func:`dominant_stages`, :func:`pipeline_bubble`, :func:`megatron_microbatches_in_flight`).
- :mod:`._columns`: the array layer that evaluates many points at once (:func:`by_branches`,
  ``_same``, ``_pick``, ``_each``...).
- :mod:`._memory`: the memory terms and their default weights (:data:`MEMORY_TERMS`,
  :func:`combine`), the model states (:func:`model_state_bytes`), what a block keeps
  (:func:`block_activations`), :class:`StageTerms`, the linear features (:func:`linear_terms`),
  :class:`MemoryPrediction` and Korthikanti et al.'s formulas (:func:`megatron_activation_bytes`).
- :mod:`._stage`: each pipeline stage's events (:func:`stage_builder`, :func:`memory_terms`) and the
  predicted peak (:func:`predict_memory`).
- :mod:`._time`: the time model (:data:`TIME_TERMS`, :func:`time_columns`, :func:`predict_time`,
  :func:`predict_steps`, :func:`gemm_seconds`, the collectives).

Imports among them go one way: ``_columns``, ``_schedule_math`` and ``_probe`` import none of the
others (``_schedule_math`` names :class:`ModelLayout` in its annotations only); ``_layout`` imports
``_probe``; ``_memory`` imports ``_columns`` and ``_layout``; ``_stage``
imports ``_memory`` and those below it; ``_time`` imports ``_columns``, ``_layout``, ``_memory`` and
``_schedule_math``.
"""

from __future__ import annotations

from ._columns import (
    _any,
    _at_least_zero,
    _each,
    _int,
    _max,
    _min,
    _nonzero,
    _pick,
    _same,
    _scalar,
    _Split,
    by_branches,
)
from ._layout import (
    _LAYOUTS,
    LAYOUT_VERSION,
    ModelLayout,
    _measure_layout,
    layout_of,
    scores_materialised,
)
from ._memory import (
    _TERM_FIELD,
    ACTIVATION_TERMS,
    CHECKPOINTED,
    DEFAULT_UNCERTAINTY,
    DEFAULT_WEIGHTS,
    FP8_SCALE_BYTES,
    GRAD_BYTES,
    LINEAR_FIELD,
    LOSS_BYTES,
    MASTER_BYTES,
    MEMORY_TERMS,
    MOMENT_BYTES,
    RECOMPUTE,
    SCORE_GRAD_BYTES,
    SHARD_BYTES,
    UNIT_ACTIVATIONS,
    BlockActivations,
    LinearFeatures,
    MemoryPrediction,
    StageTerms,
    block_activations,
    combine,
    fp8_saved_bytes,
    fp8_transient_bytes,
    linear_terms,
    megatron_activation_bytes,
    model_state_bytes,
    optimistic,
    vector_peak,
)
from ._probe import (
    PROBE_PRECISIONS,
    PROBE_SEQ,
    PROBE_VOCAB,
    ProbeRun,
    _block_bytes,
    _first_line,
    activation_probe,
    probe_block,
    probe_config,
    probe_tp,
)
from ._schedule_math import (
    _ckpt_positions,
    _dominant_stages,
    _flights,
    _stage_ckpt_positions,
    _stage_ckpt_summary,
    blocks_in_flight,
    checkpointed_count,
    checkpointed_in_flight,
    checkpointed_per_chunk,
    checkpointed_per_stage,
    dominant_stages,
    first_chunk_share,
    flights,
    interleaved_chunks_in_flight,
    interleaved_warmup,
    megatron_microbatches_in_flight,
    pipeline_bubble,
    rank_blocks,
)
from ._stage import (
    memory_terms,
    predict_memory,
    stage_builder,
)
from ._time import (
    ACTIVATION_OP_PASSES,
    BACKWARD_TRAFFIC,
    DEFAULT_TIME_WEIGHTS,
    FLASH_EFFICIENCY,
    FSDP_OVERLAP,
    FUSED_ACTIVATION_PASSES,
    GATE_PASSES,
    NORM_PASSES,
    ONE_KERNEL_PASSES,
    OUR_RUNTIME,
    RESIDUAL_PASSES,
    ROTARY_PASSES,
    SCORE_PASSES,
    TIME_KNOBS,
    TIME_TERMS,
    FsdpHost,
    GradAccumulation,
    Runtime,
    TimePrediction,
    _ring,
    activation_passes,
    attention_pairs,
    block_traffic,
    fsdp_collectives,
    gemm_seconds,
    model_flops_per_step,
    point_columns,
    predict_steps,
    predict_time,
    relative_error,
    samples_per_second,
    time_columns,
    time_terms,
    weighted_time,
)

# every name this module held before it was split into the modules above (tests and benchmarks
# import private ones too)
__all__ = [
    "ACTIVATION_OP_PASSES", "ACTIVATION_TERMS", "BACKWARD_TRAFFIC", "BlockActivations", "CHECKPOINTED",
    "DEFAULT_TIME_WEIGHTS", "DEFAULT_UNCERTAINTY", "DEFAULT_WEIGHTS", "FLASH_EFFICIENCY", "FP8_SCALE_BYTES",
    "FSDP_OVERLAP", "FUSED_ACTIVATION_PASSES", "FsdpHost", "GATE_PASSES", "GradAccumulation", "GRAD_BYTES", "LAYOUT_VERSION", "LINEAR_FIELD",
    "LOSS_BYTES", "LinearFeatures", "MASTER_BYTES", "MEMORY_TERMS", "MOMENT_BYTES", "MemoryPrediction",
    "ModelLayout", "NORM_PASSES", "ONE_KERNEL_PASSES", "OUR_RUNTIME", "PROBE_PRECISIONS", "PROBE_SEQ", "PROBE_VOCAB",
    "ProbeRun", "RECOMPUTE", "RESIDUAL_PASSES", "ROTARY_PASSES", "Runtime", "SCORE_GRAD_BYTES", "SCORE_PASSES",
    "SHARD_BYTES", "StageTerms", "TIME_KNOBS", "TIME_TERMS", "TimePrediction", "UNIT_ACTIVATIONS", "_LAYOUTS",
    "_Split", "_TERM_FIELD", "_any", "_at_least_zero", "_block_bytes", "_ckpt_positions", "_dominant_stages",
    "_each", "_first_line", "_flights", "_int", "_max", "_measure_layout", "_min", "_nonzero", "_pick",
    "_ring", "_same", "_scalar", "_stage_ckpt_positions", "_stage_ckpt_summary", "activation_passes",
    "activation_probe", "attention_pairs", "block_activations", "block_traffic", "blocks_in_flight", "by_branches", "checkpointed_count",
    "checkpointed_in_flight", "checkpointed_per_chunk", "checkpointed_per_stage", "combine",
    "dominant_stages", "first_chunk_share", "flights", "fp8_saved_bytes", "fp8_transient_bytes", "fsdp_collectives",
    "gemm_seconds", "interleaved_chunks_in_flight", "interleaved_warmup", "layout_of", "linear_terms",
    "megatron_activation_bytes", "megatron_microbatches_in_flight", "memory_terms", "model_flops_per_step",
    "model_state_bytes", "optimistic", "pipeline_bubble", "point_columns", "predict_memory", "predict_steps",
    "predict_time", "probe_block", "probe_config", "probe_tp", "rank_blocks", "relative_error",
    "samples_per_second", "scores_materialised", "stage_builder", "time_columns", "time_terms", "vector_peak",
    "weighted_time",
]
