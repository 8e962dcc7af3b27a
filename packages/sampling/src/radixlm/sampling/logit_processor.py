"""CustomLogitProcessor: a user's logit transform, named in a request by its serialised form.

The request carries `custom_logit_processor` as a string made by `MyProcessor.to_str()`; the
runtime (and only when the server enables custom logit processors) calls `from_str()` to get the
class back and applies an instance to the logits of the requests that named it, passing each
request's `custom_params`.

Serialisation is by reference: the string holds the class's module and qualified name, so the
class must be importable on the serving side. Unlike pickling a class by value, loading a
reference never executes code that the request itself carries; it imports a module the server
already has, and only when enabled.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from typing import Any

_FORMAT = "radixlm.custom_logit_processor/1"


class CustomLogitProcessor(ABC):
    """Base class: subclass it and implement `__call__`.

    `__call__(logits, custom_param_list)` receives the logits of the rows that use this
    processor (a tensor of shape [rows, vocab]) and one `custom_params` dict (or None) per row,
    and returns the new logits (it may modify them in place).
    """

    @abstractmethod
    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        """Return the transformed logits of the given rows."""

    @classmethod
    def to_str(cls) -> str:
        """The string to send as a request's `custom_logit_processor`."""
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            raise ValueError(
                f"{cls.__qualname__} is defined in a script or a function, so the server cannot "
                "import it; move it into an importable module"
            )
        return json.dumps({"format": _FORMAT, "callable": f"{cls.__module__}:{cls.__qualname__}"})

    @staticmethod
    def from_str(text: str) -> type[CustomLogitProcessor]:
        """The class a `to_str()` string names. Imports its module; raises ValueError if invalid."""
        try:
            payload = json.loads(text)
            module_name, _, qualname = str(payload["callable"]).partition(":")
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                "custom_logit_processor must be the string made by "
                "CustomLogitProcessor.to_str() (JSON with a 'callable' entry)"
            ) from None
        if payload.get("format") != _FORMAT or not module_name or not qualname:
            raise ValueError(f"custom_logit_processor is not in the {_FORMAT} format")
        try:
            target: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"cannot load custom logit processor {module_name}:{qualname}: {error}"
            ) from None
        if not (isinstance(target, type) and issubclass(target, CustomLogitProcessor)):
            raise ValueError(f"{module_name}:{qualname} is not a CustomLogitProcessor subclass")
        return target
