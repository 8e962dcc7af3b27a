"""A toy reinforcement-learning loop: the engine (deterministic inference) samples rollouts,
a trainer process recomputes their logprobs with `transformers` (in float64 from its float32
policy), takes a REINFORCE step and broadcasts its new policy over a gloo group; the engine's
logprobs equal the trainer's within 1e-5 before and after each update, and follow the new
weights."""

from __future__ import annotations

import copy
import datetime
import multiprocessing
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm import kernels
from radixlm.runtime import Engine
from radixlm.runtime.fixtures import build_tiny_model

#: Slow (engines started in processes of their own): in the workspace run, not the package's
#: own environment's (`hatch run alone.runtime:test` deselects `slow`).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not kernels.cpu.available(), reason="radixlm's CPU kernels are not built here"
    ),
]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 2, [40, 41, 42, 43, 44], [300, 301, 7, 9]]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True}
STEPS = 2


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _logprobs(model: Any, prompts: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    """Each output token's log-probability under `model` (one row per rollout)."""
    rows = []
    for prompt, output in zip(prompts, outputs, strict=True):
        logits = model(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
        start = len(prompt) - 1
        rows.append(
            logits[start : start + len(output)].gather(1, torch.tensor(output)[:, None])[:, 0]
        )
    return rows


def _exact_logprobs(
    model: Any, prompts: list[list[int]], outputs: list[list[int]]
) -> list[list[float]]:
    """What the policy's float32 weights give in exact arithmetic (a float64 copy): the
    reference both float32 implementations round from. (When written: transformers' own
    float32 forward was 0.6e-5 to 1.6e-5 from it, radixlm's deterministic engine 0.3e-5 to
    0.8e-5.)"""
    with torch.no_grad():
        return [row.tolist() for row in _logprobs(copy.deepcopy(model).double(), prompts, outputs)]


def _trainer(port: int, path: str, rollouts: Any, replies: Any) -> None:
    """Rank 0 of a gloo group: per step, recompute the engine's rollouts' logprobs (exactly),
    reply with them, take a REINFORCE step (reward: the share of even token ids) and broadcast the
    new policy's tensors in name order; finally recompute the last rollouts once more."""
    import torch.distributed as dist
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _ in range(STEPS):
        prompts, outputs = rollouts.get(timeout=120)
        replies.put(_exact_logprobs(model, prompts, outputs))
        rows = _logprobs(model, prompts, outputs)
        rewards = torch.tensor([sum(t % 2 == 0 for t in out) / len(out) for out in outputs])
        advantages = rewards - rewards.mean()
        loss = -sum(a * row.sum() for a, row in zip(advantages, rows, strict=True))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
        state = sorted(model.state_dict().items())
        replies.put([(name, str(t.dtype), list(t.shape)) for name, t in state])
        with torch.no_grad():
            for _name, tensor in state:
                group.broadcast([tensor.detach().contiguous()], options).wait()
    prompts, outputs = rollouts.get(timeout=120)
    replies.put(_exact_logprobs(model, prompts, outputs))


def _rollouts(engine: Engine) -> tuple[list[list[int]], list[list[float]]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLED, return_logprob=True)
    return (
        [o["output_ids"] for o in outs],
        [[entry[0] for entry in o["meta_info"]["output_token_logprobs"]] for o in outs],
    )


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_the_engines_logprobs_follow_the_trainers_policy_within_1e_5(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "policy", seed=3, init_std=0.3)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    rollouts, replies = context.Queue(), context.Queue()
    trainer = context.Process(
        target=_trainer, args=(port, str(path), rollouts, replies), daemon=True
    )
    trainer.start()
    try:
        with Engine(
            str(path), show_progress=False, cpu_threads=1, enable_deterministic_inference=True
        ) as engine:
            assert engine.init_weights_update_group("127.0.0.1", port, 1, 2).result(120)["success"]
            history = []
            for step in range(STEPS):
                outputs, logprobs = _rollouts(engine)
                rollouts.put((PROMPTS, outputs))
                recomputed = replies.get(timeout=120)
                assert _largest_difference(logprobs, recomputed) < 1e-5, f"step {step}"
                history.append((outputs, logprobs))
                names, dtypes, shapes = zip(*replies.get(timeout=120), strict=True)
                result = engine.update_weights_from_distributed(
                    list(names), list(dtypes), list(shapes)
                ).result(120)
                assert result["success"] and result["weight_version"] == str(step + 1), result
            # The first rollouts again, now on the updated policy: other logprobs, the
            # trainer's own.
            outputs, logprobs = history[0]
            outs = engine.generate(
                input_ids=[p + o for p, o in zip(PROMPTS, outputs, strict=True)],
                sampling_params={"max_new_tokens": 1},
                return_logprob=True,
                logprob_start_len=0,
            )
            rescored = [
                [e[0] for e in out["meta_info"]["input_token_logprobs"][len(p) :]]
                for p, out in zip(PROMPTS, outs, strict=True)
            ]
            rollouts.put((PROMPTS, outputs))
            final = replies.get(timeout=120)
            engine.check_invariants()
    finally:
        trainer.join(30)
    assert _largest_difference(rescored, final) < 1e-5
    assert _largest_difference(rescored, logprobs) > 1e-3  # the weights did change
