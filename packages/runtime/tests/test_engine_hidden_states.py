"""`return_hidden_states`: the final (normed) hidden states SGLang returns, against transformers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GREEDY: dict[str, Any] = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TOLERANCE = 1e-4  # float32 on both sides; measured about 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Engine]:
    with Engine(
        str(model_dir),
        show_progress=False,
        max_total_tokens=4096,
        engine_process=request.param == "process",
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    model.eval()  # type: ignore[no-untyped-call]
    return model


def reference(hf_model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) over prompt + output[:-1]."""
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt + output[:-1]]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def stacked(entries: list[Any]) -> torch.Tensor:
    """SGLang's shape back to one [positions, hidden] tensor."""
    return torch.cat([torch.tensor(entries[0])] + [torch.tensor(e)[None] for e in entries[1:]])


def test_hidden_states_match_transformers_at_prompt_and_output_positions(
    engine: Engine, hf_model: Any
) -> None:
    ids = engine.tokenizer.encode("the radix tree caches the prefix of a request")
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_hidden_states=True)
    entries = out["meta_info"]["hidden_states"]
    hidden = hf_model.config.hidden_size
    # The prompt's rows first, then one vector per output token fed back (all but the last).
    assert len(entries) == GREEDY["max_new_tokens"]
    assert [len(r) for r in entries[0]] == [hidden] * len(ids)
    assert all(len(e) == hidden and isinstance(e[0], float) for e in entries[1:])
    expected = reference(hf_model, ids, out["output_ids"])
    assert (stacked(entries) - expected).abs().max().item() <= TOLERANCE


def test_only_the_requests_that_ask_get_hidden_states_in_a_batch(
    engine: Engine, hf_model: Any
) -> None:
    prompts = [engine.tokenizer.encode(t) for t in ("hello world", "the cache is a tree of tokens")]
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    outs = engine.generate(
        input_ids=prompts, sampling_params=GREEDY, return_hidden_states=[False, True]
    )
    assert "hidden_states" not in outs[0]["meta_info"]
    assert [o["output_ids"] for o in outs] == [a["output_ids"] for a in alone]
    expected = reference(hf_model, prompts[1], outs[1]["output_ids"])
    assert (stacked(outs[1]["meta_info"]["hidden_states"]) - expected).abs().max() <= TOLERANCE


def test_a_cached_prompt_still_returns_every_prompt_position(engine: Engine, hf_model: Any) -> None:
    ids = engine.tokenizer.encode("a prompt that the cache already holds in full")
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_hidden_states=True)
    entries = out["meta_info"]["hidden_states"]
    assert len(entries[0]) == len(ids)
    expected = reference(hf_model, ids, out["output_ids"])
    assert (stacked(entries) - expected).abs().max().item() <= TOLERANCE
    engine.check_invariants()


def test_streamed_hidden_states_arrive_once_and_add_up_to_the_whole(engine: Engine) -> None:
    ids = engine.tokenizer.encode("streaming hidden states one token at a time")
    whole = engine.generate(input_ids=ids, sampling_params=GREEDY, return_hidden_states=True)
    pieces: list[Any] = []
    for chunk in engine.generate(
        input_ids=ids, sampling_params=GREEDY, return_hidden_states=True, stream=True
    ):
        pieces.extend(chunk["meta_info"]["hidden_states"])
    assert len(pieces) == len(whole["meta_info"]["hidden_states"])
    assert torch.allclose(stacked(pieces), stacked(whole["meta_info"]["hidden_states"]))


def test_a_chunked_prefill_returns_the_prompt_rows_of_every_chunk(
    model_dir: Path, hf_model: Any
) -> None:
    with Engine(
        str(model_dir), show_progress=False, max_total_tokens=4096, chunked_prefill_size=4
    ) as eng:
        ids = eng.tokenizer.encode("a longer prompt that the scheduler splits into chunks of four")
        assert len(ids) > 8
        out = eng.generate(input_ids=ids, sampling_params=GREEDY, return_hidden_states=True)
        entries = out["meta_info"]["hidden_states"]
        assert len(entries[0]) == len(ids)
        expected = reference(hf_model, ids, out["output_ids"])
        assert (stacked(entries) - expected).abs().max().item() <= TOLERANCE
        eng.check_invariants()


def test_hidden_states_are_absent_unless_asked(engine: Engine) -> None:
    out = engine.generate("hello", GREEDY)
    assert "hidden_states" not in out["meta_info"]
