"""Speculative decoding through the engine: greedy outputs equal to decoding without it on every
tiny architecture (alone, batched, with grammars, logprobs and stops), sampled outputs with
the same distribution, and no KV slot lost; with NGRAM drafts and with a draft model (STANDALONE).

Random tiny models rarely repeat themselves, so beside NGRAM's own drafts the tests put in a
drafter that proposes the reference continuation with every third token wrong: drafts are
then accepted in full, in part and not at all, step after step.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import CorruptedOracle, build_tiny_model
from radixlm.runtime.speculative.costs import StepCost

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PROMPTS = [
    "the cat sat on the mat and the cat sat on the",
    "def add(a, b): return a + b\ndef add(a, b):",
    "hello",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """An engine with `cpu_threads` sets this process's torch threads: put them back, so that
    later tests run as they would alone."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-models")
    return {
        arch: build_tiny_model(root / arch, architecture=arch, init_std=0.3)
        for arch in ARCHITECTURES
    }


def _engine(path: Path, spec: bool, **kwargs: Any) -> Engine:
    extra = {"speculative_algorithm": "NGRAM"} if spec else {}
    return Engine(str(path), show_progress=False, max_total_tokens=4096, **extra, **kwargs)


def _ids(outputs: Any) -> list[list[int]]:
    return [o["output_ids"] for o in (outputs if isinstance(outputs, list) else [outputs])]


def _use(engine: Engine, drafter: Any) -> None:
    engine.run_in_loop(lambda core: setattr(core.scheduler, "drafter", drafter))


def _stats(engine: Engine) -> dict[str, Any]:
    return engine.get_server_info()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_outputs_are_the_same_with_speculation(models: dict[str, Path], arch: str) -> None:
    path = models[arch]
    with _engine(path, spec=False) as engine:
        reference = _ids(engine.generate(PROMPTS, GREEDY))
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    with _engine(path, spec=True) as engine:
        # NGRAM's own drafts: alone, then batched (the second time the radix cache holds
        # every answer: its continuations are accepted whole). Its step costs are the
        # assumed ones: measured on a loaded machine they can price every draft out.
        engine.run_in_loop(
            lambda core: setattr(
                core.scheduler.drafter,
                "costs",
                dataclasses.replace(core.scheduler.drafter.costs, target=StepCost.assumed()),
            )
        )
        assert _ids(engine.generate(PROMPTS[0], GREEDY)) == reference[:1]
        assert _ids(engine.generate(PROMPTS, GREEDY)) == reference
        assert _stats(engine)["spec_accepted_tokens"] > 0
        engine.check_invariants()
        engine.flush_cache()
        _use(engine, CorruptedOracle(dict(zip(map(tuple, prompts), reference, strict=True))))
        before = _stats(engine)
        assert _ids(engine.generate(PROMPTS, GREEDY)) == reference
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            assert _ids(engine.generate(prompt, GREEDY)) == [expected]
        after = _stats(engine)
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        assert 0 < accepted < drafted  # accepted in part: the rejections were exercised
        engine.check_invariants()


def test_drafts_beside_prefill_chunks_on_the_cpu_decode_path(models: dict[str, Path]) -> None:
    """One torch thread (the CPU decode path on) and small prefill chunks: verify steps share
    steps with other requests' prefill chunks (the decodes on the path, the chunks through
    the model's forward); the outputs stay those of decoding without drafts."""
    path = models["Qwen3ForCausalLM"]
    texts = [*PROMPTS, " ".join(["a long prompt that keeps being prefilled"] * 6)]
    settings = {"cpu_threads": 1, "chunked_prefill_size": 8}
    with _engine(path, spec=False, **settings) as engine:
        reference = _ids(engine.generate(texts, GREEDY))
        prompts = [engine.tokenizer(t).input_ids for t in texts]
    with _engine(path, spec=True, **settings) as engine:
        assert engine.run_in_loop(lambda core: core.executor.runner.cpu_decode is not None)
        _use(engine, CorruptedOracle(dict(zip(map(tuple, prompts), reference, strict=True))))
        assert _ids(engine.generate(texts, GREEDY)) == reference
        assert _stats(engine)["spec_accepted_tokens"] > 0
        engine.check_invariants()


def test_grammars_logprobs_and_stops_are_kept(models: dict[str, Path]) -> None:
    path = models["LlamaForCausalLM"]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    cases: list[dict[str, Any]] = [
        {"temperature": 0.0, "max_new_tokens": 40, "json_schema": json.dumps(schema)},
        {"temperature": 0.0, "max_new_tokens": 40, "regex": "(ab|cd)+[0-9]{3,6}x"},
    ]
    asks = {"return_logprob": True, "top_logprobs_num": 2}
    with _engine(path, spec=False) as engine:
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
        constrained = [_ids(engine.generate(PROMPTS, c)) for c in cases]
        scored = engine.generate(PROMPTS, GREEDY, **asks)
        # A stop token the answer reaches mid-way: the speculative run must stop there too.
        stop_at = scored[0]["output_ids"][7]
        stopped = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [stop_at]})
    references = {tuple(p): o for p, o in zip(prompts, _ids(scored), strict=True)}
    with _engine(path, spec=True) as engine:
        for case, expected in zip(cases, constrained, strict=True):
            assert _ids(engine.generate(PROMPTS, case)) == expected
        for out in engine.generate(PROMPTS, cases[0]):
            if out["meta_info"]["finish_reason"]["type"] == "stop":  # not cut by the length
                assert set(json.loads(out["text"])) == {"name", "n"}
        _use(engine, CorruptedOracle(references))
        got = engine.generate(PROMPTS, GREEDY, **asks)
        assert _ids(got) == _ids(scored)
        for mine, theirs in zip(got, scored, strict=True):
            a, b = mine["meta_info"], theirs["meta_info"]
            assert len(a["output_token_logprobs"]) == len(b["output_token_logprobs"])
            for x, y in zip(a["output_token_logprobs"], b["output_token_logprobs"], strict=True):
                assert x[1] == y[1] and math.isclose(x[0], y[0], abs_tol=1e-3)
            assert [[t[1] for t in top] for top in a["output_top_logprobs"]] == [
                [t[1] for t in top] for top in b["output_top_logprobs"]
            ]
        out = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [stop_at]})
        assert out["output_ids"] == stopped["output_ids"]
        assert out["meta_info"]["finish_reason"] == stopped["meta_info"]["finish_reason"]
        # Constrained runs with the oracle's drafts (a forbidden draft token ends the draft).
        constrained_refs = {tuple(p): o for p, o in zip(prompts, constrained[1], strict=True)}
        _use(engine, CorruptedOracle(constrained_refs))
        assert _ids(engine.generate(PROMPTS, cases[1])) == constrained[1]
        assert _stats(engine)["spec_accepted_tokens"] > 0
        engine.check_invariants()


def test_max_new_tokens_and_n_are_respected(models: dict[str, Path]) -> None:
    path = models["Qwen2ForCausalLM"]
    with _engine(path, spec=True) as engine:
        prompt = engine.tokenizer(PROMPTS[1]).input_ids
        with _engine(path, spec=False) as plain:
            reference = plain.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 30})["output_ids"]
        _use(engine, CorruptedOracle({tuple(prompt): reference}))
        for limit in (1, 2, 3, 5, 9):
            out = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": limit})
            assert out["output_ids"] == reference[:limit]
        outs = engine.generate(
            PROMPTS[1], {"temperature": 0.8, "max_new_tokens": 12, "n": 3, "seed": 5}
        )
        assert len(outs) == 3 and all(len(o["output_ids"]) <= 12 for o in outs)
        engine.check_invariants()


def _two_sample_p(a: Counter[int], b: Counter[int]) -> float:
    """p-value of the chi-square test that two samples come from one distribution (cells
    with fewer than 10 expected draws merged)."""
    total_a, total_b = sum(a.values()), sum(b.values())
    cells: list[tuple[int, int]] = []
    small_a = small_b = 0
    for token in set(a) | set(b):
        if a[token] + b[token] < 20:
            small_a += a[token]
            small_b += b[token]
        else:
            cells.append((a[token], b[token]))
    if small_a + small_b:
        cells.append((small_a, small_b))
    stat = 0.0
    for x, y in cells:
        row = x + y
        for observed, total in ((x, total_a), (y, total_b)):
            expected = row * total / (total_a + total_b)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_have_the_same_distribution(tmp_path: Path) -> None:
    """At temperature 1 (and with top-k), the tokens at the positions drafts decide are
    distributed as without speculation: a chi-square test of homogeneity over many seeds, on
    a model with a small vocabulary."""
    path = build_tiny_model(tmp_path / "small", tokenizer_vocab_size=300, init_std=0.08)
    count = 900
    samples: dict[bool, list[Counter[int]]] = {}
    for spec in (False, True):
        with _engine(path, spec=spec, max_running_requests=64) as engine:
            prompt = engine.tokenizer(PROMPTS[0]).input_ids
            if spec:
                # Drafts from the greedy answer: likely tokens, accepted often, not always.
                greedy = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 4})
                _use(engine, CorruptedOracle({tuple(prompt): greedy["output_ids"]}, 3))
            params = [
                {"temperature": 1.0, "top_k": 40, "max_new_tokens": 4, "seed": seed}
                for seed in range(count)
            ]
            outs = engine.generate([PROMPTS[0]] * count, params)
            positions = [Counter(o["output_ids"][i] for o in outs) for i in (1, 2, 3)]
            if spec:
                assert engine.get_server_info()["spec_accepted_tokens"] > 0
                engine.check_invariants()
            samples[spec] = positions
    for position in range(3):
        p = _two_sample_p(samples[False][position], samples[True][position])
        assert p > 1e-4, (position, p, samples[False][position], samples[True][position])


# ----------------------------------------------------------------- STANDALONE (a draft model)
#
# The draft model keeps K/V for the target's slots. A draft that is the target itself proposes
# what the target would pick, so nearly every draft is accepted — unless that K/V is stale or
# in the wrong slots, which these tests see as refusals. A draft of other random weights is
# refused nearly always: the outputs must not change either way.

DRAFT_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
LONG = " ".join(["a longer prompt that is prefilled in chunks"] * 5)


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-models")
    found = {
        arch: build_tiny_model(root / arch, architecture=arch, init_std=0.3)
        for arch in DRAFT_ARCHITECTURES
    }
    # Another model with the same tokenizer: one layer, other weights.
    found["other"] = build_tiny_model(root / "other", num_layers=1, seed=11, init_std=0.3)
    return found


def _always_draft(core: Any) -> None:
    """Draft in every step (a draft as large as the target is never worth its cost)."""
    core.scheduler.drafter.threshold = lambda size: 0.0


def _standalone(path: Path, draft: Path | None, **kwargs: Any) -> Engine:
    extra: dict[str, Any] = {}
    if draft is not None:
        extra = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft)}
    kwargs.setdefault("max_total_tokens", 4096)
    engine = Engine(str(path), show_progress=False, **extra, **kwargs)
    if draft is not None:
        engine.run_in_loop(_always_draft)
    return engine


def _spec(engine: Engine) -> tuple[int, int]:
    info = engine.get_server_info()
    return info["spec_draft_tokens"], info["spec_accepted_tokens"]


@pytest.mark.parametrize("arch", DRAFT_ARCHITECTURES)
@pytest.mark.parametrize("cpu_threads", [None, 1])
def test_greedy_outputs_are_the_same_with_a_draft_model(
    draft_models: dict[str, Path], arch: str, cpu_threads: int | None
) -> None:
    """Alone, batched with a prompt prefilled in chunks, and again from the radix cache;
    with one torch thread both models take the CPU decode path."""
    path = draft_models[arch]
    texts = [*PROMPTS, LONG]
    settings: dict[str, Any] = {"chunked_prefill_size": 8}
    if cpu_threads is not None:
        settings["cpu_threads"] = cpu_threads
    with _standalone(path, None, **settings) as engine:
        reference = _ids(engine.generate(texts, GREEDY))
    with _standalone(path, path, **settings) as engine:
        assert _ids(engine.generate(texts[0], GREEDY)) == reference[:1]
        assert _ids(engine.generate(texts, GREEDY)) == reference
        assert _ids(engine.generate(texts, GREEDY)) == reference  # prefixes from the cache
        drafted, accepted = _spec(engine)
        # The target as its own draft: a refusal means the draft's K/V was wrong.
        assert drafted > 50 and accepted >= 0.95 * drafted, (drafted, accepted)
        engine.check_invariants()
    with _standalone(path, draft_models["other"], **settings) as engine:
        assert _ids(engine.generate(texts, GREEDY)) == reference
        drafted, accepted = _spec(engine)
        assert drafted > 0 and accepted < drafted
        engine.check_invariants()


def test_a_quantized_copy_of_the_target_drafts(draft_models: dict[str, Path]) -> None:
    path = draft_models["LlamaForCausalLM"]
    with _standalone(path, None) as engine:
        reference = _ids(engine.generate(PROMPTS, GREEDY))
    with _standalone(path, path, speculative_draft_model_quantization="int4") as engine:
        assert _ids(engine.generate(PROMPTS, GREEDY)) == reference
        drafted, accepted = _spec(engine)
        # int4 noise flips many of a tiny random model's close calls: some are accepted.
        assert 0 < accepted < drafted, (drafted, accepted)
        assert engine.get_server_info()["speculative_algorithm"] == "STANDALONE"
        engine.check_invariants()


def test_draft_model_with_grammars_logprobs_and_retraction(draft_models: dict[str, Path]) -> None:
    """A JSON schema, logprobs, and a pool small enough that requests are retracted and
    recomputed (their slots, and the draft's K/V of them, change under them)."""
    path = draft_models["Qwen3ForCausalLM"]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    constrained = {"temperature": 0.0, "max_new_tokens": 40, "json_schema": json.dumps(schema)}
    long = {**GREEDY, "max_new_tokens": 60}
    asks = {"return_logprob": True}
    small = {"max_total_tokens": 160, "chunked_prefill_size": 16}
    # distinct prompts: copies of one would wait for its prefill and share it, and fit
    crowd = [f"{i}: {prompt}" for i in (1, 2) for prompt in PROMPTS]
    with _standalone(path, None) as engine:
        expected = _ids(engine.generate(PROMPTS, constrained))
        scored = engine.generate(PROMPTS, GREEDY, **asks)
    with _standalone(path, None, **small) as engine:
        crowded = _ids(engine.generate(crowd, long))
    with _standalone(path, path) as engine:
        assert _ids(engine.generate(PROMPTS, constrained)) == expected
        got = engine.generate(PROMPTS, GREEDY, **asks)
        assert _ids(got) == _ids(scored)
        for mine, theirs in zip(got, scored, strict=True):
            a = mine["meta_info"]["output_token_logprobs"]
            b = theirs["meta_info"]["output_token_logprobs"]
            assert [t[1] for t in a] == [t[1] for t in b]
            assert all(abs(x[0] - y[0]) < 1e-3 for x, y in zip(a, b, strict=True))
        engine.check_invariants()
    with _standalone(path, path, **small) as engine:
        assert _ids(engine.generate(crowd, long)) == crowded
        assert engine.get_server_info()["num_retractions"] > 0
        drafted, accepted = _spec(engine)
        assert accepted >= 0.9 * drafted, (drafted, accepted)
        engine.check_invariants()


def test_sampled_tokens_keep_their_distribution_with_a_draft_model(tmp_path: Path) -> None:
    """At temperature 1 with top-k: the tokens at the positions drafts decide are
    distributed as without speculation (chi-square over many seeds, small vocabulary)."""
    path = build_tiny_model(tmp_path / "small", tokenizer_vocab_size=300, init_std=0.08)
    count = 900
    samples: dict[bool, list[Counter[int]]] = {}
    for spec in (False, True):
        with _standalone(path, path if spec else None, max_running_requests=64) as engine:
            params = [
                {"temperature": 1.0, "top_k": 40, "max_new_tokens": 4, "seed": seed}
                for seed in range(count)
            ]
            outs = engine.generate([PROMPTS[0]] * count, params)
            samples[spec] = [Counter(o["output_ids"][i] for o in outs) for i in (1, 2, 3)]
            if spec:
                assert _spec(engine)[1] > 0
                engine.check_invariants()
    for position in range(3):
        p = _two_sample_p(samples[False][position], samples[True][position])
        assert p > 1e-4, (position, p)


# ----------------------------------------------------------------------- EAGLE / EAGLE-3 heads
#
# Random heads in the published layouts propose tokens the target rarely picks, so the
# outputs are checked against decoding without drafts, and each proposal against the head
# run from scratch over the whole sequence (the target's features from transformers): the
# engine's head K/V, kept per slot, caught up and reused across steps and the radix cache,
# must give what a fresh computation gives.

EAGLE_KINDS = ("EAGLE", "EAGLE3")


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from radixlm.runtime.fixtures import build_random_eagle_head

    root = tmp_path_factory.mktemp("eagle")
    target = build_tiny_model(root / "target", num_layers=6, init_std=0.3)
    return {
        "target": target,
        "EAGLE": build_random_eagle_head(target, root / "eagle", "EAGLE", num_layers=2),
        "EAGLE3": build_random_eagle_head(target, root / "eagle3", "EAGLE3", draft_vocab_size=300),
    }


def _reference_drafts(
    target: Path, head_dir: Path, kind: str, sequences: list[tuple[tuple[int, ...], int]]
) -> list[list[int]]:
    """Each (sequence, count): the head's greedy chain after the sequence, computed from
    scratch — the target's features by transformers, the head over every position at once
    with a pool of its own."""
    import torch
    import transformers

    from radixlm.runtime.attention import create_backend
    from radixlm.runtime.memory import KVPool, ReqToTokenPool
    from radixlm.runtime.speculative.eagle import EagleHead, _tensors

    model = transformers.AutoModelForCausalLM.from_pretrained(str(target)).eval()
    config = json.loads((head_dir / "config.json").read_text())
    hf = transformers.LlamaConfig.from_pretrained(str(head_dir))
    from radixlm.runtime.models.arch import ArchConfig

    arch = ArchConfig.from_hf(hf, vocab_size=model.config.vocab_size)
    head = EagleHead(
        arch, kind, arch.hidden_size, config.get("draft_vocab_size"), False, torch.float32
    )
    head.load_weights(_tensors(head_dir))
    layers = model.config.num_hidden_layers
    capture = (2, layers // 2, layers - 3)
    results = []
    for sequence, count in sequences:
        ids = torch.tensor([sequence])
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
        if kind == "EAGLE":
            features = states[-1][0, :-1]
        else:
            features = head.project(torch.cat([states[i][0, :-1] for i in capture], dim=-1))
        size = len(sequence) + count
        pool = KVPool(
            head.num_layers, size + 1, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu"
        )
        table = ReqToTokenPool(1, size + 1, "cpu")
        backend = create_backend("torch_native", pool)

        step = (model, head, table, backend)
        p = len(sequence) - 1
        token, feature = _head_step(*step, list(sequence[1:]), 0, features)
        chain = [token]
        for depth in range(1, count):
            token, feature = _head_step(*step, [chain[-1]], p + depth - 1, feature)
            chain.append(token)
        results.append(chain)
    return results


def _head_step(
    model: Any, head: Any, table: Any, backend: Any, tokens: list[int], start: int, feats: Any
) -> tuple[int, Any]:
    """One from-scratch head forward over `tokens` at positions `start..`: the greedy token
    after the last and the feature it predicts there."""
    import torch

    from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch

    entry = BatchEntry(0, tokens, start, list(range(start, start + len(tokens))))
    batch = ForwardBatch.build([entry], table.req_to_token)
    batch.write_req_to_token()
    backend.prepare(batch)
    with torch.no_grad():
        embeds = model.model.embed_tokens(batch.input_ids)
        hidden, feature = head(embeds, feats, batch.positions, backend)
        if head.lm_head is not None:
            draft = int(head.lm_head(hidden[-1]).argmax())
            return draft + int(head.d2t[draft]), feature[-1:]
        return int(model.lm_head(hidden[-1]).argmax()), feature[-1:]


@pytest.mark.parametrize("kind", EAGLE_KINDS)
def test_eagle_heads_keep_greedy_outputs_and_propose_what_a_fresh_run_does(
    eagle_models: dict[str, Path], kind: str
) -> None:
    target = eagle_models["target"]
    texts = [*PROMPTS, LONG]
    settings: dict[str, Any] = {"chunked_prefill_size": 8, "max_total_tokens": 4096}
    with Engine(str(target), show_progress=False, **settings) as engine:
        reference = _ids(engine.generate(texts, GREEDY))
        prompts = [engine.tokenizer(t).input_ids for t in texts]
    # The head proposes (and is checked), but the steps verify the oracle's drafts, so that
    # drafts are accepted in full, in part and not at all: the head then catches up on
    # several accepted tokens at once.
    oracle = CorruptedOracle(dict(zip(map(tuple, prompts), reference, strict=True)))
    spec = {"speculative_algorithm": kind, "speculative_draft_model_path": str(eagle_models[kind])}
    with Engine(str(target), show_progress=False, **settings, **spec) as engine:
        proposed: list[tuple[tuple[int, ...], int, list[int]]] = []

        def record(core: Any) -> None:
            drafter = core.scheduler.drafter
            _always_draft(core)
            propose = drafter.propose

            def logged(asks: Any) -> list[list[int]]:
                out = propose(asks)
                proposed.extend(
                    (tuple(req.tokens()), count, draft)
                    for (req, count), draft in zip(asks, out, strict=True)
                )
                return [oracle._one(req, len(d)) for (req, _c), d in zip(asks, out, strict=True)]

            drafter.propose = logged

        engine.run_in_loop(record)
        assert _ids(engine.generate(texts, GREEDY)) == reference
        assert _ids(engine.generate(texts, GREEDY)) == reference  # prefixes from the cache
        info = engine.get_server_info()
        assert info["speculative_algorithm"] == kind
        assert 0 < info["spec_accepted_tokens"] < info["spec_draft_tokens"]
        engine.check_invariants()
    assert len(proposed) > 50
    picked = proposed[:: max(len(proposed) // 40, 1)]
    fresh = _reference_drafts(
        target, eagle_models[kind], kind, [(seq, len(d)) for seq, _c, d in picked]
    )
    same = sum(draft == expected for (_s, _c, draft), expected in zip(picked, fresh, strict=True))
    assert same >= 0.9 * len(picked), (same, len(picked))


# ----------------------------------------------------------------- tensor parallelism, LoRA


def test_drafts_under_tensor_parallelism(draft_models: dict[str, Path], tmp_path: Path) -> None:
    """TP=2 over gloo: NGRAM's drafts from the radix cache (the same prompts again: their
    answers are cached, the drafts accepted whole), and a draft model on rank 0 (one layer,
    other weights: mostly refused); the outputs of the unsplit engine without drafts."""
    path = build_tiny_model(tmp_path / "deep", "Qwen2ForCausalLM", num_layers=12, init_std=0.3)
    split = {"tp_size": 2, "dist_timeout": 30, "show_progress": False, "max_total_tokens": 4096}
    with _engine(path, spec=False) as engine:
        reference = _ids(engine.generate(PROMPTS, GREEDY))
    with Engine(str(path), speculative_algorithm="NGRAM", **split) as engine:
        assert engine.server_info()["tp_size"] == 2
        assert _ids(engine.generate(PROMPTS, GREEDY)) == reference
        assert _ids(engine.generate(PROMPTS, GREEDY)) == reference
        assert engine.server_info()["spec_accepted_tokens"] > 0
        engine.check_invariants()
    draft = {
        "speculative_algorithm": "STANDALONE",
        "speculative_draft_model_path": str(draft_models["other"]),
    }
    with Engine(str(path), **draft, **split) as engine:
        assert _ids(engine.generate(PROMPTS * 2, GREEDY)) == reference * 2
        assert engine.server_info()["spec_draft_tokens"] > 0
        engine.check_invariants()


def test_drafts_with_lora_adapters(tmp_path: Path) -> None:
    """Requests under an adapter and without one, batched, verify drafts with their own
    adapter's weights: the outputs of decoding without drafts."""
    from radixlm.runtime.fixtures import build_random_lora

    path = build_tiny_model(tmp_path / "base", init_std=0.3)
    adapter = build_random_lora(path, tmp_path / "adapter", scale=0.3)
    settings = {"lora_paths": {"a": str(adapter)}, "max_loras_per_batch": 2}
    adapters = ["a", None, "a"]
    with _engine(path, spec=False, **settings) as engine:
        reference = _ids(engine.generate(PROMPTS, GREEDY, lora_path=adapters))
        plain = _ids(engine.generate(PROMPTS, GREEDY))
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    assert reference != plain  # the adapter changes the answers
    with _engine(path, spec=True, **settings) as engine:
        # The oracle knows each prompt's answer under its own adapter.
        _use(engine, CorruptedOracle(dict(zip(map(tuple, prompts), reference, strict=True))))
        assert _ids(engine.generate(PROMPTS, GREEDY, lora_path=adapters)) == reference
        drafted, accepted = _spec(engine)
        assert 0 < accepted < drafted
        engine.check_invariants()


def test_an_eagle_head_named_by_hub_id_is_downloaded(
    eagle_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head path that is no local directory but reads as `org/name` is downloaded (with
    EAGLE-1's pytorch_model.bin, which model downloads skip); no hub is reached here."""
    from radixlm.runtime.speculative import eagle

    asked: list[tuple[str, list[str]]] = []

    def download(repo: str, revision: Any, directory: Any, patterns: list[str]) -> Path:
        asked.append((repo, patterns))
        return eagle_models["EAGLE"]

    monkeypatch.setattr(eagle, "download_from_hub", download)
    spec = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "someone/head"}
    with Engine(str(eagle_models["target"]), show_progress=False, **spec) as engine:
        assert len(engine.generate("hello", GREEDY)["output_ids"]) == GREEDY["max_new_tokens"]
    assert asked == [("someone/head", ["*.json", "*.safetensors", "pytorch_model*.bin"])]
