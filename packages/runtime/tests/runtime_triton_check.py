"""Run one mixed batch through both attention backends; print the largest logit difference.

Run as a script (by test_runtime_triton_backend.py) so that TRITON_INTERPRET=1 is set before
radixlm.kernels defines its Triton kernels.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from radixlm.runtime import (
    AttentionConfig,
    BatchEntry,
    ForwardBatch,
    MemoryConfig,
    ModelConfig,
    ModelRunner,
    RunnerConfig,
)

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "use_sliding_window": True,
    "sliding_window": 5,
    "max_window_layers": 1,
    "torch_dtype": "float32",
}


def main(directory: str) -> None:
    torch.set_num_threads(1)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(CONFIG, handle)
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            RunnerConfig(
                model=ModelConfig(directory, load_format="dummy", seed=3, show_progress=False),
                memory=MemoryConfig(max_total_tokens=256, max_running_requests=4),
                attention=AttentionConfig(backend=backend),
            )
        )
        assert runner.attention.name == backend
        # The attention backends are compared: no step may go around them through the CPU
        # decode path (one thread takes steps of up to 16 tokens there).
        runner.cpu_decode = None
        table = runner.req_to_token_pool.req_to_token
        rows = [runner.req_to_token_pool.alloc() for _ in range(3)]
        prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [10, 11, 12]]
        slots = [runner.kv_pool.alloc(len(p)) for p in prompts]
        # Step 1: cache 4 tokens of request 1 and all but the last of request 2.
        runner.forward(
            ForwardBatch.build(
                [
                    BatchEntry(rows[1], prompts[1][:4], 0, slots[1][:4]),
                    BatchEntry(rows[2], prompts[2][:-1], 0, slots[2][:-1]),
                ],
                table,
            )
        )
        # Step 2 (mixed): a new prefill, an extend after a cached prefix, a decode.
        mixed = ForwardBatch.build(
            [
                BatchEntry(rows[0], prompts[0], 0, slots[0]),
                BatchEntry(rows[1], prompts[1][4:], 4, slots[1][4:]),
                BatchEntry(rows[2], prompts[2][-1:], 2, slots[2][-1:]),
            ],
            table,
        )
        first = runner.forward(mixed).next_token_logits.clone()
        # Step 3 (pure decode): one more token for each.
        extra = [runner.kv_pool.alloc(1) for _ in prompts]
        decode = ForwardBatch.build(
            [
                BatchEntry(rows[i], [int(first[i].argmax())], len(prompts[i]), extra[i])
                for i in range(3)
            ],
            table,
        )
        second = runner.forward(decode).next_token_logits.clone()
        logits[backend] = (first, second)
    diff = max(
        (logits["torch_native"][i] - logits["triton"][i]).abs().max().item() for i in range(2)
    )
    report = {
        "max_abs_diff": diff,
        "scale": logits["triton"][0].abs().max().item(),
        "triton_ran": "radixlm.kernels.triton_ops" in sys.modules,
        "windows": list(runner.info.arch.sliding_windows),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
