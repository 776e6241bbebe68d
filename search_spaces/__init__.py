"""Schedule templates: per-family plans that say only what differs between model families.

``template_for(config)`` picks the template from the model's config (``model_type``), falling
back to the generic decoder template; ``load_template(name)`` takes a registered name, a
``module:attribute`` or a path to a Python file that defines ``TEMPLATE`` (a
:class:`slapo_tune.template.Template` instance), a ``Template`` subclass, or a schedule function
with its knobs (``schedule`` and ``KNOBS``: see :mod:`search_spaces._user`). A template from a file
records the file's absolute path and the SHA-256 of the content that ran (``Template.source``).

A schedule file or a study is data: the template it names is looked up among the built-in ones
only (:func:`recorded_template`). A file or module it names is Python, run with the user's rights,
so it is loaded only when the user names it on the command line (``--space``), and a file only if
its content still hashes to what the data recorded.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import sys
import types
from pathlib import Path

from slapo_tune._inputs import read_small_bytes
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
    text = read_small_bytes(path, "template file")
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


def recorded_template(reference: str | None, sha256: str | None, given: str | None, where: str) -> Template | None:
    """The template a schedule file or a study records (``reference``: a built-in template's name,
    or the file path or ``module:attr`` it was loaded from; None: none, chosen from the model's
    config), as data: nothing it names is imported or run. A file or module is loaded only as the
    user names it (``given``, their ``--space``); a file only if its content hashes to ``sha256``,
    the content the schedule or study was made with, checked before it runs. The user's ``given``
    also replaces a built-in template (its name and version are the caller's to check)."""
    if given is not None:
        template = load_template(given, sha256 if sha256 and Path(given).suffix == ".py" else None)
        if sha256 and (template.source is None or template.source.sha256 != sha256):
            raise UsageError(f"{where} was made with the template file {reference} (sha256 {sha256[:12]}...), not "
                             f"with --space {given}; pass that file")
        return template
    if reference is None:
        return None
    if reference in TEMPLATES and not sha256:
        return TEMPLATES[reference]
    what = "template file" if sha256 else "template"
    raise UsageError(f"{where} was made with the {what} {reference}, which is Python: slapo-tune runs it only when "
                     f"you name it yourself; pass --space {reference}")


__all__ = ["TEMPLATES", "template_for", "load_template", "recorded_template"]
