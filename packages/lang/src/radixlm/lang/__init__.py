"""radixlm.lang: SGLang's frontend language. `import radixlm.lang as sgl`.

Backend classes (`RuntimeEndpoint`, `EngineBackend`, `OpenAI`) are imported on first use, so
`import radixlm.lang` pulls in neither httpx nor openai.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixlm.lang._version import __version__
from radixlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.lang.choices import (
    ChoicesDecision,
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.errors import BackendError, BackendUnavailable, ProgramError, UnsupportedFeature
from radixlm.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from radixlm.lang.program import Program, get_default_backend, set_default_backend
from radixlm.lang.state import ProgramState, ProgramStateGroup

if TYPE_CHECKING:
    from radixlm.lang.backends.engine import EngineBackend
    from radixlm.lang.backends.openai import OpenAI
    from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint

_LAZY = {"RuntimeEndpoint": "runtime_endpoint", "EngineBackend": "engine", "OpenAI": "openai"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from radixlm.lang.backends import backend_class

        return backend_class(_LAZY[name])
    raise AttributeError(f"module 'radixlm.lang' has no attribute {name!r}")


__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "BackendError",
    "BackendUnavailable",
    "ChatTemplate",
    "ChoicesDecision",
    "ChoicesMethod",
    "EngineBackend",
    "OpenAI",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "UnsupportedFeature",
    "__version__",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
