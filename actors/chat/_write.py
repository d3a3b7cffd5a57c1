"""Calls written out in a format's own syntax, as the model would write them.

For what a template cannot render itself: an assistant's earlier calls in the history
(Granite 3.3's template describes tools but never writes a call), and the example in
the tools prompt of a template that renders calls but does not describe tools. The
text is what the format's parser reads back as the same calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from actors.chat._calls import new_call_id
from actors.chat._syntax import Syntax, Tagged

__all__ = ["write_calls"]


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def write_calls(syntax: Syntax, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The text of ``calls`` (function name and arguments object, in order) in ``syntax``."""
    if syntax.json_reply:
        return _json({"tool_calls": [{"name": n, "arguments": dict(a)} for n, a in calls]})
    if syntax.body == "channels":
        return "".join(
            f"<|start|>assistant to=functions.{n}<|channel|>commentary <|constrain|>json<|message|>"
            f"{_json(dict(a))}<|call|>"
            for n, a in calls
        )
    if syntax.tagged is not None:
        return _tagged(syntax.tagged, calls, syntax.id_style)
    objects = []
    for i, (name, arguments) in enumerate(calls):
        entry: dict[str, Any] = {} if syntax.id_key is None else {syntax.id_key: str(i)}
        entry[syntax.name_key] = name
        entry[syntax.args_keys[0]] = dict(arguments)
        if syntax.trailing_id is not None:
            entry[syntax.trailing_id] = new_call_id(syntax.id_style)
        objects.append(entry)
    opener, closer = syntax.call_open or "", syntax.call_close
    if syntax.body == "array":
        return opener + _json(objects) + closer
    return "\n".join(opener + syntax.open_ws + _json(o) + ("\n" + closer if closer else "") for o in objects)


def _tagged(t: Tagged, calls: Sequence[tuple[str, Mapping[str, Any]]], id_style: str) -> str:
    written = []
    for i, (name, arguments) in enumerate(calls):
        head = t.open + t.before_name + name
        if t.index_sep:
            head += f"{t.index_sep}{i}"
        if t.id_open:
            head += t.id_open + new_call_id(id_style)
        if t.xml is None:
            body = _json(dict(arguments))
        else:
            x = t.xml
            body = "".join(
                x.key_open
                + k
                + x.key_close
                + x.value_open
                + (v if isinstance(v, str) else _json(v))
                + x.value_close
                for k, v in arguments.items()
            )
        written.append(head + t.after_name + body + t.after_args + t.close)
    text = t.between.join(written)
    return t.section[0] + text + t.section[1] if t.section else text
