"""A griffe extension: a blinker signal's ``doc=`` becomes its docstring.

The telemetry signals are declared once, with ``doc=`` (``NAMESPACE.signal(name,
doc=...)``); griffe reads source code and would see no docstring for them. This
extension gives the attribute that docstring, so the API reference and the docstring
check (``docs/check_docstrings.py``) read the same text the signal carries at run time.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe


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
