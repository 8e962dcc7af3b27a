"""A deterministic toy model with SGLang's /generate semantics, and a fake in-process engine.

Tokens are words (with their leading space), punctuation marks and whitespace characters. The
model continues a prompt with the text of the longest rule whose key ends the prompt, else with
words of a fixed corpus picked by a hash of the prompt, then EOS. It honours max_new_tokens,
stop strings, regex (the shortest prefix of its continuation that matches, else a candidate,
else a minimal string built from the pattern) and json_schema (a minimal valid instance). A
token's logprob is high when it is the model's own next token, so `select` agrees with `gen`.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixlm.sampling import (
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    LogprobEntry,
    SamplingParams,
)

try:  # Python 3.11+
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

TOKEN_RE = re.compile(r" ?[A-Za-z0-9_]+| ?[^A-Za-z0-9_\s]|\s")
EOS = 0
CORPUS_TEXT = (
    "the river runs past the old mill and the children watch the boats drift toward the sea "
    "while the baker sells warm bread to travellers who arrive by the morning train"
)
CORPUS = CORPUS_TEXT.split(" ")
CANDIDATES = ["0", "1", "42", "3.14", "True", "False", "yes", "no", '"hello"', "A", "B+"]
HIGH, LOW = -0.05, -3.0


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


class Vocab:
    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._texts: dict[int, str] = {EOS: ""}
        self._lock = threading.Lock()

    def id(self, token: str) -> int:
        with self._lock:
            if token not in self._ids:
                self._ids[token] = len(self._ids) + 10
                self._texts[self._ids[token]] = token
            return self._ids[token]

    def text(self, token_id: int) -> str:
        return self._texts.get(token_id, "?")


# ----- constrained outputs -----


def _category_char(category: str) -> str:
    return {"DIGIT": "0", "WORD": "a", "SPACE": " ", "NOT_DIGIT": "a", "NOT_WORD": " "}.get(
        category.removeprefix("CATEGORY_"), "a"
    )


def _in_class(items: list[Any]) -> str:
    negate = any(str(op) == "NEGATE" for op, _ in items)
    if not negate:
        op, value = next((op, v) for op, v in items if str(op) != "NEGATE")
        if str(op) == "LITERAL":
            return chr(value)
        if str(op) == "RANGE":
            return chr(value[0])
        return _category_char(str(value))
    pattern = (
        "[^" + "".join(re.escape(chr(v)) if str(op) == "LITERAL" else "" for op, v in items) + "]"
    )
    return next(c for c in "ax0 _" if re.fullmatch(pattern, c))


def _minimal(parsed: Any) -> str:
    out = []
    for op, value in parsed:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(value))
        elif name == "NOT_LITERAL":
            out.append("b" if chr(value) == "a" else "a")
        elif name == "ANY":
            out.append("a")
        elif name == "IN":
            out.append(_in_class(value))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _, sub = value
            out.append(_minimal(sub) * low)
        elif name == "SUBPATTERN":
            out.append(_minimal(value[-1]))
        elif name == "ATOMIC_GROUP":
            out.append(_minimal(value))
        elif name == "BRANCH":
            out.append(_minimal(value[1][0]))
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue
        else:
            raise ValueError(f"toy model cannot build {name}")
    return "".join(out)


def regex_instance(regex: str, continuation: str) -> str:
    compiled = re.compile(regex)
    for source in (continuation, continuation.lstrip()):
        for end in range(1, len(source) + 1):
            if compiled.fullmatch(source[:end]):
                return source[:end]
    for candidate in CANDIDATES:
        if compiled.fullmatch(candidate):
            return candidate
    built = _minimal(sre_parse.parse(regex))
    assert compiled.fullmatch(built), (regex, built)
    return built


def json_instance(schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return json_instance(schema[key][0])
    kind = schema.get("type", "object")
    if kind == "object":
        props = schema.get("properties", {})
        keys = schema.get("required", list(props))
        return {k: json_instance(props.get(k, {"type": "string"})) for k in keys}
    if kind == "array":
        return [json_instance(schema.get("items", {"type": "string"}))] * schema.get("minItems", 1)
    if kind == "string":
        return "x" * max(schema.get("minLength", 4), 1)
    if kind == "integer":
        return schema.get("minimum", 7)
    if kind == "number":
        return schema.get("minimum", 0.5)
    if kind == "boolean":
        return True
    return None


class ToyModel:
    def __init__(self, rules: dict[str, str] | None = None) -> None:
        self.rules = dict(rules or {})

    def continuation(self, prompt: str) -> str:
        for key in sorted(self.rules, key=len, reverse=True):
            if prompt.endswith(key):
                return self.rules[key]
        start = zlib.crc32(prompt.encode()) % len(CORPUS)
        words = (CORPUS * 2)[start : start + 24]
        return " " + " ".join(words) + "."

    def complete(self, prompt: str, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        """(generated text, finish_reason) for one sequence."""
        cont = self.continuation(prompt)
        if params.regex is not None:
            return regex_instance(params.regex, cont), {"type": "stop", "matched": EOS}
        if params.json_schema is not None:
            instance = json_instance(json.loads(params.json_schema))
            return json.dumps(instance), {"type": "stop", "matched": EOS}
        if params.choice:
            return params.choice[0], {"type": "stop", "matched": EOS}
        tokens = tokenize(cont)
        finish: dict[str, Any] = {"type": "stop", "matched": EOS}
        limit = params.max_new_tokens
        if limit is not None and len(tokens) > limit:
            tokens, finish = tokens[:limit], {"type": "length"}
        text = "".join(tokens)
        found = [(text.find(s), s) for s in params.stop_strings if s in text]
        if found:
            at, stop = min(found)
            text = text[: at + len(stop)] if params.keeps_stop_string else text[:at]
            finish = {"type": "stop", "matched": stop}
        return text, finish

    def logprob(self, prefix: str, token: str) -> float:
        expected = tokenize(self.continuation(prefix))
        if expected and token.strip() and token.strip() == expected[0].strip():
            return HIGH
        return LOW - 0.1 * len(token.strip())


class ToyCore:
    """SGLang's /generate over the toy model; records every body it receives."""

    def __init__(
        self, model: ToyModel, chat_template: str | None = None, model_path: str = "toy-model"
    ) -> None:
        self.model = model
        self.chat_template = chat_template
        self.model_path = model_path
        self.vocab = Vocab()
        self.requests: list[dict[str, Any]] = []
        self.openai_requests: list[dict[str, Any]] = []
        self.delay = 0.0
        self.hang = False
        self.in_flight = 0
        self.max_in_flight = 0
        self.flushes = 0
        self.omit_first_logprob = False  # some servers leave out token 0 (it has no logprob)
        self.extra_info: dict[str, Any] = {}  # more model info (a vision model's image_token)
        self._cache: list[tuple[int, ...]] = []
        self._lock = threading.Lock()

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "chat_template": self.chat_template,
            "max_context_length": 4096,
            "vocab_size": 1000,
            **self.extra_info,
        }

    def flush(self) -> None:
        with self._lock:
            self._cache.clear()
            self.flushes += 1

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.hang:
            time.sleep(30)
        if self.delay:
            time.sleep(self.delay)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _cached(self, ids: tuple[int, ...]) -> int:
        with self._lock:
            best = 0
            for seq in self._cache:
                n = 0
                while n < min(len(seq), len(ids)) and seq[n] == ids[n]:
                    n += 1
                best = max(best, n)
            return min(best, max(len(ids) - 1, 0))

    def _entries(self, tokens: list[str], start: int, with_text: bool) -> tuple[LogprobEntry, ...]:
        out = []
        if self.omit_first_logprob:
            start = max(start, 1)
        for i in range(max(start, 0), len(tokens)):
            value = None if i == 0 else self.model.logprob("".join(tokens[:i]), tokens[i])
            out.append(
                LogprobEntry(value, self.vocab.id(tokens[i]), tokens[i] if with_text else None)
            )
        return tuple(out)

    def _one(self, req: GenerateRequest, index: int) -> dict[str, Any]:
        """One sequence's /generate answer, written as a radixlm server writes it."""
        if req.input_ids is not None:
            prompt_tokens = [self.vocab.text(i) for i in req.input_ids]  # type: ignore[union-attr]
        else:
            prompt_tokens = tokenize(str(req.text))
        prompt = "".join(prompt_tokens)
        params = req.params
        if params.regex is not None:
            re.compile(params.regex)  # a bad pattern is the caller's error (HTTP 400)
            if "(?=" in params.regex or "(?!" in params.regex:
                raise ValueError("regex: lookaround assertions are not supported")
        text, finish = self.model.complete(prompt, params)
        out_tokens = tokenize(text)
        ids = tuple(self.vocab.id(t) for t in prompt_tokens)
        logprobs: dict[str, Any] = {}
        if req.return_logprob:
            with_text = bool(req.return_text_in_logprobs)
            start = req.logprob_start_len
            start = len(prompt_tokens) if start == -1 else start  # type: ignore[assignment]
            logprobs["input_token_logprobs"] = self._entries(prompt_tokens, start, with_text)  # type: ignore[arg-type]
            every = prompt_tokens + out_tokens
            logprobs["output_token_logprobs"] = self._entries(every, len(prompt_tokens), with_text)
        chunk = GenerateChunk(
            rid=str(req.rid or f"req-{len(self.requests)}"),
            index=index,
            text=text,
            output_ids=tuple(self.vocab.id(t) for t in out_tokens),
            prompt_tokens=len(prompt_tokens),
            completion_tokens=len(out_tokens),
            cached_tokens=self._cached(ids),
            finish_reason=FinishReason.from_json(finish),
            **logprobs,
        )
        with self._lock:
            self._cache.append(ids + chunk.output_ids)
        return chunk.to_json()

    def generate(self, body: dict[str, Any], record: dict[str, Any] | None = None) -> Any:
        """A /generate body -> its JSON answer. Raises InvalidRequest / re.error for a 400.
        `record` is what `requests` keeps of it (default: the body)."""
        self.requests.append(body if record is None else record)
        request = GenerateRequest.parse(body)
        self._enter()
        try:
            outputs = []
            for single in request.split():
                for i in range(single.params.n):
                    outputs.append(self._one(single, i))
        finally:
            self._leave()
        return outputs[0] if len(outputs) == 1 and request.is_single else outputs

    def stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # Kept as sent, in one append: another thread's request may come in between.
        final = self.generate({**body, "stream": False}, record=body)
        text = final["text"]
        pieces = tokenize(text) or [""]
        sent = ""
        for i, piece in enumerate(pieces):
            sent += piece
            chunk = dict(final, text=sent)
            chunk["meta_info"] = dict(final["meta_info"], completion_tokens=i + 1)
            if i < len(pieces) - 1:
                chunk["meta_info"]["finish_reason"] = None
            if self.delay:
                time.sleep(self.delay / 10)
            yield chunk


class FakeEngine:
    """The call shapes of SGLang's offline Engine (sync and async), over a ToyCore."""

    def __init__(self, core: ToyCore) -> None:
        self.core = core
        self.shut_down = False

    @staticmethod
    def _body(
        prompt: Any,
        sampling_params: Any,
        input_ids: Any,
        image_data: Any,
        video_data: Any = None,
        **rest: Any,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "sampling_params": sampling_params or {},
            "return_text_in_logprobs": True,
        }
        if prompt is not None:
            body["text"] = prompt
        if input_ids is not None:
            body["input_ids"] = input_ids
        if image_data is not None:
            body["image_data"] = image_data
        if video_data is not None:
            body["video_data"] = video_data
        body.update({k: v for k, v in rest.items() if v is not None})
        return body

    def generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        image_data: Any = None,
        video_data: Any = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> Any:
        body = self._body(
            prompt,
            sampling_params,
            input_ids,
            image_data,
            video_data,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return self.core.stream(body) if stream else self.core.generate(body)

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        image_data: Any = None,
        video_data: Any = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ) -> Any:
        body = self._body(
            prompt,
            sampling_params,
            input_ids,
            image_data,
            video_data,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        if stream:
            return self._astream(body)
        return await asyncio.to_thread(self.core.generate, body)

    async def _astream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        chunks = self.core.stream(body)
        done = object()
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            yield chunk  # type: ignore[misc]

    def model_info(self) -> dict[str, Any]:
        return self.core.model_info()

    def flush_cache(self) -> bool:
        self.core.flush()
        return True

    def shutdown(self) -> None:
        self.shut_down = True
