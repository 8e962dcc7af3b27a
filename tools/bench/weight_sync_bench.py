#!/usr/bin/env python3
"""How long a rollout engine takes to take new weights: Qwen2.5-0.5B's shapes (bfloat16,
random weights), updated from tensors in the same process, from a safetensors directory
(read from the page cache: written just before), and over a gloo process group from a
trainer process, side by side with a plain memcpy of the same bytes (`dst.copy_(src)` per
tensor, into tensors allocated beforehand). CPU, this process's torch threads.

    .venv/bin/python tools/bench/weight_sync_bench.py          # about 2 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from _common import QWEN25_05B_SHAPE, id_tokenizer, random_hf_model, write_config
from quant_quality import cpu_flags


def _trainer(port: int, directory: str, rounds: int) -> None:
    """Rank 0 of a gloo group: broadcasts the checkpoint's tensors, in name order, `rounds`
    times."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    tensors = sorted(load_file(str(Path(directory) / "model.safetensors")).items())
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for _ in range(rounds):
        for _name, tensor in tensors:
            group.broadcast([tensor.contiguous()], options).wait()


def _best(function: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    from radixlm.runtime import Engine

    workdir = write_config(QWEN25_05B_SHAPE, "bfloat16", "radixlm-weights-")
    id_tokenizer(workdir, QWEN25_05B_SHAPE["vocab_size"])
    model = random_hf_model(workdir, "bfloat16")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    tensors = sorted(state.items())
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    checkpoint = Path(tempfile.mkdtemp(prefix="radixlm-checkpoint-"))
    (checkpoint / "config.json").write_text((workdir / "config.json").read_text())
    save_file(state, str(checkpoint / "model.safetensors"))

    targets = [torch.empty_like(t) for _, t in tensors]

    def memcpy() -> None:
        for (_, source), target in zip(tensors, targets, strict=True):
            target.copy_(source)

    rows: dict[str, float] = {"memcpy": _best(memcpy, args.repeats)}
    targets.clear()  # (their memory back before the engine starts)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    trainer = context.Process(target=_trainer, args=(port, str(checkpoint), args.repeats))
    trainer.start()
    with Engine(str(workdir), load_format="dummy", dtype="bfloat16", show_progress=False,
                max_total_tokens=4096) as engine:  # fmt: skip

        def from_tensor() -> None:
            assert engine.update_weights_from_tensor(tensors).result(600)["success"]

        def from_disk() -> None:
            assert engine.update_weights_from_disk(str(checkpoint)).result(600)["success"]

        names = [n for n, _ in tensors]
        dtypes = [t.dtype for _, t in tensors]
        shapes = [t.shape for _, t in tensors]

        def from_group() -> None:
            reply = engine.update_weights_from_distributed(names, dtypes, shapes)
            assert reply.result(600)["success"]

        rows["from_tensor"] = _best(from_tensor, args.repeats)
        rows["from_disk"] = _best(from_disk, args.repeats)
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2).result(600)["success"]
        rows["from_gloo_group"] = _best(from_group, args.repeats)
    trainer.join(60)
    print(f"Qwen2.5-0.5B shapes, bfloat16, {nbytes / 1e9:.2f} GB in {len(tensors)} tensors; "
          f"{cpu_flags()}, torch threads {torch.get_num_threads()}; best of {args.repeats}")  # fmt: skip
    print(f"{'path':16} {'seconds':>8} {'GB/s':>7} {'x memcpy':>9}")
    for name, seconds in rows.items():
        print(f"{name:16} {seconds:>8.3f} {nbytes / seconds / 1e9:>7.2f} "
              f"{seconds / rows['memcpy']:>8.2f}x")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_flags(), "bytes": nbytes, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
