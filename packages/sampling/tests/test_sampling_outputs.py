"""GenerateChunk and friends: SGLang's /generate layout written once, read back, pickled."""

from __future__ import annotations

import pickle

from radixlm.sampling import (
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    InvalidRequest,
    LogprobEntry,
)


def _chunk(**extra: object) -> GenerateChunk:
    return GenerateChunk(
        rid="r1",
        index=1,
        text="Hello",
        output_ids=(5, 6),
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=1,
        **extra,  # type: ignore[arg-type]
    )


def test_a_running_chunk_has_sglangs_meta_info_and_no_optional_keys() -> None:
    out = _chunk(e2e_latency=0.5).to_json()
    assert out == {
        "index": 1,
        "text": "Hello",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "r1",
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 1,
            "finish_reason": None,
            "e2e_latency": 0.5,
        },
    }


def test_finish_reason_writes_message_only_when_present() -> None:
    assert FinishReason("stop", 7).to_json() == {"type": "stop", "matched": 7}
    assert FinishReason("abort", None, "gone").to_json() == {
        "type": "abort",
        "matched": None,
        "message": "gone",
    }
    chunk = _chunk(finish_reason=FinishReason("length"))
    assert chunk.finished and chunk.finish_type == "length"


def test_logprobs_are_triples_and_positions_may_be_none() -> None:
    entry = LogprobEntry(-0.25, 5, "He")
    chunk = _chunk(
        output_token_logprobs=(entry,),
        output_token_logprobs_length=1,
        output_top_logprobs=((entry, LogprobEntry(-2.0, 9)),),
        input_token_logprobs=(LogprobEntry(None, 1), LogprobEntry(-1.0, 2)),
        input_top_logprobs=(None, (LogprobEntry(-1.0, 2),)),
    )
    meta = chunk.to_json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.25, 5, "He"]]
    assert meta["output_token_logprobs_length"] == 1
    assert meta["output_top_logprobs"] == [[[-0.25, 5, "He"], [-2.0, 9, None]]]
    assert meta["input_token_logprobs"] == [[None, 1, None], [-1.0, 2, None]]
    assert meta["input_top_logprobs"] == [None, [[-1.0, 2, None]]]
    assert "output_token_ids_logprobs" not in meta


def test_flat_logprobs_write_columns_with_offsets() -> None:
    chunk = _chunk(
        flat_logprobs=True,
        output_token_logprobs=(LogprobEntry(-0.5, 5), LogprobEntry(-0.1, 6)),
        input_top_logprobs=(None, (LogprobEntry(-1.0, 2), LogprobEntry(-3.0, 4))),
    )
    meta = chunk.to_json()["meta_info"]
    assert meta["output_token_logprobs"] == {
        "logprobs": [-0.5, -0.1],
        "token_ids": [5, 6],
        "texts": [None, None],
    }
    assert meta["input_top_logprobs"]["offsets"] == [0, 0, 2]
    assert meta["input_top_logprobs"]["token_ids"] == [2, 4]


def test_from_json_reads_back_what_to_json_wrote() -> None:
    chunk = _chunk(
        finish_reason=FinishReason("stop", "\n"),
        output_token_logprobs=(LogprobEntry(-0.5, 5, "a"),),
        output_top_logprobs=((LogprobEntry(-0.5, 5, "a"),),),
        input_top_logprobs=(None,),
        grammar={"backend": "xgrammar", "rollbacks": 0},
        score=-1.5,
        extra={"weight_version": "default"},
    )
    assert GenerateChunk.from_json(chunk.to_json()) == chunk


def test_from_json_takes_a_bare_finish_type_and_keeps_unknown_keys() -> None:
    chunk = GenerateChunk.from_json(
        {"text": "x", "meta_info": {"finish_reason": "length", "normalized_prompt_logprob": -2.0}}
    )
    assert chunk.finish_reason == FinishReason("length")
    assert chunk.extra == {"normalized_prompt_logprob": -2.0}
    assert chunk.to_json()["meta_info"]["normalized_prompt_logprob"] == -2.0


def test_chunks_and_errors_survive_pickling_between_processes() -> None:
    chunk = _chunk(output_token_logprobs=(LogprobEntry(-0.5, 5),))
    assert pickle.loads(pickle.dumps(chunk, protocol=5)) == chunk
    error = pickle.loads(pickle.dumps(InvalidRequest("max_new_tokens", "too many")))
    assert isinstance(error, InvalidRequest)
    assert (error.field, error.message) == ("max_new_tokens", "too many")
    assert str(error) == "max_new_tokens: too many"
    dead = pickle.loads(pickle.dumps(EngineUnavailable("the engine process died")))
    assert str(dead) == "the engine process died"
