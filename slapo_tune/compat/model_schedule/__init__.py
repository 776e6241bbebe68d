"""Slapo's ``slapo.model_schedule``: helpers its model schedules use (:mod:`.gpt2`)."""
