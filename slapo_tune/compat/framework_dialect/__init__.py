"""Slapo's ``slapo.framework_dialect``: the framework-neutral parts of its dialects (slapo-tune runs
pipelines itself, so no framework wrapper is needed)."""
