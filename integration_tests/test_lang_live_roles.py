"""Chat turns rendered with the tiny model's ChatML template, read off the live server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lang_fixtures import endpoint_fixture, live_fixture  # noqa: F401

import radixlm.lang as sgl

pytestmark = pytest.mark.timeout(60)

HEAD = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"


@sgl.function
def chat(s, question):
    s += sgl.system("Be brief.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


def test_the_template_comes_from_the_servers_model_info(endpoint, live):
    template = endpoint.get_chat_template()
    assert endpoint.model_info["chat_template"] == live.engine.tokenizer.chat_template
    assert template.prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert "<|im_end|>" in template.stop_str


def test_roles_are_written_with_the_chat_template(endpoint):
    state = chat.run(question="Hi?", backend=endpoint, temperature=0)
    assert state.text() == HEAD + "<|im_start|>assistant\n" + state["answer"] + "<|im_end|>\n"


def test_the_prompt_of_a_turn_equals_the_tokenizers_rendering(endpoint, live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    rendered = live.engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )

    @sgl.function
    def prompt_only(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi?")
        s += sgl.assistant_begin()

    assert prompt_only.run(backend=endpoint).text() == rendered


def test_a_gen_in_a_turn_never_runs_past_the_end_of_turn(endpoint):
    states = chat.run_batch(
        [{"question": q} for q in ("Hi?", "Why?", "Who?")],
        backend=endpoint,
        temperature=1.0,
        progress_bar=False,
    )
    for state in states:
        assert "<|im_end|>" not in state["answer"]
        assert state.text().endswith(state["answer"] + "<|im_end|>\n")


def test_the_end_of_turn_stop_string_stops_the_model_at_its_special_token(endpoint, live):
    # The tiny model's EOS is <|endoftext|>: only the stop string lang adds to gens in a turn
    # ends the turn when the model writes <|im_end|> (a special token the text leaves out).
    end = live.engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = live.generate(
        {
            "text": HEAD + "<|im_start|>assistant\n",
            "sampling_params": {
                "max_new_tokens": 8,
                "stop": list(endpoint.get_chat_template().stop_str),
                "logit_bias": {str(end): 100.0},
            },
        }
    )
    assert out["output_ids"] == [end] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_end|>"}


def test_messages_hold_the_turns(endpoint):
    state = chat.run(question="Hi?", backend=endpoint, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "Hi?"
    assert messages[2]["content"] == state["answer"].strip()


def test_role_context_managers_and_begin_end_forms_render_alike(endpoint):
    @sgl.function
    def with_blocks(s):
        with s.user():
            s += "Hi?"
        with s.assistant():
            s += "Hello."

    @sgl.function
    def with_markers(s):
        s += sgl.user_begin() + "Hi?" + sgl.user_end()
        s += sgl.assistant_begin() + "Hello." + sgl.assistant_end()

    text = with_blocks.run(backend=endpoint).text()
    assert text == with_markers.run(backend=endpoint).text()
    assert text == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"


def test_a_multi_turn_conversation_reuses_the_cached_history(endpoint):
    @sgl.function
    def conversation(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi?")
        s += sgl.assistant(sgl.gen("first", max_tokens=4, ignore_eos=True))
        s += sgl.user("And then?")
        s += sgl.assistant(sgl.gen("second", max_tokens=4, ignore_eos=True))

    state = conversation.run(backend=endpoint, temperature=0)
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    # The second turn's prompt starts with the first turn's prompt and answer, already cached.
    assert second["cached_tokens"] >= first["prompt_tokens"]
