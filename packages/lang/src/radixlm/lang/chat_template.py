"""Chat templates: how `system(...)`, `user(...)` and `assistant(...)` become prompt text.

A template is a prefix and a suffix per role. A model's Hugging Face (Jinja) template is turned
into one by rendering probe conversations and reading the pieces off, checked by re-rendering
(this needs `jinja2`); without jinja2, known families are recognised by their markers. A model
without a template gets SGLang's default `SYSTEM:` / `USER:` / `ASSISTANT:` template.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

#: Renders a conversation with a chat template: (messages, add_generation_prompt) -> text.
Renderer = Callable[[Sequence[Mapping[str, str]], bool], str]
#: What stands for an image / a video when neither the template nor the model says (SGLang's).
DEFAULT_MEDIA_TOKENS = {"image": "<image>", "video": "<video>"}


@dataclass(frozen=True)
class ChatTemplate:
    """Per-role prefix and suffix, an optional default system prompt (inserted before the first
    non-system turn), end-of-turn strings (added to every gen's stop list) and the text that
    stands for an image / a video in the prompt (None: the model's, which RuntimeEndpoint and
    EngineBackend read from its model info; `<image>` / `<video>` when it names none)."""

    name: str
    roles: Mapping[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    image_token: str | None = None
    video_token: str | None = None

    def media_token(self, kind: str) -> str:
        """The text that stands for one `kind` ("image" or "video") in the prompt."""
        token = self.image_token if kind == "image" else self.video_token
        return token or DEFAULT_MEDIA_TOKENS[kind]

    def with_model_media_tokens(self, model_info: Mapping[str, Any]) -> ChatTemplate:
        """This template with the model's `image_token` / `video_token` (from its model info)
        where it names none itself."""

        def model_token(kind: str) -> str | None:
            value = model_info.get(f"{kind}_token")
            return value if isinstance(value, str) and value else None

        image_token = self.image_token or model_token("image")
        video_token = self.video_token or model_token("video")
        if (image_token, video_token) == (self.image_token, self.video_token):
            return self
        return replace(self, image_token=image_token, video_token=video_token)

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        """The text before and after a turn of `role`; ValueError for an unknown role."""
        try:
            return self.roles[role]
        except KeyError:
            raise ValueError(
                f"chat template {self.name!r} has no role {role!r}; it has {', '.join(self.roles)}"
            ) from None


def _same_roles(prefix: Callable[[str], str], suffix: str) -> dict[str, tuple[str, str]]:
    return {role: (prefix(role), suffix) for role in ("system", "user", "assistant")}


DEFAULT = ChatTemplate(
    "default",
    {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
)
CHATML = ChatTemplate(
    "chatml", _same_roles(lambda r: f"<|im_start|>{r}\n", "<|im_end|>\n"), stop_str=("<|im_end|>",)
)
TEMPLATES: dict[str, ChatTemplate] = {
    "default": DEFAULT,
    "chatml": CHATML,
    "qwen": ChatTemplate(
        "qwen", CHATML.roles, "You are a helpful assistant.", stop_str=("<|im_end|>",)
    ),
    "llama-3": ChatTemplate(
        "llama-3",
        _same_roles(lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>"),
        stop_str=("<|eot_id|>",),
    ),
    "gemma": ChatTemplate(
        "gemma",
        {
            # Gemma has no system turn; a system message is written as a user turn.
            "system": ("<start_of_turn>user\n", "<end_of_turn>\n"),
            "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
        },
        stop_str=("<end_of_turn>",),
    ),
    "phi-3": ChatTemplate(
        "phi-3", _same_roles(lambda r: f"<|{r}|>\n", "<|end|>\n"), stop_str=("<|end|>",)
    ),
}
_ALIASES = {"llama-3-instruct": "llama-3", "gemma-it": "gemma", "chatml-llava": "chatml"}
# Markers that identify a family in a Jinja template's source (used without jinja2).
_MARKERS = (
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama-3"),
    ("<start_of_turn>", "gemma"),
    ("<|end|>", "phi-3"),
)
_KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


def get_chat_template(name: str) -> ChatTemplate:
    """A template by name: default, chatml, qwen, llama-3, gemma, phi-3."""
    key = _ALIASES.get(name, name)
    if key not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {', '.join(TEMPLATES)}")
    return TEMPLATES[key]


def resolve_chat_template(
    name: str | ChatTemplate | None = None,
    hf_template: str | None = None,
    renderer: Renderer | None = None,
) -> ChatTemplate:
    """The template to use: an explicit `name` (or ChatTemplate) wins; else the model's
    `hf_template` (Jinja source, read through `renderer` or jinja2); else the default."""
    if isinstance(name, ChatTemplate):
        return name
    if name:
        return get_chat_template(name)
    if not hf_template:
        return DEFAULT
    return from_hf_template(hf_template, renderer)


def from_hf_template(source: str, renderer: Renderer | None = None) -> ChatTemplate:
    """Turn a Hugging Face chat template into a ChatTemplate (see the module docstring)."""
    render = renderer or jinja_renderer(source)
    if render is not None:
        try:
            derived = derive_from_renderer(render)
        except Exception as error:  # a template may raise on our probes; fall back to markers
            logger.debug("chat template probe failed: %s", error)
            derived = None
        if derived is not None:
            return derived
    for marker, name in _MARKERS:
        if marker in source:
            return TEMPLATES[name]
    logger.warning(
        "could not interpret the model's chat template; using the default SYSTEM:/USER:/ASSISTANT: "
        "template (install jinja2, or pass chat_template_name=...)"
    )
    return DEFAULT


def jinja_renderer(source: str) -> Renderer | None:
    """A renderer for Jinja `source` (bos/eos tokens empty), or None without jinja2."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except TemplateError as error:
        logger.debug("chat template does not compile: %s", error)
        return None

    def render(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="",
        )

    return render


_S, _U, _A = "PROBESYSTEM7", "PROBEUSER7", "PROBEASSISTANT7"


def _strip_bos(text: str) -> str:
    for bos in _KNOWN_BOS:
        if text.startswith(bos):
            return text[len(bos) :]
    return text


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


def derive_from_renderer(render: Renderer) -> ChatTemplate | None:
    """Read per-role prefixes and suffixes off probe renderings; None if they do not add up."""
    sys_m, user_m, asst_m = (
        {"role": "system", "content": _S},
        {"role": "user", "content": _U},
        {"role": "assistant", "content": _A},
    )
    user_only = _strip_bos(render([user_m], False))
    with_prompt = _strip_bos(render([user_m], True))
    user_asst = _strip_bos(render([user_m, asst_m], False))
    sys_user = _strip_bos(render([sys_m, user_m], False))
    if not with_prompt.startswith(user_only) or _U not in user_only or _A not in user_asst:
        return None
    user_suffix = user_only[user_only.index(_U) + len(_U) :]
    asst_prefix = with_prompt[len(user_only) :]
    asst_suffix = user_asst[user_asst.index(_A) + len(_A) :]
    before_user = user_only[: user_only.index(_U)]
    sys_prefix = sys_user[: sys_user.index(_S)]
    between = sys_user[sys_user.index(_S) + len(_S) : sys_user.index(_U)]
    if between.startswith(user_suffix) and before_user.endswith(between[len(user_suffix) :]):
        sys_suffix, user_prefix = user_suffix, between[len(user_suffix) :]
    else:
        user_prefix = _common_suffix(before_user, between)
        sys_suffix = between[: len(between) - len(user_prefix)]
    default_block = before_user[: len(before_user) - len(user_prefix)]
    default_system = None
    if default_block:
        if not (default_block.startswith(sys_prefix) and default_block.endswith(sys_suffix)):
            return None
        default_system = default_block[len(sys_prefix) : len(default_block) - len(sys_suffix)]
    roles = {
        "system": (sys_prefix, sys_suffix),
        "user": (user_prefix, user_suffix),
        "assistant": (asst_prefix, asst_suffix),
    }
    stop = asst_suffix.strip()
    template = ChatTemplate(
        "from-model", roles, default_system or None, stop_str=(stop,) if stop else ()
    )
    # Keep it only if it reproduces the model's own rendering.
    conversation = [sys_m, user_m, asst_m]
    expected = _strip_bos(render(conversation, False))
    ours = "".join(p + m["content"] + s for m in conversation for p, s in [roles[m["role"]]])
    return template if ours == expected else None
