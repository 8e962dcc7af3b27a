"""CustomLogitProcessor: a user's logit transform, named in a request by its serialised form.

The request carries `custom_logit_processor` as a string made by `MyProcessor.to_str()`; the
runtime (and only when the server enables custom logit processors) calls `from_str()` to get the
class back and applies an instance to the logits of the requests that named it, passing each
request's `custom_params`.

Two forms:

- By reference (the default for a class in an importable module): the string holds the class's
  module and qualified name, so the class must be importable on the serving side. Loading it
  never executes code that the request itself carries; it imports a module the server already
  has.
- By value, SGLang's form (`{"callable": "<hex of dill.dumps(cls)>"}`): what SGLang's own
  `CustomLogitProcessor.to_str()` sends, and what `to_str()` here makes for a class defined in
  a script or a function (needs `dill`: `pip install 'radixlm-sampling[dill]'`). Loading it
  unpickles code from the request: servers accept it only with custom logit processors
  enabled (`--enable-custom-logit-processor`, trusted clients only).

So SGLang's documented example runs unchanged with `radixlm.sampling.CustomLogitProcessor` as
the base class.
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
        """The string to send as a request's `custom_logit_processor` (callable on the class
        or an instance, as SGLang's): a reference to an importable class, else the class by
        value in SGLang's form."""
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            return json.dumps({"callable": _dill().dumps(cls).hex()})
        return json.dumps({"format": _FORMAT, "callable": f"{cls.__module__}:{cls.__qualname__}"})

    @staticmethod
    def from_str(text: str) -> type[CustomLogitProcessor]:
        """The class a `to_str()` string names or holds; raises ValueError if invalid.

        A reference imports its module; SGLang's by-value form unpickles the class (trusted
        clients only: callers check that custom logit processors are enabled first)."""
        try:
            payload = json.loads(text)
            callable_text = str(payload["callable"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                "custom_logit_processor must be the string made by "
                "CustomLogitProcessor.to_str() (JSON with a 'callable' entry)"
            ) from None
        if "format" not in payload:
            return _by_value(callable_text)
        module_name, _, qualname = callable_text.partition(":")
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


def _dill() -> Any:
    try:
        import dill
    except ImportError:
        raise ValueError(
            "a custom logit processor defined in a script or a function is sent by value, "
            "which needs dill: pip install 'radixlm-sampling[dill]' (or move the class into "
            "an importable module)"
        ) from None
    return dill


def _by_value(hex_text: str) -> type[CustomLogitProcessor]:
    """SGLang's form: the class pickled by dill, hex-encoded."""
    try:
        data = bytes.fromhex(hex_text)
    except ValueError:
        raise ValueError(
            "custom_logit_processor's 'callable' is neither a module:Class reference (with "
            f"'format': {_FORMAT!r}) nor SGLang's hex-encoded class"
        ) from None
    try:
        target = _dill().loads(data)
    except ValueError:
        raise
    except Exception as error:  # unpickling runs the payload's code: anything may fail
        raise ValueError(
            f"cannot load the custom logit processor sent by value: {type(error).__name__}: "
            f"{error} (derive it from radixlm.sampling.CustomLogitProcessor)"
        ) from None
    if not (isinstance(target, type) and issubclass(target, CustomLogitProcessor)):
        raise ValueError(
            f"the custom logit processor sent by value is {target!r}, not a subclass of "
            "radixlm.sampling.CustomLogitProcessor"
        )
    return target
