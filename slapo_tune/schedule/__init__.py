"""The schedule language: the tree over an unmodified model and its primitives, and what carries them out.

Bottom to top, each module importing only those before it: ``_sharding`` (per-module-type sharding
rules), ``_state`` (what a primitive decides about a module, stored on it, and the hooks that carry
it out), ``_patterns``, ``_graph`` and ``_tracing`` (normal forms, graph rewrites, tracing),
``_schedule`` (the tree, its primitives, where pipelines may be cut), ``_pipeline`` (stages) and
``_build`` (materialisation). Beneath it all lie the parallel mechanics of :mod:`slapo_tune.parallel`.

Nothing is re-exported here: the public names (``Schedule``, ``create_schedule``, ``build``, ...)
are the package root's, which imports them lazily so that commands that only plan load no torch.
"""
