"""A deterministic toy engine satisfying EngineClient, and the tiny tokenizer it runs on.

What it generates, in order of precedence:
- a custom logit processor's argmax (over zero logits) when the request names one;
- an example of the structured-output constraint (json_schema, regex, ebnf, choice); with
  `require_reasoning`, as a reasoning model answers: the text of the rule below as its
  thinking, `</think>`, then the example (`<think>` first unless the prompt opened it);
- the text between `<<say:` and `:say>>` when the prompt holds that marker (the last one);
- otherwise a fixed sentence, rotated by the sequence index so n > 1 choices differ.
The text is tokenized and emitted one token at a time (EOS after it unless ignore_eos), with
stop strings, stop token ids and max_new_tokens applied, cumulative text, and fake but
well-formed logprobs. It records what it received and which streams were closed early. A
final chunk carries `meta_info["timestamps"]` as radixlm's engine reports them.

With `vision=True` it stands for a vision-language model: its model info names an image
placeholder (IMAGE_TOKEN) and a video placeholder (VIDEO_TOKEN), and, as radixlm's engine, it
refuses a prompt whose placeholders do not match `image_data` / `video_data` one for one, and
an item it cannot read (here: one holding "broken"), naming it as radixlm's engine does
(`image_data` when it is the only one, else `image_data[i]`). A text-only fake refuses any
image or video, naming the field.

Asked for `token_ids_logprob`, it reports those ids' logprobs at each output position
(`token_id_logprob(id, prompt length)`), as SGLang's scoring reads them.

`PoolingFakeEngine` stands for a pooling model (embedding, classifier, cross-encoder, reward
model): the optional `encode` member of EngineClient, with deterministic outputs.

`LoraFakeEngine` adds LoRA adapters, held in memory as name -> path: the optional
`load_lora_adapter` / `unload_lora_adapter` / `lora_adapters` members of EngineClient, with
radixlm's engine's refusals (fields `lora_name` / `lora_path`), and a request naming an
unknown adapter in `lora_path` refused before its first chunk. The plain FakeEngine has none
of those members and ignores `lora_path`. Either records each request it receives
(`received`, so `received[-1].lora_path`).

Also used by tools/bench/serve_bench.py --fake (loaded by path), so it must not import pytest.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixlm.sampling import (
    CONSTRAINT_FIELDS,
    CustomLogitProcessor,
    EmbeddingOutput,
    EmbeddingRequest,
    EngineOverloaded,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    InvalidRequest,
    LogprobEntry,
    SamplingParams,
    check_text_fits,
    max_token_chars,
)

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
CORPUS = (
    DEFAULT_TEXT * 3
    + ' {"name": "Paris", "population": 2148000, "city": "London"} [1, 2, 3] true false null '
    + "<tool_call> </tool_call> get_weather get_time arguments parameters Hello Hi Hey "
    + "France England capital country continent language greeting assistant user system "
    + "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?'\"()[]{}<>-_/\\|=+*&^%$#@~`\n"
)
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'assistant' -%}
{{ raise_exception('the conversation must not start with an assistant message') }}
{%- endif -%}
{%- if tools -%}
<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"


def build_tokenizer(directory: Path) -> Any:
    """Train a byte-level BPE on CORPUS, save it as a Hugging Face tokenizer, load it back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def schema_example(schema: Any) -> Any:
    """A value satisfying a (simple) JSON schema: the toy's stand-in for constrained decoding."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return schema_example(schema[key][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: schema_example(sub) for name, sub in properties.items()}
    if kind == "array":
        return [schema_example(schema.get("items", {})) for _ in range(schema.get("minItems", 1))]
    return {"string": "Paris", "integer": 2148000, "number": 1.5, "boolean": True}.get(kind)


def _regex_example(pattern: str) -> str:
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise InvalidRequest(
            "sampling_params.regex", f"the regex does not compile: {error}"
        ) from None
    for candidate in re.split(r"[|()]", pattern):
        if candidate and compiled.fullmatch(candidate):
            return candidate
    return pattern


@dataclass
class _Sequence:
    index: int
    target: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    # When it arrived, was first advanced, got its first and last token (time.time()).
    arrived: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class FakeEngine:
    """A toy EngineClient. `token_delay` seconds pass between tokens. Like radixlm's engine, it
    validates what it is sent (token ids, the context, a text too long in characters to fit
    it, custom logit processors, a rid in use) and raises InvalidRequest before the first
    chunk; the server checks none of that."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        token_delay: float = 0.0005,
        max_context_length: int = 512,
        max_queued: int | None = None,
        model_path: str = "toy/fake-model",
        enable_custom_logit_processor: bool = False,
        vision: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.token_delay = token_delay
        self.max_context_length = max_context_length
        self.max_queued = max_queued
        self.model_path = model_path
        self.enable_custom_logit_processor = enable_custom_logit_processor
        self.image_token = IMAGE_TOKEN if vision else None
        self.video_token = VIDEO_TOKEN if vision else None
        self.max_token_chars = max_token_chars(tokenizer)
        self.vocab_size = len(tokenizer)
        self.eos_id = int(tokenizer.eos_token_id)
        self.received: list[GenerateRequest] = []
        self.active: dict[str, dict[str, bool]] = {}
        self.generated_tokens = 0
        self.closed_early: list[str] = []
        self.aborted: list[str] = []
        self.completed: list[str] = []
        #: Loaded LoRA adapters, name -> path; None: this engine does no LoRA (LoraFakeEngine).
        self.lora_registry: dict[str, str] | None = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "max_context_length": self.max_context_length,
            "vocab_size": self.vocab_size,
            "chat_template": self._tokenizer.chat_template,
            "eos_token_ids": [self.eos_id],
            "image_token": self.image_token,
            "video_token": self.video_token,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.active),
            "num_queued_reqs": 0,
            "cache_hit_rate": 0.25,
            "token_usage": 0.0,
            "max_total_num_tokens": 4096,
            "generated_tokens": self.generated_tokens,
            "engine": "fake",
        }

    async def abort(self, rid: str) -> bool:
        if rid not in self.active:
            return False
        self.active[rid]["abort"] = True
        return True

    async def flush_cache(self) -> bool:
        return not self.active

    # Generation.

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.input_ids is not None:
            ids = [int(t) for t in request.input_ids]  # type: ignore[union-attr, arg-type]
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise InvalidRequest(
                    "input_ids",
                    f"token ids {outside[:5]} are outside the vocabulary of "
                    f"{self.vocab_size} tokens",
                )
            return ids
        if request.text is None:
            raise InvalidRequest("input_embeds", "this engine takes text or input_ids only")
        text = str(request.text)
        check_text_fits(text, self.max_context_length, self.max_token_chars, "text")
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _check(self, request: GenerateRequest, prompt: list[int]) -> None:
        """What radixlm's engine refuses, with its fields (messages shortened)."""
        request.params.check(self.vocab_size)
        lora = request.lora_path
        if self.lora_registry is not None and lora is not None and lora not in self.lora_registry:
            raise InvalidRequest("lora_path", f"no LoRA adapter named {lora!r} is loaded")
        custom = request.custom_logit_processor
        if custom is not None:
            if not self.enable_custom_logit_processor:
                raise InvalidRequest(
                    "custom_logit_processor",
                    "custom logit processors are disabled on this engine; start it with "
                    "enable_custom_logit_processor=True to allow them",
                )
            try:
                CustomLogitProcessor.from_str(str(custom))
            except ValueError as error:
                raise InvalidRequest("custom_logit_processor", str(error)) from None
        for kind, token in (("image", self.image_token), ("video", self.video_token)):
            self._check_media(request, prompt, kind, token)
        room = 0 if request.params.max_new_tokens == 0 else 1
        if len(prompt) + room > self.max_context_length:
            raise InvalidRequest(
                "text" if request.text is not None else "input_ids",
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context_length}",
            )

    def _check_media(
        self, request: GenerateRequest, prompt: list[int], kind: str, token: str | None
    ) -> None:
        field_name = f"{kind}_data"
        value = getattr(request, field_name)
        if value is None:
            return
        if token is None:
            raise InvalidRequest(
                field_name, f"this model does not take {kind}s; remove {field_name}"
            )
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if "broken" in str(item):
                where = field_name if len(items) == 1 else f"{field_name}[{index}]"
                raise InvalidRequest(where, f"cannot read this {kind}")
        found = str(self._tokenizer.decode(prompt)).count(token)
        if found != len(items):
            raise InvalidRequest(
                field_name,
                f"the prompt holds {found} {kind} placeholders ({token}) but {field_name} has "
                f"{len(items)} {kind}s",
            )

    def _target_text(
        self, prompt: str, params: SamplingParams, index: int, reasoning: bool = False
    ) -> str:
        constraint = params.constraint
        if constraint is not None and reasoning:
            free = params.model_copy(update=dict.fromkeys(CONSTRAINT_FIELDS))
            opened = prompt.rstrip().endswith("<think>")
            thinking = self._target_text(prompt, free, index)
            answer = self._target_text(prompt, params, index)
            return f"{'' if opened else '<think>'}{thinking}</think>{answer}"
        if constraint is not None:
            kind, value = constraint
            if kind == "json_schema":
                return json.dumps(schema_example(json.loads(str(value))), separators=(",", ":"))
            if kind == "regex":
                return _regex_example(str(value))
            if kind == "ebnf":
                literals = re.findall(r'"([^"]*)"', str(value))
                if not literals:
                    raise InvalidRequest("sampling_params.ebnf", "the grammar has no literal")
                return literals[0]
            if kind == "choice":
                return str(value[0])
            return "{}"
        start = prompt.rfind("<<say:")
        end = prompt.rfind(":say>>")
        if 0 <= start < end:
            return prompt[start + len("<<say:") : end]
        words = DEFAULT_TEXT.split(" ")
        shift = index % len(words)
        return " ".join(words[shift:] + words[:shift])

    def _targets(self, request: GenerateRequest, prompt: str) -> list[list[int]]:
        params = request.params
        limit = params.max_new_tokens if params.max_new_tokens is not None else 64
        if request.custom_logit_processor is not None:
            processor = CustomLogitProcessor.from_str(str(request.custom_logit_processor))()
            tokens = []
            for _ in range(limit):
                logits = processor([[0.0] * self.vocab_size], [params.custom_params])
                row = list(logits[0])
                tokens.append(row.index(max(row)))
            return [tokens for _ in range(params.n)]
        targets = []
        for index in range(params.n):
            text = self._target_text(prompt, params, index, bool(request.require_reasoning))
            ids = list(self._tokenizer.encode(text))
            if params.ignore_eos:
                ids = (ids * (limit // max(len(ids), 1) + 1))[:limit]
            else:
                ids.append(self.eos_id)
            targets.append(ids)
        return targets

    def _triple(self, token: int, logprob: float | None, with_text: bool) -> LogprobEntry:
        return LogprobEntry(logprob, token, self._tokenizer.decode([token]) if with_text else None)

    def _top(self, token: int, k: int, with_text: bool) -> tuple[LogprobEntry, ...]:
        chosen = self._triple(token, self.logprob(token), with_text)
        # The third alternative is ruled out (-inf), as grammar masks do in real engines.
        others = [
            self._triple(
                (token + j) % self.vocab_size,
                float("-inf") if j == 2 else self.logprob(token) - j,
                with_text,
            )
            for j in range(1, k)
        ]
        return (chosen, *others)

    @staticmethod
    def logprob(token: int) -> float:
        return -0.25 * (1 + token % 4)

    @staticmethod
    def token_id_logprob(token: int, prompt_tokens: int) -> float:
        """The logprob reported for a `token_ids_logprob` id after a prompt of this length."""
        return -0.25 * (1 + (token + prompt_tokens) % 4)

    def _chunk(
        self, request: GenerateRequest, seq: _Sequence, prompt: list[int], arrival: float
    ) -> GenerateChunk:
        logprobs: dict[str, Any] = {}
        if request.return_logprob:
            text = bool(request.return_text_in_logprobs)
            k = int(request.top_logprobs_num)  # type: ignore[arg-type]
            logprobs["output_token_logprobs"] = tuple(
                self._triple(t, self.logprob(t), text) for t in seq.ids
            )
            logprobs["output_top_logprobs"] = tuple(
                self._top(t, k, text) if k else () for t in seq.ids
            )
            wanted = [int(t) for t in request.token_ids_logprob or ()]  # type: ignore[arg-type]
            if wanted:
                logprobs["output_token_ids_logprobs"] = tuple(
                    tuple(
                        self._triple(t, self.token_id_logprob(t, len(prompt)), text) for t in wanted
                    )
                    for _ in seq.ids
                )
            start = int(request.logprob_start_len)  # type: ignore[arg-type]
            if start >= 0:
                positions = range(start, len(prompt))
                logprobs["input_token_logprobs"] = tuple(
                    self._triple(prompt[p], None if p == 0 else self.logprob(prompt[p]), text)
                    for p in positions
                )
                logprobs["input_top_logprobs"] = tuple(
                    None if p == 0 else (self._top(prompt[p], k, text) if k else ())
                    for p in positions
                )
        return GenerateChunk(
            rid=str(request.rid),
            index=seq.index,
            text=seq.text,
            output_ids=tuple(seq.ids),
            prompt_tokens=len(prompt),
            completion_tokens=len(seq.ids),
            cached_tokens=len(prompt) // 2,
            finish_reason=seq.finish,
            e2e_latency=time.monotonic() - arrival,
            extra=None if seq.finish is None else {"timestamps": self._timestamps(seq)},
            **logprobs,
        )

    @staticmethod
    def _timestamps(seq: _Sequence) -> dict[str, float | None]:
        """radixlm's engine's `meta_info["timestamps"]` of a final chunk."""
        return {
            "arrival": seq.arrived,
            "scheduled": seq.scheduled,
            "first_token": seq.first_token,
            "last_token": seq.last_token,
            "detokenized": time.time(),
        }

    def _advance(self, seq: _Sequence, params: SamplingParams, limit: int | None) -> None:
        token = seq.target[len(seq.ids)] if len(seq.ids) < len(seq.target) else self.eos_id
        if token == self.eos_id and not params.ignore_eos:
            seq.finish = FinishReason("stop", token)
            return
        seq.ids.append(token)
        seq.last_token = time.time()
        seq.first_token = seq.first_token or seq.last_token
        self.generated_tokens += 1
        seq.text = str(self._tokenizer.decode(seq.ids, skip_special_tokens=True))
        if token in (params.stop_token_ids or []):
            seq.finish = FinishReason("stop", token)
        for stop in params.stop_strings:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[: at + len(stop)] if params.keeps_stop_string else seq.text[:at]
                seq.finish = FinishReason("stop", stop)
                return
        if seq.finish is None and limit is not None and len(seq.ids) >= limit:
            seq.finish = FinishReason("length")

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.received.append(request)
        rid = str(request.rid)
        if rid in self.active:
            raise InvalidRequest("rid", f"request id {rid!r} is already in use")
        if self.max_queued is not None and len(self.active) >= self.max_queued:
            raise EngineOverloaded(f"the queue is full ({self.max_queued} requests); retry later")
        params = request.params
        prompt = self._prompt_ids(request)
        self._check(request, prompt)
        prompt_text = str(self._tokenizer.decode(prompt))
        seqs = [_Sequence(i, t) for i, t in enumerate(self._targets(request, prompt_text))]
        for seq in seqs:
            seq.arrived = time.time()
        arrival = time.monotonic()
        state = {"abort": False}
        self.active[rid] = state
        done = False
        try:
            if params.max_new_tokens == 0:
                for seq in seqs:
                    seq.finish = FinishReason("length")
                    yield self._chunk(request, seq, prompt, arrival)
                done = True
                return
            while any(seq.finish is None for seq in seqs):
                await asyncio.sleep(self.token_delay)
                for seq in seqs:
                    if seq.finish is not None:
                        continue
                    seq.scheduled = seq.scheduled or time.time()
                    if state["abort"]:
                        seq.finish = FinishReason("abort", message="aborted by request")
                    else:
                        self._advance(seq, params, params.max_new_tokens)
                    if request.stream or seq.finish is not None:
                        yield self._chunk(request, seq, prompt, arrival)
            done = True
        finally:
            del self.active[rid]
            (
                self.aborted if state["abort"] else self.completed if done else self.closed_early
            ).append(rid)


class LoraFakeEngine(FakeEngine):
    """A FakeEngine serving LoRA adapters (in memory; they change nothing in the output).

    A path holding "missing" does not exist, one holding "rank64" has too large a rank, as
    radixlm's engine would say. `adapter_calls` records each load and unload."""

    def __init__(
        self, tokenizer: Any, *, lora_paths: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        self.lora_registry = dict(lora_paths or {})
        self.adapter_calls: list[tuple[str, ...]] = []

    def lora_adapters(self) -> dict[str, str]:
        assert self.lora_registry is not None
        return dict(self.lora_registry)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        assert self.lora_registry is not None
        self.adapter_calls.append(("load", lora_name, lora_path))
        await asyncio.sleep(0)
        if lora_name in self.lora_registry:
            raise InvalidRequest(
                "lora_name",
                f"a LoRA adapter named {lora_name!r} is already loaded; unload it first or "
                "choose another name",
            )
        if "missing" in lora_path:
            raise InvalidRequest("lora_path", f"no LoRA adapter at {lora_path!r}")
        if "rank64" in lora_path:
            raise InvalidRequest(
                "lora_path", "the adapter's rank 64 is above the engine's max_lora_rank 16"
            )
        self.lora_registry[lora_name] = lora_path

    async def unload_lora_adapter(self, lora_name: str) -> None:
        assert self.lora_registry is not None
        self.adapter_calls.append(("unload", lora_name))
        await asyncio.sleep(0)
        if lora_name not in self.lora_registry:
            raise InvalidRequest("lora_name", f"no LoRA adapter named {lora_name!r} is loaded")
        del self.lora_registry[lora_name]


POOLING_HIDDEN_SIZE = 8
CLASS_LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


class PoolingFakeEngine(FakeEngine):
    """A FakeEngine serving a pooling model of `task` (embed, classify, score, reward): its
    model info says `is_generation: False` and describes the model under `pooling`, and its
    `encode` computes deterministic outputs from the prompt's tokens (see `pooled`):

    - embed: POOLING_HIDDEN_SIZE values, value j the mean over the tokens t of cos(t * (j+1)),
      cut to `dimensions`, then L2-normalised unless `normalize` is False;
    - classify: three logits (CLASS_LABELS), logit k the count of tokens t with t % 3 == k,
      over 2;
    - score: one logit, the count of distinct words `text` and `text_pair` share, minus 1 (a
      text alone: 0.1 per token);
    - reward: one score, 0.5 per token.

    A pair is tokenized as text then text_pair. `truncate_prompt_tokens` keeps the last
    tokens; a longer prompt than the context, `dimensions` above the hidden size, a rid in
    use and a text (or text_pair) holding "<<fail>>" are refused with InvalidRequest naming
    that field. `encoded` records each
    request, `peak` the most it ran at once; each takes `encode_delay` seconds.
    """

    def __init__(
        self, tokenizer: Any, *, task: str = "embed", encode_delay: float = 0.005, **kwargs: Any
    ) -> None:
        super().__init__(tokenizer, **kwargs)
        self.task = task
        self.encode_delay = encode_delay
        self.encoded: list[EmbeddingRequest] = []
        self.running = 0
        self.peak = 0

    def model_info(self) -> dict[str, Any]:
        num_labels = {"embed": 0, "classify": len(CLASS_LABELS)}.get(self.task, 1)
        labels = CLASS_LABELS if self.task == "classify" else {"0": "LABEL_0"}
        return {
            **super().model_info(),
            "is_generation": False,
            "pooling": {
                "task": self.task,
                "method": "mean" if self.task == "embed" else "cls",
                "normalize": self.task == "embed",
                "num_labels": num_labels,
                "id2label": labels if num_labels else {},
                "hidden_size": POOLING_HIDDEN_SIZE,
            },
        }

    def prompt_of(self, request: EmbeddingRequest) -> list[int]:
        """The tokens `encode` pools for a request (after truncation)."""
        if request.input_ids is not None:
            ids = [int(t) for t in request.input_ids]  # type: ignore[arg-type]
        else:
            ids = list(self._tokenizer.encode(str(request.text), add_special_tokens=False))
            if request.text_pair is not None:
                pair = str(request.text_pair)
                ids += list(self._tokenizer.encode(pair, add_special_tokens=False))
        keep = request.truncate_prompt_tokens
        return ids[-keep:] if keep is not None else ids

    def pooled(self, request: EmbeddingRequest, ids: list[int]) -> tuple[float, ...]:
        if self.task == "embed":
            size = request.dimensions or POOLING_HIDDEN_SIZE
            vector = [
                sum(math.cos(t * (j + 1)) for t in ids) / max(len(ids), 1) for j in range(size)
            ]
            if request.normalize is not False:
                norm = math.sqrt(sum(v * v for v in vector)) or 1.0
                vector = [v / norm for v in vector]
            return tuple(vector)
        if self.task == "classify":
            return tuple(sum(1 for t in ids if t % 3 == k) / 2 for k in range(len(CLASS_LABELS)))
        if self.task == "score":
            if request.text_pair is None:
                return (0.1 * len(ids),)
            words = set(str(request.text).lower().split())
            shared = words & set(str(request.text_pair).lower().split())
            return (len(shared) - 1.0,)
        return (0.5 * len(ids),)

    async def encode(self, request: EmbeddingRequest) -> EmbeddingOutput:
        self.encoded.append(request)
        rid = str(request.rid)
        if rid in self.active:
            raise InvalidRequest("rid", f"request id {rid!r} is already in use")
        field_name = "text" if request.text is not None else "input_ids"
        for name in ("text", "text_pair"):
            if "<<fail>>" in str(getattr(request, name)):
                raise InvalidRequest(name, "cannot pool this text")
        if request.dimensions is not None and request.dimensions > POOLING_HIDDEN_SIZE:
            raise InvalidRequest(
                "dimensions", f"the model's embeddings have {POOLING_HIDDEN_SIZE} dimensions"
            )
        ids = self.prompt_of(request)
        if len(ids) > self.max_context_length:
            raise InvalidRequest(
                field_name,
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context_length}",
            )
        self.active[rid] = {"abort": False}
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.encode_delay)
        except asyncio.CancelledError:
            self.closed_early.append(rid)
            raise
        finally:
            self.running -= 1
            del self.active[rid]
        self.completed.append(rid)
        return EmbeddingOutput(rid, self.pooled(request, ids), len(ids), len(ids) // 2, 0.001)


class ForceToken(CustomLogitProcessor):
    """Test processor: every logit but `custom_params["token_id"]` to -inf."""

    def __call__(self, logits: Any, custom_param_list: list[dict[str, Any] | None]) -> Any:
        out = []
        for row, params in zip(logits, custom_param_list, strict=True):
            target = int((params or {}).get("token_id", 0))
            out.append([0.0 if i == target else float("-inf") for i in range(len(row))])
        return out
