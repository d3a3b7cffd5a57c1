"""llama-server's slot actions: ``POST /slots/{id_slot}?action=save|restore|erase``, with
``{"filename": ...}`` naming a file in the ``--slot-save-path`` folder.

A filename is checked as llama-server's ``fs_validate_filename`` checks it (at most 255
bytes of UTF-8, no control characters, none of ``/ \\ : * ? " < > |`` nor their Unicode
look-alikes, no ``..``, no leading or trailing space, no trailing dot), then its path is
resolved and must lie directly in the folder: a link in the folder that points out of
it is refused too. The answers are llama-server's: ``{id_slot, filename, n_saved,
n_written, timings: {save_ms}}``, ``{..., n_restored, n_read, timings: {restore_ms}}``,
``{id_slot, n_erased}``; its errors too (501 without the folder, 400 ``Invalid slot
ID``, ``Invalid action``, ``Invalid filename``, ``Unable to restore slot: <why>``), with
the engine's reasons where llama-server has none. An error names the file by the
filename it was given, never by the server's path.

Handlers run on the event loop; the engine does the work in its own thread
(:class:`actors.SaveSlot` and the others), reached from a control thread.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import EngineError, EraseSlot, InvalidRequest, RestoreSlot, SaveSlot, SlotFile
from actors.http._errors import HttpError
from actors.http._native import json_response
from actors.http._service import routed

__all__ = ["slot_action", "valid_filename"]

_TIMEOUT_S = 120.0  # a large slot file is read or written at disk speed
_MAX_FILENAME_BYTES = 255  # the common largest filename on Linux filesystems
# Characters llama-server refuses in a filename: Windows' reserved ones, the separators,
# and Unicode's look-alikes of a dot, a slash and a backslash, the replacement character
# and the byte order mark.
_FORBIDDEN = frozenset(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def valid_filename(name: str) -> bool:
    """Whether ``name`` is a filename llama-server would accept (``fs_validate_filename``,
    without subfolders)."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > _MAX_FILENAME_BYTES:
        return False
    for char in name:
        code = ord(char)
        if code <= 0x1F or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF or char in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)


def _path(folder: str, filename: object) -> str:
    """The file ``filename`` names in ``folder`` (resolved), or a 400."""
    if not isinstance(filename, str) or not valid_filename(filename):
        raise HttpError(400, "Invalid filename")
    path = os.path.realpath(os.path.join(folder, filename))
    if os.path.dirname(path) != folder:  # a link pointing out of the folder
        raise HttpError(400, "Invalid filename")
    return path


def _named(error: Exception, path: str, filename: str) -> str:
    """The error's text with the file named as the client named it."""
    return str(error).replace(repr(path), repr(filename)).replace(path, filename)


async def slot_action(request: Request) -> Response:
    """``POST /slots/{id_slot}?action=save|restore|erase`` (see the module)."""
    service = await routed(request)
    folder = service.settings.slot_save_path
    if folder is None:
        raise HttpError(501, "This server does not support slots action. Start it with `--slot-save-path`")
    text = request.path_params.get("id_slot", "")
    if not (text.isascii() and text.isdigit()) or int(text) >= max(service.total_slots, 1):
        raise HttpError(400, "Invalid slot ID")
    id_slot = int(text)
    action = request.query_params.get("action")
    engine = service.handle()
    if action == "erase":
        erased = await service.call(lambda: engine.ask(EraseSlot(slot=id_slot), timeout=_TIMEOUT_S))
        return json_response({"id_slot": id_slot, "n_erased": erased})
    if action not in ("save", "restore"):
        raise HttpError(400, "Invalid action")
    body = request.state.json
    filename = body.get("filename") if isinstance(body, dict) else None
    path = _path(folder, filename)
    assert isinstance(filename, str)
    message = SaveSlot(path, slot=id_slot) if action == "save" else RestoreSlot(path, slot=id_slot)
    try:
        done: SlotFile = await service.call(lambda: engine.ask(message, timeout=_TIMEOUT_S))
    except InvalidRequest as e:  # the slot is busy or empty, the file unusable: the reason
        reason = _named(e, path, filename)
        raise HttpError(400, f"Unable to restore slot: {reason}" if action == "restore" else reason) from None
    except EngineError as e:
        if type(e) is not EngineError:  # stopped, timed out...: as any request's
            raise
        raise HttpError(500, f"Unable to save slot: {_named(e, path, filename)}") from None
    answer: dict[str, Any] = {"id_slot": id_slot, "filename": filename}
    if action == "save":
        answer.update(n_saved=done.n_tokens, n_written=done.n_bytes, timings={"save_ms": done.ms})
    else:
        answer.update(n_restored=done.n_tokens, n_read=done.n_bytes, timings={"restore_ms": done.ms})
    return json_response(answer)
