"""`/v1/completions` with vLLM's `use_beam_search`: the engine's optional `beam_search`
coroutine is called per prompt, the n best beams come back best first; streaming, logprobs and
engines without beam search are 400s."""

from __future__ import annotations

import sys
from typing import Any

import openai
import pytest

from radixlm.sampling import FinishReason, GenerateChunk, GenerateRequest
from radixlm.server import ServerConfig

fake = sys.modules["server_fake_engine"]  # loaded by conftest


class BeamEngine(fake.FakeEngine):  # type: ignore[name-defined,misc]
    """The toy engine plus a beam search whose beam i says "beam i" (scores fall with i)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.searches: list[tuple[GenerateRequest, int, float, bool]] = []

    async def beam_search(
        self,
        request: GenerateRequest,
        beam_width: int,
        *,
        length_penalty: float = 1.0,
        early_stopping: bool = False,
    ) -> list[GenerateChunk]:
        self.searches.append((request, beam_width, length_penalty, early_stopping))
        prompt = request.text or ""
        out = []
        for i in range(beam_width):
            ids = self.tokenizer.encode(f" beam {i}", add_special_tokens=False)
            reason = FinishReason("length") if i % 2 else FinishReason("stop", self.eos_id)
            out.append(
                GenerateChunk(
                    rid=str(request.rid),
                    index=i,
                    text=f" beam {i}",
                    output_ids=tuple(ids),
                    prompt_tokens=len(self.tokenizer.encode(prompt)),
                    completion_tokens=len(ids),
                    finish_reason=reason,
                    score=-float(i),
                )
            )
        return out


@pytest.fixture
def beam_served(make_server: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, BeamEngine]:
    # make_server builds `fake.FakeEngine`: have it build the beam-search one.
    monkeypatch.setattr(fake, "FakeEngine", BeamEngine)
    live, engine = make_server(ServerConfig(served_model_name="toy"))
    return live, engine


@pytest.fixture
def beam_engine(beam_served: tuple[Any, BeamEngine]) -> BeamEngine:
    return beam_served[1]


@pytest.fixture
def beam_client(beam_served: tuple[Any, BeamEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{beam_served[0].url}/v1", api_key="unused", max_retries=0)


def test_beam_search_returns_the_n_best_beams_best_first(
    beam_client: openai.OpenAI, beam_engine: BeamEngine
) -> None:
    out = beam_client.completions.create(
        model="toy",
        prompt="Hello",
        n=2,
        best_of=3,
        max_tokens=7,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True},
    )
    assert [c.text for c in out.choices] == [" beam 0", " beam 1"]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.finish_reason for c in out.choices] == ["stop", "length"]
    request, width, length_penalty, early_stopping = beam_engine.searches[-1]
    assert (width, length_penalty, early_stopping) == (3, 0.5, True)
    assert request.params.max_new_tokens == 7
    assert out.usage is not None and out.usage.completion_tokens > 0


def test_the_beam_width_is_n_without_best_of(
    beam_client: openai.OpenAI, beam_engine: BeamEngine
) -> None:
    out = beam_client.completions.create(
        model="toy", prompt="Hello", n=3, extra_body={"use_beam_search": True}
    )
    assert len(out.choices) == 3
    assert beam_engine.searches[-1][1:] == (3, 1.0, False)


def test_each_prompt_gets_its_own_beams_and_echo_prefixes_them(
    beam_client: openai.OpenAI,
) -> None:
    out = beam_client.completions.create(
        model="toy",
        prompt=["One", "Two"],
        n=2,
        echo=True,
        extra_body={"use_beam_search": True},
    )
    assert [(c.index, c.text) for c in out.choices] == [
        (0, "One beam 0"),
        (1, "One beam 1"),
        (2, "Two beam 0"),
        (3, "Two beam 1"),
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_unsupported_combinations_are_400s_naming_the_field(
    beam_client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        beam_client.completions.create(
            model="toy", prompt="Hello", extra_body={"use_beam_search": True, **body}
        )
    assert error.value.body["param"] == param  # type: ignore[index]


def test_an_engine_without_beam_search_answers_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="toy", prompt="Hello", extra_body={"use_beam_search": True})
    assert "this engine does not support beam search" in str(error.value)
    assert error.value.body["param"] == "use_beam_search"  # type: ignore[index]
