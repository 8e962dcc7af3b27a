"""Roles rendered with the model's chat template (from /get_model_info) or the default one."""

from __future__ import annotations

import pytest
from conftest import CHATML, LLAMA3_LIKE, QWEN_LIKE

import radixlm.lang as sgl
from radixlm.lang.chat_template import (
    DEFAULT,
    TEMPLATES,
    derive_from_renderer,
    from_hf_template,
    jinja_renderer,
)

pytestmark = pytest.mark.timeout(30)


@sgl.function
def chat(s, question):
    s += sgl.system("Be brief.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=3))


def test_roles_use_the_models_chat_template(make_server):
    server = make_server(chat_template=CHATML)
    with sgl.RuntimeEndpoint(server.url) as backend:
        state = chat.run(question="Hi?", backend=backend)
        assert state.text().startswith(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert state.text().endswith("<|im_end|>\n")


def test_gen_in_a_templated_turn_stops_at_the_end_of_turn(make_server):
    server = make_server(chat_template=CHATML)
    with sgl.RuntimeEndpoint(server.url) as backend:
        chat.run(question="Hi?", backend=backend).sync()
        assert "<|im_end|>" in server.core.requests[-1]["sampling_params"]["stop"]


def test_a_model_without_template_gets_the_default_template(server):
    with sgl.RuntimeEndpoint(server.url) as backend:
        state = chat.run(question="Hi?", backend=backend)
        assert state.text().startswith("SYSTEM:Be brief.\nUSER:Hi?\nASSISTANT:")


def test_messages_hold_the_turns(endpoint):
    state = chat.run(question="Hi?", backend=endpoint)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "Hi?"
    assert messages[2]["content"] == state["answer"].lstrip()


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

    assert with_blocks.run(backend=endpoint).text() == with_markers.run(backend=endpoint).text()


def test_state_role_methods_add_turns(endpoint):
    @sgl.function
    def prog(s):
        s.system("Rules.")
        s.user("Hi?")

    assert prog.run(backend=endpoint).text() == "SYSTEM:Rules.\nUSER:Hi?\n"


def test_a_default_system_prompt_is_inserted_before_the_first_turn(make_server):
    server = make_server(chat_template=QWEN_LIKE)
    with sgl.RuntimeEndpoint(server.url) as backend:

        @sgl.function
        def prog(s):
            s += sgl.user("Hi?")

        state = prog.run(backend=backend)
        assert state.text() == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi?<|im_end|>\n"
        )
        assert state.messages()[0] == {"role": "system", "content": "You are a helpful assistant."}


def test_nested_roles_fail_naming_the_turn(endpoint):
    @sgl.function
    def prog(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    error = prog.run(backend=endpoint).error()
    assert error is not None and "assistant_begin()" in str(error) and "nest" in str(error)


def test_chat_template_name_overrides_the_model(server):
    with sgl.RuntimeEndpoint(server.url, chat_template_name="llama-3") as backend:
        assert backend.get_chat_template() is TEMPLATES["llama-3"]


def test_a_llama3_template_is_read_off_its_jinja():
    template = from_hf_template(LLAMA3_LIKE)
    assert template.prefix_and_suffix("user") == (
        "<|start_header_id|>user<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert template.stop_str == ("<|eot_id|>",)


def test_a_chatml_template_is_read_off_its_jinja():
    render = jinja_renderer(CHATML)
    assert render is not None
    template = derive_from_renderer(render)
    assert template is not None
    assert template.roles == TEMPLATES["chatml"].roles


def test_without_a_renderer_known_families_are_found_by_markers():
    template = from_hf_template(QWEN_LIKE, renderer=lambda messages, add: 1 / 0)  # type: ignore[arg-type,return-value]
    assert template.roles == TEMPLATES["chatml"].roles


def test_an_unreadable_template_falls_back_to_the_default():
    assert from_hf_template("{{ nothing useful }}") is DEFAULT
