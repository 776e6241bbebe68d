"""Schedule templates: per-family plans that say only what differs between model families.

``template_for(config)`` picks the template from the model's config (``model_type``), falling
back to the generic decoder template; ``load_template(name)`` takes a registered name, a
``module:attribute`` or a path to a Python file that defines ``TEMPLATE`` (a
:class:`slapo_tune.template.Template` instance) or a ``Template`` subclass.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

from slapo_tune.errors import UsageError
from slapo_tune.template import Template

from .bert import TEMPLATE as BERT
from .generic import TEMPLATE as GENERIC
from .gpt2 import TEMPLATE as GPT2
from .llama import TEMPLATE as LLAMA
from .opt import TEMPLATE as OPT

TEMPLATES: dict[str, Template] = {t.name: t for t in (GPT2, LLAMA, BERT, OPT, GENERIC)}


def template_for(config) -> Template:
    """The template serving a model config (by ``model_type``), else the generic decoder one."""
    model_type = getattr(config, "model_type", "")
    for template in TEMPLATES.values():
        if model_type in template.families:
            return template
    return GENERIC


def _from_module(module, where: str) -> Template:
    found = getattr(module, "TEMPLATE", None)
    if isinstance(found, Template):
        return found
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, Template) and c is not Template and c.__module__ == module.__name__]
    if len(classes) == 1:
        return classes[0]()
    raise UsageError(f"{where} defines no TEMPLATE (a Template instance) and not exactly one Template subclass")


def load_template(name: str) -> Template:
    """A registered template name, ``package.module[:attribute]``, or a ``.py`` file path."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    path = Path(name)
    if path.suffix == ".py":
        if not path.is_file():
            raise UsageError(f"template file {name} does not exist")
        spec = importlib.util.spec_from_file_location(f"slapo_user_template_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - a user's file: report, do not crash
            raise UsageError(f"cannot load template file {name}: {type(exc).__name__}: {exc}") from None
        return _from_module(module, name)
    module_name, _, attr = name.partition(":")
    if "." not in module_name and not attr:
        raise UsageError(f"unknown space/template '{name}' (templates: {', '.join(TEMPLATES)}; or module:attr or a .py file)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import template module '{module_name}': {exc}") from None
    if attr:
        found = getattr(module, attr, None)
        if isinstance(found, type) and issubclass(found, Template):
            return found()
        if isinstance(found, Template):
            return found
        raise UsageError(f"'{name}' is not a Template or Template subclass")
    return _from_module(module, name)


__all__ = ["TEMPLATES", "template_for", "load_template"]
