"""Raw xgrammar, llguidance and outlines-core and radixlm's `auto` backend as systems that
compile a JSON schema and take random walks over it, each in a worker process of its own.

"Raw" is the library called directly, as a user would; `auto` is `create_backend("auto", info)`.
A walk chooses uniformly among the allowed tokens, leaning more and more towards a stop token
and `"]}` as it goes on so that it finishes; it times filling the bitmask plus accepting the
token. A worker only measures (grammar_corpus_bench.py judges the outputs) and can be killed
when a compilation runs past its time limit, which then counts as not compiled.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy
from grammar_bench import (
    LLGUIDANCE_COMPACT,
    direct_llguidance,
    direct_outlines,
    direct_xgrammar,
    greedy_encoder,
    synthetic_vocab,
)

RAW = ("xgrammar", "llguidance", "outlines")
SYSTEMS = (*RAW, "auto")
CLOSERS = frozenset(b'"]}')
LOGS = Path(tempfile.gettempdir()) / "grammar_corpus_bench"


@dataclass(frozen=True, slots=True)
class Limits:
    """How much each schema gets: walks, their length, and the time limits."""

    walks: int = 3
    later_walks: int = 1  # at the vocabularies after the first, where only time is new
    max_tokens: int = 256
    compile_s: float = 5.0
    walk_budget_s: float = 10.0  # all walks of one schema on one system
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Job:
    schema: str  # JSON text
    limits: Limits
    jump_walk: bool  # auto: one more walk applying jump-forward


# ------------------------------------------------------------------------------------ walks


class Vocab:
    """A synthetic vocabulary's tables for choosing tokens from a bitmask."""

    def __init__(self, tokens: list[bytes | None], stop_token_ids: Iterable[int]) -> None:
        self.tokens = tokens
        self.size = len(tokens)
        self.stops = frozenset(stop_token_ids)
        self.is_stop = numpy.zeros(self.size, dtype=bool)
        self.is_stop[list(self.stops)] = True
        self.is_closer = numpy.array(
            [t is not None and t != b"" and set(t) <= CLOSERS for t in tokens]
        )

    def allowed(self, bitmask: Any) -> Any:
        words = numpy.asarray(bitmask[0]).view(numpy.uint8)
        return numpy.flatnonzero(numpy.unpackbits(words, bitorder="little")[: self.size])

    def choose(self, bitmask: Any, rng: random.Random, progress: float) -> int | None:
        """Uniform among the allowed tokens; as `progress` (0 to 1) goes on, more and more
        often a stop token or one of `"]}` when allowed, so that walks finish."""
        ids = self.allowed(bitmask)
        if not ids.size:
            return None
        if rng.random() < 2 * progress:
            stops = ids[self.is_stop[ids]]
            if stops.size:
                return int(stops[0])
            closers = ids[self.is_closer[ids]]
            if closers.size:
                return int(closers[rng.randrange(closers.size)])
        return int(ids[rng.randrange(ids.size)])

    def text(self, history: list[int]) -> bytes:
        return b"".join(self.tokens[t] or b"" for t in history if t not in self.stops)


class Stepper(Protocol):
    """One walk's matcher, the same shape for every system."""

    def fill(self, bitmask: Any) -> None: ...
    def accept(self, token: int) -> bool: ...
    def error(self) -> str | None: ...
    def violation(self) -> Any: ...
    def rollback(self, count: int) -> None: ...


@dataclass(slots=True)
class Walk:
    # finished | token limit | time limit | dead end | rejected | error | fatal
    outcome: str = "token limit"
    text: bytes = b""
    tokens: int = 0
    rollbacks: int = 0
    step_s: list[float] = field(default_factory=list)
    message: str = ""


def walk(
    stepper: Stepper, vocab: Vocab, bitmask: Any, rng: random.Random, max_tokens: int,
    deadline: float = float("inf"),
) -> Walk:  # fmt: skip
    """A random walk: uniform random tokens among the allowed ones (see `Vocab.choose`). A
    non-fatal violation is rolled back and the walk goes on; a fatal one ends it unfinished.
    `step_s`: per sampled token, the time to fill the bitmask and accept the token."""
    result = Walk()
    history: list[int] = []
    clock = time.perf_counter
    for step in range(max_tokens):
        if clock() > deadline:
            result.outcome = "time limit"
            break
        start = clock()
        stepper.fill(bitmask)
        filled = clock()
        error = stepper.error()
        if error:
            result.outcome, result.message = "error", error
            break
        token = vocab.choose(bitmask, rng, step / max_tokens)
        if token is None:
            result.outcome = "dead end"
            break
        before = clock()
        ok = stepper.accept(token)
        result.step_s.append(filled - start + clock() - before)
        if not ok:
            result.outcome = "rejected"
            result.message = stepper.error() or f"token {token} refused after the mask allowed it"
            break
        history.append(token)
        found = stepper.violation()
        if found is not None:
            if found.fatal:
                result.outcome, result.message = "fatal", found.message
                break
            stepper.rollback(found.rollback)
            del history[len(history) - found.rollback :]
            result.rollbacks += 1
            continue
        if token in vocab.stops:
            result.outcome = "finished"
            break
    result.text = vocab.text(history)
    result.tokens = len(history)
    return result


def jump_walk(grammar: Any, vocab: Vocab, bitmask: Any, rng: random.Random, max_tokens: int,
              deadline: float) -> tuple[int, int]:  # fmt: skip
    """A random walk on a radixlm grammar that applies `jump_forward()` before each sampled
    token, as the engine does: (output tokens, tokens placed by jump-forward)."""
    history: list[int] = []
    jumped = 0

    def accept(token: int) -> str:
        """ "ok", "rolled back" (a violation, undone) or "end" (refused, or a fatal one)."""
        if not grammar.accept_token(token):
            return "end"
        history.append(token)
        found = grammar.violation()
        if found is None:
            return "ok"
        if found.fatal:
            return "end"
        grammar.rollback(found.rollback)
        del history[len(history) - found.rollback :]
        return "rolled back"

    for step in range(max_tokens):
        if grammar.is_terminated() or time.perf_counter() > deadline:
            break
        forced = grammar.jump_forward()
        if forced is not None:
            grammar.rollback(forced.rollback)
            del history[len(history) - forced.rollback :]
            jumped -= forced.rollback
            for token in forced.token_ids:
                verdict = accept(token)
                if verdict == "end":
                    return _output_tokens(history, vocab), max(jumped, 0)
                if verdict == "rolled back":
                    break
                jumped += 1
            if grammar.is_terminated():
                break
        grammar.fill_bitmask(bitmask, 0)
        token = vocab.choose(bitmask, rng, step / max_tokens)
        if token is None or accept(token) == "end":
            break
    return _output_tokens(history, vocab), max(jumped, 0)


def _output_tokens(history: list[int], vocab: Vocab) -> int:
    return sum(t not in vocab.stops for t in history)


# ------------------------------------------------------------------------------------ systems


class Refused(Exception):
    """The system does not compile the schema (its message says why)."""


class _XGrammarStepper:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.accept = matcher.accept_token
        self.rollback = matcher.rollback

    def fill(self, bitmask: Any) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, 0)

    def error(self) -> None:
        return None

    def violation(self) -> None:
        return None


class _LLGuidanceStepper:
    def __init__(self, matcher: Any, bitmask: Any) -> None:
        self._matcher = matcher
        self._row = (bitmask[0].data_ptr(), bitmask[0].numel() * 4)
        self.accept = matcher.consume_token
        self.rollback = matcher.rollback

    def fill(self, bitmask: Any) -> None:
        self._matcher.unsafe_compute_mask_ptr(*self._row)

    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def violation(self) -> None:
        return None


class _OutlinesStepper:
    def __init__(self, guide: Any, bitmask: Any, stops: frozenset[int]) -> None:
        self._guide = guide
        self._row = (bitmask[0].data_ptr(), bitmask[0].numel(), 4)
        self._stops = stops

    def fill(self, bitmask: Any) -> None:
        self._guide.write_mask_into(*self._row)

    def accept(self, token: int) -> bool:
        if token in self._stops:  # outlines-core allows it in final states; no transition
            return True
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, count: int) -> None:
        self._guide.rollback_state(count)

    def error(self) -> None:
        return None

    def violation(self) -> None:
        return None


class _AutoStepper:
    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
        self.accept = grammar.accept_token
        self.violation = grammar.violation
        self.rollback = grammar.rollback

    def fill(self, bitmask: Any) -> None:
        self.grammar.fill_bitmask(bitmask, 0)

    def error(self) -> None:
        return None


class Session:
    """One system over one vocabulary, inside a worker: compile, then start walks."""

    def __init__(self, system: str, tokens: list[bytes | None]) -> None:
        from radixlm.constrained import TokenizerInfo, allocate_bitmask

        self.system = system
        self.vocab = Vocab(tokens, [0])
        # The greedy encoder lets `auto` retokenize for jump-forward; raw systems never encode.
        self.info = TokenizerInfo.from_vocab(
            tokens, stop_token_ids=[0], encode=greedy_encoder(tokens)
        )
        self.bitmask = allocate_bitmask(1, len(tokens))
        if system == "xgrammar":
            self._compiler = direct_xgrammar(self.info)
        elif system == "llguidance":
            self._tokenizer = direct_llguidance(self.info)
        elif system == "outlines":
            self._vocabulary = direct_outlines(self.info)
        elif system == "auto":
            from radixlm.constrained import create_backend

            self._backend = create_backend("auto", self.info)
        else:
            raise ValueError(f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}")

    def compile(self, text: str) -> tuple[Any, dict[str, Any]]:
        """The compiled grammar and what to report about it; raises Refused."""
        try:
            return self._compile(text)
        except Refused:
            raise
        except Exception as error:  # each library raises its own kinds
            raise Refused(f"{type(error).__name__}: {error}") from None

    def _compile(self, text: str) -> tuple[Any, dict[str, Any]]:
        if self.system == "xgrammar":
            return self._compiler.compile_json_schema(
                text, any_whitespace=False, separators=(",", ":")
            ), {}
        if self.system == "llguidance":
            import llguidance

            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults=LLGUIDANCE_COMPACT
            )
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise Refused(matcher.get_error())
            return matcher, {}
        if self.system == "outlines":
            import outlines_core

            regex = outlines_core.json_schema.build_regex_from_schema(text, "")
            return outlines_core.Index(regex, self._vocabulary), {}
        from radixlm.constrained import GrammarError, GrammarSpec

        try:
            compiled = self._backend.compile(GrammarSpec("json_schema", text))
        except GrammarError as error:
            raise Refused(str(error)) from None
        about = {"served_by": compiled.served_by, "validated": list(compiled.validated)}
        return compiled, about

    def start(self, compiled: Any) -> Stepper:
        if self.system == "xgrammar":
            import xgrammar

            return _XGrammarStepper(xgrammar.GrammarMatcher(compiled))
        if self.system == "llguidance":
            return _LLGuidanceStepper(compiled.deep_copy(), self.bitmask)
        if self.system == "outlines":
            import outlines_core

            return _OutlinesStepper(
                outlines_core.Guide(compiled, max_rollback=1 << 30), self.bitmask, self.vocab.stops
            )
        return _AutoStepper(self._backend.matcher(compiled))

    def run(self, job: Job, report: Any) -> None:
        """Compile (report it), then walk (report that)."""
        start = time.perf_counter()
        try:
            compiled, about = self.compile(job.schema)
        except Refused as error:
            report({"compiled": False, "error": str(error)[:300]})
            return
        report({"compiled": True, "compile_s": time.perf_counter() - start, **about})
        limits = job.limits
        deadline = time.perf_counter() + limits.walk_budget_s
        walks = [self._walk(compiled, limits, i, deadline) for i in range(limits.walks)]
        jump = None
        if job.jump_walk and self.system == "auto":
            try:
                grammar = self._backend.matcher(compiled)
                jump = jump_walk(grammar, self.vocab, self.bitmask, random.Random(limits.seed),
                                 limits.max_tokens, time.perf_counter() + limits.walk_budget_s)  # fmt: skip
            except Exception:  # counted by the walks already
                pass
        report({"walks": [_walk_dict(w) for w in walks], "jump": jump})

    def _walk(self, compiled: Any, limits: Limits, number: int, deadline: float) -> Walk:
        try:
            stepper = self.start(compiled)
            rng = random.Random(limits.seed + number)
            return walk(stepper, self.vocab, self.bitmask, rng, limits.max_tokens, deadline)
        except Exception:  # a library failing mid-walk: the walk ends in an error
            return Walk(outcome="error", message=traceback.format_exc(limit=-2)[-300:])


def _walk_dict(w: Walk) -> dict[str, Any]:
    return {"outcome": w.outcome, "text": w.text, "tokens": w.tokens, "rollbacks": w.rollbacks,
            "step_s": w.step_s, "message": w.message[:300]}  # fmt: skip


def serve(conn: Any, system: str, vocab_size: int, log: str) -> None:
    """A worker process: build the session, say ready, then run jobs until None. The
    libraries' own messages (xgrammar's warnings) go to the `log` file."""
    import torch

    torch.set_num_threads(1)
    with open(log, "a") as out:
        os.dup2(out.fileno(), 2)
    try:
        session = Session(system, synthetic_vocab(vocab_size))
    except Exception as error:
        conn.send({"unavailable": f"{type(error).__name__}: {error}"})
        return
    conn.send({"ready": True})
    while (job := conn.recv()) is not None:
        session.run(job, conn.send)


class Worker:
    """A worker process for one system and vocabulary. After a kill a new one starts at
    once, in the background, so that it is ready by the next schema."""

    def __init__(self, system: str, vocab_size: int, start_s: float = 300.0) -> None:
        self.system = system
        self.vocab_size = vocab_size
        self.start_s = start_s
        self.unavailable = ""
        self._process: Any = None
        self._conn: Any = None
        self._ready = False
        self._spawn()

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        LOGS.mkdir(parents=True, exist_ok=True)
        log = str(LOGS / f"{self.system}-{self.vocab_size}.log")
        self._process = context.Process(
            target=serve, args=(theirs, self.system, self.vocab_size, log), daemon=True
        )
        self._process.start()
        theirs.close()
        self._conn, self._ready = ours, False

    def _wait_ready(self) -> None:
        if self._ready or self.unavailable:
            return
        try:
            hello = self._conn.recv() if self._conn.poll(self.start_s) else {}
        except (EOFError, OSError) as error:
            hello = {"unavailable": f"the worker died while starting: {error!r}"}
        if "ready" in hello:
            self._ready = True
            return
        self.unavailable = hello.get("unavailable", "the worker did not start in time")
        self.kill()

    def run(self, job: Job) -> dict[str, Any]:
        """{compiled, compile_s, error, walks, jump, timeout, ...} for one schema."""
        self._wait_ready()
        if self.unavailable:
            return {"compiled": False, "unavailable": True, "error": self.unavailable}
        limits = job.limits
        try:
            self._conn.send(job)
            if not self._conn.poll(limits.compile_s):
                self._restart()
                return {"compiled": False, "timeout": True,
                        "error": f"compile took longer than {limits.compile_s:g} s"}  # fmt: skip
            result: dict[str, Any] = self._conn.recv()
            if not result["compiled"]:
                return result
            if not self._conn.poll(2 * limits.walk_budget_s + 60):  # the walks, the jump walk
                self._restart()
                stuck = _walk_dict(Walk(outcome="time limit"))
                return {**result, "walks": [stuck] * limits.walks, "walk_timeout": True}
            return {**result, **self._conn.recv()}
        except (EOFError, OSError) as error:  # the worker died (a crash in native code)
            self._restart()
            return {"compiled": False, "crashed": True, "error": f"worker died: {error!r}"}

    def _restart(self) -> None:
        self.kill()
        self._spawn()

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = self._conn = None
        self._ready = False

    def close(self) -> None:
        if self._process is not None and self._ready:
            try:
                self._conn.send(None)
                self._process.join(10)
            except OSError:
                pass
        self.kill()


class InProcess:
    """Runs jobs in this process, without time limits (for tests and debugging)."""

    def __init__(self, system: str, vocab_size: int) -> None:
        self.system = system
        self.unavailable = ""
        try:
            self._session: Session | None = Session(system, synthetic_vocab(vocab_size))
        except Exception as error:
            self._session, self.unavailable = None, f"{type(error).__name__}: {error}"

    def run(self, job: Job) -> dict[str, Any]:
        if self._session is None:
            return {"compiled": False, "unavailable": True, "error": self.unavailable}
        found: dict[str, Any] = {}
        self._session.run(job, found.update)
        return found

    def close(self) -> None:
        self._session = None
