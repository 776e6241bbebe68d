"""Slapo's ``slapo.utils``: :mod:`.common` (module hooks) and :mod:`.report` (memory)."""
