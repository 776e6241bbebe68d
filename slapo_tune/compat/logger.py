"""Slapo's ``slapo.logger``: ``get_logger(name)`` whose calls take ``ranks=`` (log only on these
ranks of ``group``; default every rank) and prefix ``[Rank r]`` once torch.distributed is up."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch.distributed as dist

FORMATTER = logging.Formatter("[%(asctime)s][%(levelname)s][%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
CRITICAL, ERROR, WARNING, INFO, DEBUG, NOTSET = (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO,
                                                 logging.DEBUG, logging.NOTSET)
_LOGGERS: dict[str, RankLogger] = {}


class RankLogger(logging.LoggerAdapter):
    """A logger whose calls accept ``ranks=`` (an int or a list) and ``group=``."""

    def log(self, level: int, msg: Any, *args, ranks: int | list[int] | tuple[int, ...] | None = None,
            group=None, **kwargs) -> None:
        if not self.isEnabledFor(level):
            return
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(group)
            if ranks is not None and rank not in ((ranks,) if isinstance(ranks, int) else tuple(ranks)):
                return
            msg = f"[Rank {rank}] {msg}"
        kwargs.setdefault("stacklevel", 2)  # the caller's file and line (logging skips its own frames)
        self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str = "Slapo", level: int = INFO) -> RankLogger:
    """The logger ``name`` (one per name: a second call with another level keeps the first and warns),
    writing to stdout."""
    if name in _LOGGERS:
        logger = _LOGGERS[name]
        if logger.logger.level != level:
            logger.warning("logger %s already exists with level %s; level %s is ignored", name,
                           logging.getLevelName(logger.logger.level), logging.getLevelName(level))
        return logger
    base = logging.getLogger(name)
    base.setLevel(level)
    base.propagate = False
    handler = logging.StreamHandler(stream=sys.stdout)
    handler.setLevel(level)
    handler.setFormatter(FORMATTER)
    base.addHandler(handler)
    _LOGGERS[name] = RankLogger(base, {})
    return _LOGGERS[name]


__all__ = ["RankLogger", "get_logger"]
