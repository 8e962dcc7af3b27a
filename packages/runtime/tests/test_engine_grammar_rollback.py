"""Grammar violations through the engine: a grammar that validates completed values reports a
Violation after accepting a token; the engine takes the tokens back (output, logprobs, KV) and
decodes on, or ends the sequence with an abort when the retries are used up. Driven by a
scripted fake grammar, so the outcome does not depend on the (random) model."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.constrained.interfaces import Violation
from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Thread mode only: they script the grammar service's matchers.
pytestmark = pytest.mark.thread_only("they script the grammar service's matchers")

# The constraint only has to compile; the fake grammar below decides every token.
CONSTRAINED: dict[str, Any] = {"temperature": 0, "max_new_tokens": 40, "regex": "[a-z ]+"}
GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
FIRST = " the radix tree is a cache"  # what the grammar forces first
RETRY = " the batch"  # what it forces instead once the first attempt is taken back


def _bit(index: int) -> int:
    return 1 << index if index < 31 else -(1 << 31)  # int32 words: bit 31 is the sign


class ScriptedGrammar:
    """Forces `first` (then EOS) token by token. Once `at` tokens are accepted it reports a
    violation taking back `rollback` of them and forces `retry` (then EOS) from there; with
    `fatal_at`, the retry's `fatal_at`-th token reports a fatal violation instead.
    `committed`: the tokens before the retry point, then everything once no more
    violation can come (when `with_committed`)."""

    def __init__(
        self,
        first: list[int],
        retry: list[int],
        eos: int,
        at: int,
        rollback: int,
        fatal_at: int | None = None,
        with_committed: bool = False,
    ) -> None:
        self.plans = [[*first, eos], [*first[: at - rollback], *retry, eos]]
        self.eos = eos
        self.at = at
        self.rollback_count = rollback
        self.fatal_at = fatal_at
        self.with_committed = with_committed
        self.accepted: list[int] = []
        self.attempt = 0
        self.pending: Violation | None = None
        self.rollbacks_seen: list[int] = []

    # -- Grammar ---------------------------------------------------------------------------

    def _next(self) -> int | None:
        plan = self.plans[min(self.attempt, 1)]
        return plan[len(self.accepted)] if len(self.accepted) < len(plan) else None

    def accept_token(self, token_id: int) -> bool:
        if self.pending is not None or token_id != self._next():
            return False
        self.accepted.append(token_id)
        count = len(self.accepted)
        if self.attempt == 0 and count == self.at:
            self.pending = Violation(
                keyword="uniqueItems",
                pointer="/1",
                message="the value at /1 breaks 'uniqueItems': [1, 1] has non-unique elements",
                rollback=self.rollback_count,
            )
        elif self.attempt == 1 and self.fatal_at is not None and count == self.fatal_at:
            self.pending = Violation(
                keyword="uniqueItems",
                pointer="/1",
                message="the output kept breaking 'uniqueItems'; gave up after 1 retries",
                rollback=0,
                fatal=True,
            )
        return True

    def violation(self) -> Violation | None:
        return self.pending

    def fill_bitmask(self, bitmask: Any, row: int = 0) -> None:
        bitmask[row] = 0
        token = self._next()
        if self.pending is None and token is not None:
            bitmask[row, token >> 5] = _bit(token & 31)

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.eos

    def rollback(self, num_tokens: int) -> None:
        self.rollbacks_seen.append(num_tokens)
        if num_tokens:
            del self.accepted[-num_tokens:]
        if self.pending is not None:
            self.pending = None
            self.attempt += 1

    def jump_forward(self) -> None:
        return None

    def fork(self) -> ScriptedGrammar:
        raise NotImplementedError("one sequence per request here")

    @property
    def committed(self) -> int:
        if not self.with_committed:
            raise AttributeError("committed")
        if self.attempt == 0:
            return min(len(self.accepted), self.at - self.rollback_count)
        return len(self.accepted)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    with Engine(str(model_dir), show_progress=False, max_total_tokens=4096) as eng:
        yield eng


class Scripts:
    """Hands each new constrained sequence the next scripted grammar (the engine's matcher
    replaced by this)."""

    def __init__(self, engine: Engine, **script: Any) -> None:
        tok = engine.tokenizer
        self.first = list(tok.encode(FIRST))
        self.retry = list(tok.encode(RETRY))
        self.eos = engine.eos_token_ids[0]
        self.script = script
        self.made: list[ScriptedGrammar] = []
        self.lock = threading.Lock()

    def __call__(self, compiled: Any) -> ScriptedGrammar:
        grammar = ScriptedGrammar(self.first, self.retry, self.eos, **self.script)
        with self.lock:
            self.made.append(grammar)
        return grammar

    def expected(self, at: int, rollback: int) -> list[int]:
        return self.first[: at - rollback] + self.retry


@pytest.fixture
def scripted(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Any:
    def install(**script: Any) -> Scripts:
        scripts = Scripts(engine, **script)
        monkeypatch.setattr(engine.grammar, "matcher", scripts)
        return scripts

    return install


def _generated(out: dict[str, Any], eos: int) -> list[int]:
    ids = list(out["output_ids"])
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.mark.parametrize(
    ("at", "rollback"),
    [(4, 2), (4, 1), (5, 5)],
    ids=["two tokens back", "only the violating token", "the whole output"],
)
def test_violation_takes_tokens_back_and_the_output_is_what_the_grammar_allowed(
    engine: Engine, scripted: Any, at: int, rollback: int
) -> None:
    scripts = scripted(at=at, rollback=rollback)
    before = engine.server_info()["grammar_rollbacks"]
    out = engine.generate("a prompt for the grammar", CONSTRAINED)
    expected = scripts.expected(at, rollback)
    assert _generated(out, scripts.eos) == expected
    assert out["text"] == engine.tokenizer.decode(expected)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["meta_info"]["grammar"]["rollbacks"] == 1
    assert engine.server_info()["grammar_rollbacks"] == before + 1
    assert scripts.made[0].rollbacks_seen == [rollback]
    engine.check_invariants()


def test_rolled_back_tokens_lose_their_logprobs(engine: Engine, scripted: Any) -> None:
    scripts = scripted(at=4, rollback=2)
    out = engine.generate("a prompt for the grammar", CONSTRAINED, return_logprob=True)
    ids = out["output_ids"]
    logprobs = out["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == ids
    assert _generated(out, scripts.eos) == scripts.expected(4, 2)
    engine.check_invariants()


def test_fatal_violation_ends_the_sequence_with_an_abort_and_its_message(
    engine: Engine, scripted: Any
) -> None:
    scripted(at=4, rollback=2, fatal_at=3)
    out = engine.generate("a prompt for the grammar", CONSTRAINED)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert reason["message"] == "the output kept breaking 'uniqueItems'; gave up after 1 retries"
    engine.check_invariants()


@pytest.mark.parametrize("fatal_at", [None, 3], ids=["retried", "fatal"])
def test_other_requests_of_the_batch_are_unaffected(
    engine: Engine, scripted: Any, fatal_at: int | None
) -> None:
    alone = [engine.generate(p, GREEDY) for p in ("the cache", "a batch of requests")]
    scripts = scripted(at=4, rollback=2, fatal_at=fatal_at)
    outs = engine.generate(
        ["the cache", "a prompt for the grammar", "a batch of requests"],
        [GREEDY, CONSTRAINED, GREEDY],
    )
    assert outs[0]["output_ids"] == alone[0]["output_ids"]
    assert outs[2]["output_ids"] == alone[1]["output_ids"]
    assert "grammar" not in outs[0]["meta_info"]
    if fatal_at is None:
        assert _generated(outs[1], scripts.eos) == scripts.expected(4, 2)
    else:
        assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.check_invariants()


def test_stream_never_shows_tokens_the_grammar_may_still_take_back(
    engine: Engine, scripted: Any
) -> None:
    scripts = scripted(at=4, rollback=2, with_committed=True)
    chunks = list(engine.generate("a prompt for the grammar", CONSTRAINED, stream=True))
    final = chunks[-1]
    expected = scripts.expected(4, 2)
    assert _generated(final, scripts.eos) == expected
    for chunk in chunks:
        assert final["text"].startswith(chunk["text"])
        assert final["output_ids"][: len(chunk["output_ids"])] == chunk["output_ids"]
    engine.check_invariants()


def test_incremental_stream_adds_up_to_the_final_output(model_dir: Path) -> None:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=1024,
        incremental_streaming_output=True,
    ) as eng:
        scripts = Scripts(eng, at=4, rollback=2, with_committed=True)
        eng.grammar.matcher = scripts  # type: ignore[method-assign]
        chunks = list(eng.generate("a prompt for the grammar", CONSTRAINED, stream=True))
        whole = eng.tokenizer.decode(scripts.expected(4, 2))
        eng.check_invariants()
    assert "".join(c["text"] for c in chunks) == whole
    ids = [t for c in chunks for t in c["output_ids"]]
    assert _generated({"output_ids": ids}, scripts.eos) == scripts.expected(4, 2)


def test_meta_info_names_the_backend_of_a_constrained_request(engine: Engine) -> None:
    out = engine.generate("pick", {"temperature": 0, "regex": "(yes|no)"})
    grammar = out["meta_info"]["grammar"]
    assert grammar["backend"] in ("xgrammar", "llguidance", "outlines")
    assert grammar["validated"] == [] and grammar["rollbacks"] == 0
    assert "grammar" not in engine.generate("free", GREEDY)["meta_info"]


def test_server_info_reports_the_grammar_settings(engine: Engine) -> None:
    info = engine.server_info()
    assert info["grammar_backend"] == "auto"
    assert info["strict_constraints"] is False
    assert info["max_constraint_bytes"] == 8 * 1024 * 1024
