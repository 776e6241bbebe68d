"""Slapo's ``slapo.framework_dialect.deepspeed``."""
