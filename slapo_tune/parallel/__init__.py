"""The mechanics of each parallelism, below the schedule tree: they know modules and process groups,
not schedules.

``_comm`` (collectives as autograd functions, each with its conjugate backward), ``_vocab_loss`` (the
vocabulary-parallel cross-entropy), ``_context_parallel`` (the ``cp`` attention, chunks and loss),
``_data_parallel`` (replicated or ZeRO-sharded data parallelism) and ``_send_release`` (pipeline
sends released once they can complete). The schedule language (:mod:`slapo_tune.schedule`) and the
training step (:mod:`slapo_tune.runtime`) stand on them.
"""
