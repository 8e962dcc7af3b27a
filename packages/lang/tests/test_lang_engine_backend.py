"""The in-process backend over an engine with SGLang's Engine call shapes (no HTTP)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from conftest import CHATML

import radixlm.lang as sgl
from radixlm.lang.backends.engine import EngineBackend

pytestmark = pytest.mark.timeout(30)

RULES = {
    "The capital of France is": " Paris. It is a big city.\n",
    "Is Paris in France? Answer:": " yes",
    "Tip 0:": " Drink water.\n",
    "Tip 1:": " Sleep well.\n",
}


@sgl.function
def capital(s):
    s += "The capital of France is" + sgl.gen("city", stop=".")


class SyncOnlyEngine:
    """An engine with only the synchronous generate()."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine

    def generate(self, **kwargs: Any) -> Any:
        return self.inner.generate(**kwargs)

    def model_info(self) -> dict[str, Any]:
        return self.inner.model_info()


def test_gen_runs_on_the_engine(make_engine):
    engine = make_engine(RULES)
    assert capital.run(backend=EngineBackend(engine))["city"] == " Paris"
    assert engine.core.requests[-1]["sampling_params"] == {"max_new_tokens": 128, "stop": "."}


def test_an_engine_with_only_sync_generate_works(make_engine):
    backend = EngineBackend(SyncOnlyEngine(make_engine(RULES)))
    assert capital.run(backend=backend)["city"] == " Paris"


def test_select_scores_choices_on_the_engine(make_engine):
    @sgl.function
    def prog(s):
        s += "Is Paris in France? Answer:" + sgl.select("answer", [" no", " yes"])

    state = prog.run(backend=EngineBackend(make_engine(RULES)))
    assert state["answer"] == " yes"


def test_streaming_runs_on_the_engine(make_engine):
    engine = make_engine(RULES)
    engine.core.delay = 0.1

    @sgl.function
    def sentence(s):
        s += "The capital of France is" + sgl.gen("rest", stop="\n")

    state = sentence.run(backend=EngineBackend(engine), stream=True)
    pieces = list(state.text_iter("rest"))
    assert len(pieces) > 1 and "".join(pieces) == " Paris. It is a big city."


def test_forks_reach_the_engine_together(make_engine):
    engine = make_engine(RULES)
    engine.core.delay = 0.3

    @sgl.function
    def tips(s):
        s += "Two tips.\n"
        forks = s.fork(2)
        forks += lambda i: f"Tip {i}:" + sgl.gen("tip", stop="\n")
        forks.join()

    state = tips.run(backend=EngineBackend(engine))
    assert state["tip"] == [" Drink water.", " Sleep well."]
    assert engine.core.max_in_flight == 2


def test_an_engine_given_as_the_default_backend_is_wrapped(make_engine):
    sgl.set_default_backend(make_engine(RULES))
    assert isinstance(sgl.get_default_backend(), EngineBackend)
    assert capital()["city"] == " Paris"


def test_the_engines_chat_template_is_used(make_engine):
    backend = EngineBackend(make_engine(RULES, chat_template=CHATML))

    @sgl.function
    def prog(s):
        s += sgl.user("Hi?")

    assert prog.run(backend=backend).text() == "<|im_start|>user\nHi?<|im_end|>\n"


def test_a_tokenizer_chat_template_is_read_through_the_tokenizer(make_engine):
    calls = []

    class Tokenizer:
        chat_template = "unused by jinja here"
        bos_token = "<s>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            calls.append(add_generation_prompt)
            text = "<s>" + "".join(f"[{m['role']}]{m['content']}[/]" for m in messages)
            return text + ("[assistant]" if add_generation_prompt else "")

    engine = make_engine(RULES)
    engine.core.model_info = lambda: {"model_path": "toy"}
    engine.tokenizer = Tokenizer()
    template = EngineBackend(engine).get_chat_template()
    assert template.prefix_and_suffix("user") == ("[user]", "[/]")
    assert calls


def test_the_backend_shuts_down_only_an_engine_it_built(make_engine):
    engine = make_engine(RULES)
    EngineBackend(engine).shutdown()
    assert engine.shut_down is False


def test_an_engine_without_a_needed_keyword_is_reported(make_engine):
    class NoImages:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def generate(self, prompt=None, sampling_params=None, stream=False):
            return self.inner.generate(
                prompt=prompt, sampling_params=sampling_params, stream=stream
            )

        def model_info(self) -> dict[str, Any]:
            return self.inner.model_info()

    @sgl.function
    def prog(s):
        s += sgl.image(b"\x89PNG....") + "What?" + sgl.gen("x", max_tokens=2)

    error = prog.run(backend=EngineBackend(NoImages(make_engine(RULES)))).error()
    assert error is not None and "image_data" in str(error)


def test_the_engine_backend_imports_the_runtime_only_when_building_an_engine():
    code = (
        "import sys, radixlm.lang as sgl, radixlm.lang.backends.engine as e; "
        "assert 'radixlm.runtime' not in sys.modules; print(sgl.EngineBackend is e.EngineBackend)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_building_an_engine_needs_a_model_path():
    with pytest.raises(ValueError, match="model_path"):
        EngineBackend()
