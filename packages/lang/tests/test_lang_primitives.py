"""Each primitive against RuntimeEndpoint and the fake native server."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import radixlm.lang as sgl
from radixlm.lang.backends.native import _choice_entries

pytestmark = pytest.mark.timeout(30)

RULES = {
    "The capital of France is": " Paris. It is a big city.\n",
    "Count:": " 1, 2, 3, 4, 5, 6, 7, 8",
    "Is Paris in France? Answer:": " yes",
}


@pytest.fixture
def backend(make_server):
    server = make_server(RULES)
    endpoint = sgl.RuntimeEndpoint(server.url, timeout=20)
    endpoint.fake = server
    yield endpoint
    endpoint.close()


def test_gen_appends_the_completion_and_stores_it(backend):
    @sgl.function
    def capital(s):
        s += "The capital of France is" + sgl.gen("city", max_tokens=16)

    state = capital.run(backend=backend)
    assert state["city"] == " Paris. It is a big city.\n"
    assert state.text() == "The capital of France is Paris. It is a big city.\n"


def test_gen_name_and_max_tokens_may_be_positional(backend):
    @sgl.function
    def count(s):
        s += "Count:" + sgl.gen("numbers", 3)

    assert count.run(backend=backend)["numbers"] == " 1, 2"


def test_gen_stops_at_the_stop_string(backend):
    @sgl.function
    def capital(s):
        s += "The capital of France is" + sgl.gen("city", stop=".")

    state = capital.run(backend=backend)
    assert state["city"] == " Paris"
    assert state.get_meta_info("city")["finish_reason"] == {"type": "stop", "matched": "."}


def test_gen_sends_its_values_as_sampling_params(backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("x", max_tokens=5, temperature=0.3, top_k=4, stop=["\n"])

    prog.run(backend=backend).sync()
    sent = backend.fake.core.requests[-1]["sampling_params"]
    assert sent == {"max_new_tokens": 5, "temperature": 0.3, "top_k": 4, "stop": ["\n"]}


def test_run_level_values_are_the_defaults_of_every_gen(backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("a") + sgl.gen("b", temperature=0.9)

    prog.run(backend=backend, temperature=0.1, max_new_tokens=7).sync()
    first, second = (r["sampling_params"] for r in backend.fake.core.requests[-2:])
    assert (first["temperature"], first["max_new_tokens"]) == (0.1, 7)
    assert (second["temperature"], second["max_new_tokens"]) == (0.9, 7)


def test_run_level_logprob_options_reach_the_request(backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("x", max_tokens=3)

    state = prog.run(backend=backend, return_logprob=True, return_text_in_logprobs=True)
    state.sync()
    assert backend.fake.core.requests[-1]["return_logprob"] is True
    assert [e[2] for e in state.get_meta_info("x")["output_token_logprobs"]] == [" 1", ",", " 2"]


def test_gen_with_regex_output_matches_it(backend):
    @sgl.function
    def prog(s):
        s += "Pick a code: " + sgl.gen("code", regex=r"[A-Z]{3}-[0-9]{2}")

    code = prog.run(backend=backend)["code"]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", code)


def test_gen_with_json_schema_output_satisfies_it(backend):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }

    @sgl.function
    def prog(s):
        s += "A person as JSON: " + sgl.gen("person", json_schema=schema)

    person = json.loads(prog.run(backend=backend)["person"])
    jsonschema.validate(person, schema)
    assert json.loads(backend.fake.core.requests[-1]["sampling_params"]["json_schema"]) == schema


@pytest.mark.parametrize(
    ("primitive", "pattern"),
    [(sgl.gen_int, sgl.REGEX_INT), (sgl.gen_string, sgl.REGEX_STR)],
)
def test_typed_gens_produce_their_type(backend, primitive, pattern):
    @sgl.function
    def prog(s):
        s += "Value: " + primitive("value")

    value = prog.run(backend=backend)["value"]
    assert re.fullmatch(pattern, value)
    assert backend.fake.core.requests[-1]["sampling_params"]["regex"] == pattern


def test_gen_dtype_float_and_bool_use_their_regexes(backend):
    @sgl.function
    def prog(s):
        s += "x: " + sgl.gen("x", dtype=float) + " y: " + sgl.gen("y", dtype="bool")

    state = prog.run(backend=backend)
    assert re.fullmatch(sgl.REGEX_FLOAT, state["x"])
    assert state["y"] in ("True", "False")


def test_regex_constants_match_their_values():
    assert re.fullmatch(sgl.REGEX_INT, "-42")
    assert re.fullmatch(sgl.REGEX_FLOAT, "3.25")
    assert re.fullmatch(sgl.REGEX_BOOL, "False")
    assert re.fullmatch(sgl.REGEX_STR, '"a b c"')
    assert not re.fullmatch(sgl.REGEX_INT, "4.2")


def test_select_returns_one_of_the_choices_with_scores(backend):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select("answer", choices=[" no", " yes"])

    state = prog.run(backend=backend)
    assert state["answer"] == " yes"
    assert state.text().endswith("Answer: yes")
    scores = state.get_meta_info("answer")["normalized_prompt_logprobs"]
    assert len(scores) == 2 and scores[1] > scores[0]


def test_select_scores_all_choices_in_one_request(backend):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select("answer", choices=[" no", " yes", " maybe"])

    prog.run(backend=backend).sync()
    scoring = backend.fake.core.requests[-1]
    prompt = "Is Paris in France? Answer:"
    # The prompt alone rides last: its entry is the token each choice's scoring starts on.
    assert scoring["text"] == [f"{prompt}{c}" for c in (" no", " yes", " maybe")] + [prompt]
    assert scoring["sampling_params"]["max_new_tokens"] == 0
    assert scoring["return_logprob"] is True and scoring["logprob_start_len"] >= 0


def test_select_handles_a_choice_merged_with_the_prompt_end(backend):
    # "Answer: " + "yes" tokenizes as "Answer", ":", " yes": the boundary token moves.
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer: " + sgl.select("answer", choices=["no", "yes"])

    state = prog.run(backend=backend)
    assert state["answer"] == "yes"
    entries = state.get_meta_info("answer")["input_token_logprobs"][1]
    assert [e[2] for e in entries] == [" yes"]


def test_a_boundary_token_is_dropped_only_when_it_is_the_prompts_own():
    # "Answer: " + "🙂": the prompt's last token " " merges with the emoji's first byte; texts
    # of byte tokens are all "\ufffd", so only the token ids tell the merge apart.
    merged = [[-1.0, 77, " \ufffd"], [-2.0, 78, "\ufffd"], [-3.0, 79, "\ufffd"]]
    assert _choice_entries(merged, "🙂", prefix_tokens=5, prompt_last_id=12) == merged
    clean = [[-1.0, 12, " "], [-2.0, 80, "\ufffd"], [-3.0, 81, "\ufffd"]]
    assert _choice_entries(clean, "🙂", prefix_tokens=5, prompt_last_id=12) == clean[1:]


def test_gen_with_choices_is_select(backend):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.gen("answer", choices=[" no", " yes"])

    assert prog.run(backend=backend)["answer"] == " yes"


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
def test_every_choices_method_picks_the_models_answer(backend, method):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select(
            "answer", [" no", " yes"], choices_method=method
        )

    state = prog.run(backend=backend)
    assert state["answer"] == " yes"
    assert "normalized_prompt_logprobs" in state.get_meta_info("answer")


def test_select_copes_with_a_server_that_omits_the_first_tokens_logprob(backend):
    backend.fake.core.omit_first_logprob = True

    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select(
            "answer", [" no", " yes"], choices_method=sgl.unconditional_likelihood_normalized
        )

    state = prog.run(backend=backend)
    assert state["answer"] == " yes"
    alone = state.get_meta_info("answer")["unconditional_token_logprobs"]
    assert [e[0] for e in alone[0]] == [None]


def test_image_goes_to_the_request_as_base64(backend, tmp_path):
    picture = tmp_path / "dot.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\nfake")

    @sgl.function
    def prog(s, path):
        s += sgl.user(sgl.image(path) + "What is this?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    state = prog.run(path=str(picture), backend=backend)
    state.sync()
    assert backend.fake.core.requests[-1]["image_data"] == "iVBORw0KGgpmYWtl"
    assert "<image>" in state.text()
    # The turn's parts in order; the image part stands for the placeholder, kept out of the text.
    image_part, text_part = state.messages()[0]["content"]
    assert image_part["image_url"]["url"].startswith("data:image/png;base64,")
    assert text_part == {"type": "text", "text": "What is this?"}


def test_var_scope_captures_the_text_added_inside(backend):
    @sgl.function
    def prog(s):
        s += "Intro. "
        with s.var_scope("sentence"):
            s += "The capital of France is" + sgl.gen("city", stop=".")
        s += "!"

    state = prog.run(backend=backend)
    assert state["sentence"] == "The capital of France is Paris"


def test_state_supports_setting_and_testing_variables(backend):
    @sgl.function
    def prog(s):
        s["note"] = "set by hand"
        s += "Count:" + sgl.gen("numbers", 2)

    state = prog.run(backend=backend)
    assert state["note"] == "set by hand"
    assert "numbers" in state and "note" in state and "missing" not in state


def test_calling_a_program_runs_it(backend):
    sgl.set_default_backend(backend)

    @sgl.function
    def capital(s):
        s += "The capital of France is" + sgl.gen("city", stop=".")

    assert capital()["city"] == " Paris"


def test_bind_fixes_arguments(backend):
    @sgl.function
    def prog(s, country, question):
        s += f"The capital of {country} is" + sgl.gen("city", stop=".")
        s["question"] = question

    bound = prog.bind(country="France")
    state = bound.run(question="q?", backend=backend)
    assert state["city"] == " Paris" and state["question"] == "q?"


def test_bind_rejects_unknown_arguments():
    @sgl.function
    def prog(s, country):
        pass

    with pytest.raises(TypeError, match="no arguments"):
        prog.bind(city="Paris")


def test_program_return_value_is_kept(backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("numbers", 2)
        return "done"

    assert prog.run(backend=backend).ret_value == "done"


def test_gen_n_returns_a_list_and_appends_the_first(backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("numbers", 2, n=2)

    state = prog.run(backend=backend)
    assert state["numbers"] == [" 1,", " 1,"]
    assert state.text() == "Count: 1,"


def test_flush_cache_reaches_the_server(backend):
    assert sgl.flush_cache(backend) is True
    assert backend.fake.core.flushes == 1


def test_an_object_with_an_endpoint_is_used_through_it(backend):
    class Runtime:  # SGLang's Runtime exposes its RuntimeEndpoint as .endpoint
        endpoint = backend

    @sgl.function
    def capital(s):
        s += "The capital of France is" + sgl.gen("city", stop=".")

    assert capital.run(backend=Runtime())["city"] == " Paris"
