"""Each radixlm-lang primitive through RuntimeEndpoint against the live reference server.

The tiny model has random weights: its texts are gibberish, so these tests assert structure,
constraints and the agreement between the language's figures and the server's, not meaning.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import LiveServer, endpoint_fixture, live_fixture, token_count  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

QUESTION = "Is Paris in France? Answer:"


def test_gen_appends_its_completion_and_reports_its_tokens(endpoint):
    @sgl.function
    def prog(s):
        s += "The capital of France is" + sgl.gen("city", max_tokens=6, ignore_eos=True)

    state = prog.run(backend=endpoint, temperature=0)
    assert state.text() == "The capital of France is" + state["city"]
    meta = state.get_meta_info("city")
    assert meta["completion_tokens"] == 6
    assert meta["finish_reason"]["type"] == "length"


def test_gen_name_and_max_tokens_may_be_positional(endpoint):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("numbers", 3, ignore_eos=True)

    meta = prog.run(backend=endpoint, temperature=0).get_meta_info("numbers")
    assert meta["completion_tokens"] == 3


def test_greedy_gen_equals_the_servers_own_greedy_output(endpoint, live):
    @sgl.function
    def prog(s):
        s += "The capital of France is" + sgl.gen("city", max_tokens=8)

    state = prog.run(backend=endpoint, temperature=0)
    direct = live.generate(
        {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
    )
    assert state["city"] == direct["text"]


def test_gen_stops_at_its_stop_token_id(endpoint, live):
    first = live.generate(
        {"text": "Count:", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    )["output_ids"][0]

    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("x", max_tokens=8, stop_token_ids=[first])

    meta = prog.run(backend=endpoint, temperature=0).get_meta_info("x")
    assert meta["finish_reason"] == {"type": "stop", "matched": first}
    assert meta["completion_tokens"] == 1


def test_run_level_logprob_options_give_output_logprobs_with_text(endpoint):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("x", max_tokens=3, ignore_eos=True)

    state = prog.run(
        backend=endpoint, temperature=0, return_logprob=True, return_text_in_logprobs=True
    )
    entries = state.get_meta_info("x")["output_token_logprobs"]
    assert len(entries) == 3
    assert all(lp <= 0 and isinstance(tid, int) and isinstance(t, str) for lp, tid, t in entries)


def test_gen_with_regex_output_matches_it(endpoint):
    pattern = r"[A-Z]{3}-[0-9]{2}"

    @sgl.function
    def prog(s):
        s += "Pick a code: " + sgl.gen("code", regex=pattern, max_tokens=16)

    state = prog.run(backend=endpoint, temperature=0)
    assert re.fullmatch(pattern, state["code"])
    assert state.get_meta_info("code")["finish_reason"]["type"] == "stop"


def test_gen_with_json_schema_output_satisfies_it(endpoint):
    # Bounded string and integer: a random model must finish inside its token budget.
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }

    @sgl.function
    def prog(s):
        s += "A person as JSON: " + sgl.gen("person", json_schema=schema, max_tokens=48)

    person = json.loads(prog.run(backend=endpoint, temperature=0)["person"])
    jsonschema.validate(person, schema)


def test_sampled_constrained_output_still_satisfies_the_constraint(endpoint):
    @sgl.function
    def prog(s):
        s += "Pick a code: " + sgl.gen("code", regex=r"(red|green|blue)-[0-9]", max_tokens=8)

    states = prog.run_batch([{}] * 4, backend=endpoint, temperature=1.0, progress_bar=False)
    assert all(re.fullmatch(r"(red|green|blue)-[0-9]", s["code"]) for s in states)


def test_typed_gens_produce_their_type(endpoint):
    @sgl.function
    def prog(s):
        s += "Integer: " + sgl.gen_int("i", max_tokens=12)
        s += " Float: " + sgl.gen("f", dtype=float, max_tokens=12)
        s += " Bool: " + sgl.gen("b", dtype=bool, max_tokens=4)

    state = prog.run(backend=endpoint, temperature=0)
    assert re.fullmatch(sgl.REGEX_INT, state["i"])
    assert re.fullmatch(sgl.REGEX_FLOAT, state["f"])
    assert state["b"] in ("True", "False")


def test_select_returns_one_of_the_choices_with_its_scores(endpoint):
    choices = [" no", " yes", " maybe so"]

    @sgl.function
    def prog(s):
        s += QUESTION + sgl.select("answer", choices=choices)

    state = prog.run(backend=endpoint)
    assert state["answer"] in choices
    assert state.text() == QUESTION + state["answer"]
    scores = state.get_meta_info("answer")["normalized_prompt_logprobs"]
    assert len(scores) == len(choices) and all(math.isfinite(x) and x <= 0 for x in scores)
    assert state["answer"] == choices[scores.index(max(scores))]


def _mean_logprob_of_choice(live: LiveServer, prompt: str, choice: str) -> float:
    """The mean logprob of the tokens of prompt + choice that the prompt alone does not have."""
    tokenizer = live.engine.tokenizer
    alone = tokenizer.encode(prompt, add_special_tokens=False)
    full = tokenizer.encode(prompt + choice, add_special_tokens=False)
    pairs = enumerate(zip(alone, full, strict=False))
    shared = next((i for i, (a, b) in pairs if a != b), len(alone))
    scored = live.generate(
        {
            "text": prompt + choice,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )["meta_info"]["input_token_logprobs"]
    own = [entry[0] for entry in scored[shared:]]
    return sum(own) / len(own)


@pytest.mark.parametrize(
    ("prompt", "choices"),
    [
        (QUESTION, [" no", " maybe so"]),
        # The prompt's last token " " merges with the choice's first characters; for the emoji
        # only its first byte merges, and byte tokens all read "\ufffd".
        (QUESTION + " ", ["yes", "🙂", "中文"]),
        ("<|im_start|>assistant\n", ["yes", "no"]),
    ],
    ids=["plain", "merged-boundary", "special-tokens"],
)
def test_select_scores_are_the_mean_logprob_of_each_choices_tokens(endpoint, live, prompt, choices):
    @sgl.function
    def prog(s):
        s += prompt + sgl.select("answer", choices=choices)

    scores = prog.run(backend=endpoint).get_meta_info("answer")["normalized_prompt_logprobs"]
    expected = [_mean_logprob_of_choice(live, prompt, c) for c in choices]
    assert scores == pytest.approx(expected, abs=1e-4)


def test_select_handles_a_choice_that_merges_with_the_prompts_end(endpoint, live):
    # "Answer: " + "yes" tokenizes as "... Answer", ":", " yes": the space moves into the choice.
    @sgl.function
    def prog(s):
        s += QUESTION + " " + sgl.select("answer", choices=["no", "yes"])

    state = prog.run(backend=endpoint)
    assert state["answer"] in ("no", "yes")
    for entries, choice in zip(
        state.get_meta_info("answer")["input_token_logprobs"], ["no", "yes"], strict=True
    ):
        assert "".join(e[2] for e in entries).strip() == choice


@pytest.mark.parametrize(
    "method",
    [sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized],
    ids=str,
)
def test_every_choices_method_picks_one_of_the_choices(endpoint, method):
    @sgl.function
    def prog(s):
        s += QUESTION + sgl.select("answer", [" no", " yes", " maybe so"], choices_method=method)

    state = prog.run(backend=endpoint)
    assert state["answer"] in (" no", " yes", " maybe so")
    assert len(state.get_meta_info("answer")["normalized_prompt_logprobs"]) == 3


def test_unconditional_scores_start_with_the_first_tokens_none_entry(endpoint):
    @sgl.function
    def prog(s):
        s += QUESTION + sgl.select(
            "answer", [" no", " maybe so"], choices_method=sgl.unconditional_likelihood_normalized
        )

    meta = prog.run(backend=endpoint).get_meta_info("answer")
    alone, inputs = meta["unconditional_token_logprobs"], meta["input_token_logprobs"]
    assert [len(a) for a in alone] == [len(i) for i in inputs]
    assert all(a[0][0] is None and all(e[0] is not None for e in a[1:]) for a in alone)


def test_prompt_logprobs_from_the_start_use_sglangs_layout(live):
    # The contract lang's select relies on: one entry per prompt token, the first [None, id, text].
    meta = live.generate(
        {
            "text": QUESTION,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_text_in_logprobs": True,
        }
    )["meta_info"]
    entries = meta["input_token_logprobs"]
    ids = live.engine.tokenizer.encode(QUESTION, add_special_tokens=False)
    assert len(entries) == meta["prompt_tokens"] == len(ids)
    assert entries[0][:2] == [None, ids[0]] and isinstance(entries[0][2], str)
    assert [e[1] for e in entries] == ids and all(e[0] <= 0 for e in entries[1:])


def test_gen_with_choices_is_select(endpoint):
    @sgl.function
    def prog(s):
        s += QUESTION + sgl.gen("answer", choices=[" no", " yes"])

    state = prog.run(backend=endpoint)
    assert state["answer"] in (" no", " yes")
    assert "normalized_prompt_logprobs" in state.get_meta_info("answer")


def test_gen_n_returns_a_list_and_appends_the_first(endpoint):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("numbers", 3, n=2, ignore_eos=True)

    state = prog.run(backend=endpoint, temperature=1.0)
    assert isinstance(state["numbers"], list) and len(state["numbers"]) == 2
    assert state.text() == "Count:" + state["numbers"][0]


def test_var_scope_captures_the_text_added_inside(endpoint):
    @sgl.function
    def prog(s):
        s += "Intro. "
        with s.var_scope("sentence"):
            s += "The capital of France is" + sgl.gen("city", max_tokens=4)
        s += "!"

    state = prog.run(backend=endpoint, temperature=0)
    assert state["sentence"] == "The capital of France is" + state["city"]
    assert state.text() == "Intro. " + state["sentence"] + "!"


def test_flush_cache_empties_the_servers_cache(endpoint, live):
    live.generate({"text": "A prompt to cache first.", "sampling_params": {"max_new_tokens": 0}})
    assert sgl.flush_cache(endpoint) is True
    again = live.generate(
        {"text": "A prompt to cache first.", "sampling_params": {"max_new_tokens": 0}}
    )
    assert again["meta_info"]["cached_tokens"] == 0


def test_server_info_reaches_the_program(endpoint):
    info = sgl.get_server_info(endpoint)
    assert "cache_hit_rate" in info and info["model"]["chat_template"]
