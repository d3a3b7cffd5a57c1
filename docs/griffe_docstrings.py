"""griffe extensions for the API reference: signal docstrings and Sphinx-style roles.

- ``SignalDocs``: the telemetry signals are declared once, with ``doc=``
  (``NAMESPACE.signal(name, doc=...)``); griffe reads source code and would see no
  docstring for them. The attribute gets that text as its docstring, so the API
  reference and the docstring check (``docs/check_docstrings.py``) read what the
  signal carries at run time.
- ``SphinxRoles``: docstrings write cross-references the Sphinx way
  (``:meth:`close```, ``:class:`Engine```) and end a paragraph with ``::`` before a
  literal block. Markdown knows neither, so both are rewritten when griffe loads the
  docstring: a role becomes a code span, ``::`` a colon. The source is not changed.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:meth|func|class|mod|attr|exc|data|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


class SignalDocs(griffe.Extension):
    """Sets the docstring of ``x = <namespace>.signal(name, doc="...")`` attributes."""

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        """Called by griffe for each attribute it visits (static analysis only)."""
        if attr.docstring is not None or not isinstance(node, ast.Assign | ast.AnnAssign):
            return
        call = node.value
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            return
        if call.func.attr != "signal":
            return
        for keyword in call.keywords:
            value = keyword.value
            if keyword.arg == "doc" and isinstance(value, ast.Constant) and isinstance(value.value, str):
                attr.docstring = griffe.Docstring(value.value, lineno=node.lineno, parent=attr)


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` as a code span and a trailing ``::`` as ``:``."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        """Called by griffe for each object it loads."""
        if obj.docstring is not None:
            text = _ROLE.sub(lambda m: f"`{m.group(1)}`", obj.docstring.value)
            obj.docstring.value = _LITERAL.sub(":", text)
