"""Schedule templates: per-family plans that say only what differs between model families.

``template_for(config)`` picks the template from the model's config (``model_type``), falling
back to the generic decoder template; ``load_template(name)`` takes a registered name, a
``module:attribute`` or a path to a Python file that defines ``TEMPLATE`` (a
:class:`slapo_tune.template.Template` instance), a ``Template`` subclass, or a schedule function
with its knobs (``schedule`` and ``KNOBS``: see :mod:`search_spaces._user`). A template from a file
records the file's absolute path and the SHA-256 of the content that ran (``Template.source``).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import sys
import types
from pathlib import Path

from slapo_tune.errors import UsageError
from slapo_tune.template import Template, TemplateSource

from ._user import schedule_function_template
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


def _from_module(module, where: str, stem: str = "") -> Template:
    found = getattr(module, "TEMPLATE", None)
    if isinstance(found, Template):
        return found
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, Template) and c is not Template and c.__module__ == module.__name__]
    if len(classes) == 1 and not hasattr(module, "KNOBS"):  # (a helper named schedule beside it is no template)
        return classes[0]()
    declared = schedule_function_template(module, where, stem or module.__name__, TEMPLATES)
    if declared is not None:
        return declared
    raise UsageError(f"{where} defines no schedule(sch, point) with KNOBS, no TEMPLATE (a Template instance) "
                     "and not exactly one Template subclass")


def _from_file(name: str, sha256: str | None = None) -> Template:
    """The template of a ``.py`` file, run from the bytes it hashes (what ran is what is recorded);
    with ``sha256``, only if they still hash to it (checked before anything runs)."""
    path = Path(name).resolve()
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"template file {name} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read template file {name}: {exc.strerror or exc}") from None
    found = hashlib.sha256(text).hexdigest()
    if sha256 is not None and found != sha256:
        raise UsageError(f"template file {path} is not the one tuned with: its sha256 is {found[:12]}..., the "
                         f"tuned one's {sha256[:12]}...; restore it, or tune again")
    # registered while it runs, as an import would: dataclasses and pickling look classes up there
    module = types.ModuleType(f"slapo_user_template_{found[:16]}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)  # noqa: S102 - the user's own file, by their choice
    except Exception as exc:  # noqa: BLE001 - a user's file: report, do not crash
        sys.modules.pop(module.__name__, None)
        raise UsageError(f"cannot load template file {name}: {type(exc).__name__}: {exc}") from None
    template = copy.copy(_from_module(module, name, path.stem))  # (a TEMPLATE may be a built-in one)
    template.source = TemplateSource(str(path), found)
    return template


def load_template(name: str, sha256: str | None = None) -> Template:
    """A registered template name, ``package.module[:attribute]``, or a ``.py`` file path (whose
    content must hash to ``sha256`` when given: the file a study or a schedule was made with)."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    if Path(name).suffix == ".py":
        return _from_file(name, sha256)
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
