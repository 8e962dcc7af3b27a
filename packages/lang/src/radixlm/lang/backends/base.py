"""What the interpreter asks of a backend: the Backend protocol and the values that cross it.

Backends depend on this module (and on `radixlm.lang.ir`, `choices`, `chat_template`), never on
the interpreter; the interpreter reaches backends only through this protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.choices import ChoicesDecision, ChoicesMethod
from radixlm.lang.ir import LogprobOptions
from radixlm.sampling import SamplingParams

#: A chat message in the OpenAI format: {"role": ..., "content": str | list of parts}.
Message = Mapping[str, Any]


@dataclass(frozen=True)
class Prompt:
    """The program's state as a backend sees it when a primitive runs.

    `text` is the whole prompt; `messages` the finished chat turns; `images` and `videos`
    every image / video so far (base64, URL or data URI), one placeholder each in `text`, in
    order; `role` the turn still open (None outside any) and `role_text` what that turn holds
    so far.
    """

    text: str
    messages: Sequence[Message] = ()
    images: Sequence[str] = ()
    videos: Sequence[str] = ()
    role: str | None = None
    role_text: str = ""


@dataclass(frozen=True)
class GenerateCall:
    """One generation: where, with which SamplingParams and logprob options, and the value
    type (`dtype`: "int", "float", "bool", "str" or None)."""

    prompt: Prompt
    params: SamplingParams
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    dtype: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Completion:
    """What a generation produced: the text (a list of texts when `n > 1`) and its meta_info
    (SGLang's layout: completion_tokens, finish_reason, logprobs, ...)."""

    text: str | list[str]
    meta_info: Any = None


@runtime_checkable
class Backend(Protocol):
    """A model a program runs against. Every method may be called from many threads at once."""

    @property
    def is_chat_model(self) -> bool:
        """True when the model takes only chat messages (an API chat model)."""
        ...

    def get_chat_template(self) -> ChatTemplate:
        """How roles are written into the prompt text for this model."""
        ...

    def generate(self, call: GenerateCall) -> Completion:
        """Generate once; raises BackendError (or a subclass) on failure."""
        ...

    def generate_stream(self, call: GenerateCall) -> Iterator[tuple[str, Any]]:
        """Generate, yielding (new text, meta_info so far) as it arrives."""
        ...

    def select(
        self, prompt: Prompt, choices: Sequence[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        """Score every choice as a continuation of `prompt` and let `method` pick one."""
        ...

    def cache_prefix(self, text: str) -> None:
        """Hint that `text` starts many prompts soon (fork, run_batch): cache it if you can."""
        ...

    def flush_cache(self) -> bool:
        """Drop the backend's prefix cache; False when it has none or cannot now."""
        ...

    def get_server_info(self) -> dict[str, Any]:
        """What the backend reports about itself (empty when nothing)."""
        ...
