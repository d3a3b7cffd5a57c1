"""``ModelHandle``: one model of a ``ModelManager``, as an engine handle that sends
every request to that model (what ``ModelManager.engine(name)`` returns)."""

from __future__ import annotations

from typing import Any, Protocol

from actors.contract import Drain, InvalidRequest

__all__ = ["ModelHandle"]


class ModelManager(Protocol):
    """What a handle uses of its ``actors.ModelManager``: its routing of one request
    to one model (its private entry points) and whether it runs."""

    def is_alive(self) -> bool: ...

    def _ask(self, message: Any, name: str | None, block: bool, timeout: float | None) -> Any: ...

    def _tell(self, message: Any, name: str | None) -> None: ...


class ModelHandle:
    """One model of a :class:`ModelManager`: a request sent here without ``model`` goes
    to this model (one naming another model is refused). Methods run in callers' threads."""

    def __init__(self, manager: ModelManager, name: str) -> None:
        self.manager = manager
        self.name = name

    def _model(self, message: Any) -> str:
        if isinstance(message, Drain):
            raise InvalidRequest(
                f"drain the manager, or unload the model {self.name!r}, not one model's handle"
            )
        named = getattr(message, "model", None)
        if named is not None and named != self.name:
            raise InvalidRequest(f"the request names model {named!r} but was sent to {self.name!r}")
        return self.name

    def is_alive(self) -> bool:
        """True while the manager runs."""
        return self.manager.is_alive()

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """As :meth:`ModelManager.ask`, for this model: ``GetStats`` gives this model's
        entry of the manager's stats (its ``state``, its ``engine``'s stats when ready),
        without loading it; a ``Drain`` is refused (unload the model instead)."""
        return self.manager._ask(message, self._model(message), block, timeout)

    def tell(self, message: Any) -> None:
        """As :meth:`ModelManager.tell`, for this model."""
        self.manager._tell(message, self._model(message))
