#!/usr/bin/env python3
"""Multi-LoRA serving: one engine decoding requests of many adapters in the same steps, beside
the same engine taking one adapter's requests at a time, and beside the base model alone.

A dummy-weight model with Qwen2.5-0.5B's shapes (hidden 896, intermediate 4864, 24 layers,
14 heads / 2 KV heads, vocab 151936, tied embeddings; `--layers` keeps only the first N layers
for a quick CPU run) and --adapters random PEFT LoRA adapters (rank --rank, alpha 2 x rank, all
seven projections: q/k/v/o and gate/up/down), written with safetensors into a temporary
directory in PEFT's layout. --requests greedy requests of --prompt-len random token ids and
--max-new-tokens output tokens each (`ignore_eos`), spread round-robin over the adapters.
Systems, on the same requests:

  lora-batched   an engine with all adapters loaded (`lora_paths`, `max_loras_per_batch`
                 --max-loras-per-batch, default 8): every request submitted at once, so each
                 forward step serves the rows of every adapter;
  lora-separate  the same engine, one adapter's requests at a time (submit, wait for them,
                 then the next adapter's): what a server without mixed-adapter batching does;
  lora-single    the same engine, every request on the first adapter, all at once: the
                 LoRA path with one adapter per step (where the mixed one's extra cost shows);
  base           an engine without LoRA, the same requests without an adapter;
  base-eager     (CUDA only) the same with CUDA graphs off: an engine with LoRA does not
                 capture graphs, so this is the like-for-like step for the LoRA overhead.

Each system runs twice per repeat: one output token (the prefill alone) and --max-new-tokens;
the difference is the decode phase, and the difference of their forward passes its decode
steps (--max-new-tokens - 1 at the full batch; that many per adapter for lora-separate), from
which the decode step time and the LoRA path's overhead per step (lora-batched over base at
the same batch) come. The output table also gives output tok/s and requests/s of the whole
run, and the adapter slot swaps during the timed runs. The radix cache is flushed before every
timed run, so each one prefills its prompts in full. The best of --repeats is kept; the systems
take turns within a repeat. Every engine is warmed up once before timing (with logprobs, which
must be finite). The engines run on a thread of this process (`engine_process=False`, the
Engine's default), so the timings include the front end's work but no inter-process hops.

    .venv/bin/python tools/bench/lora_bench.py --layers 4 --threads 1   # ~2 min on 2 cores
    .venv/bin/python tools/bench/lora_bench.py --threads 1              # all 24 layers (CPU, long)
    python3 tools/bench/lora_bench.py --requests 256 --prompt-len 256 --max-new-tokens 64 \\
        --json lora.json                          # a GPU: all 24 layers, bfloat16, Triton LoRA
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from _common import ID_TOKENS_FROM, QWEN25_05B_SHAPE, id_tokenizer, write_config

QWEN25_05B: dict[str, Any] = {**QWEN25_05B_SHAPE, "bos_token_id": 0, "eos_token_id": 0}
PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


# ------------------------------------------------------------------------------- the setup


def projection_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adapted projection of `shape`."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(directory: Path, shape: dict[str, Any], rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for every projection of every layer of `shape`.

    A is drawn like PEFT's initialisation (uniform within 1 / sqrt(in), kaiming with a =
    sqrt(5)); B, zero at PEFT's initialisation, is drawn as a trained one might be, normal
    with std 0.01. With alpha = 2 x rank each delta is a few percent of its projection's output
    on the dummy base weights (std 0.02): it changes the greedy tokens, and logits stay finite.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(shape)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape["num_hidden_layers"]):
        for block, modules in PROJECTIONS.items():
            for module in modules:
                fan_in, fan_out = shapes[module]
                name = f"base_model.model.model.layers.{layer}.{block}.{module}"
                bound = fan_in**-0.5
                a = (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound
                tensors[f"{name}.lora_A.weight"] = a
                tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
                tensors[f"{name}.lora_B.weight"].mul_(0.01)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": [m for modules in PROJECTIONS.values() for m in modules],
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))


def cpu_line() -> tuple[str, dict[str, Any]]:
    """The machine (report.machine) with the CPU's vector extensions, as one line."""
    from report import machine

    info = machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    info["avx512"] = bool(avx512)
    info["cpu_flags"] = avx512 + sorted(f for f in flags if f.startswith("amx") or f == "avx2")
    vector = (
        f"AVX-512 ({', '.join(avx512)})"
        if avx512
        else ("no AVX-512 (AVX2)" if "avx2" in flags else "no AVX-512")
    )
    if any(f.startswith("amx") for f in flags):
        vector += ", AMX"
    gpus = ", ".join(info["gpus"]) or "no GPU"
    line = (
        f"CPU: {info['cpu']}, {info['cores']} cores ({info.get('usable_cores')} usable), "
        f"{vector}; {gpus}; torch {info['torch']} with {torch.get_num_threads()} threads; "
        f"load average {info['load_average']}; commit {info['commit']}"
    )
    return line, info


# ------------------------------------------------------------------------------- the systems


@dataclass
class Workload:
    prompts: list[list[int]]
    adapters: list[str]  # the adapter of each request

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.adapters))


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]
    forwards: int
    slot_swaps: int


def params(new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}


def check(outputs: Sequence[dict[str, Any]], count: int, new_tokens: int, system: str) -> None:
    """Every request finished with exactly `new_tokens` output tokens."""
    if len(outputs) != count:
        raise SystemExit(f"{system}: {len(outputs)} outputs for {count} requests")
    for k, out in enumerate(outputs):
        got = len(out["output_ids"])
        reason = (out["meta_info"].get("finish_reason") or {}).get("type")
        if got != new_tokens or reason != "length":
            raise SystemExit(
                f"{system}: request {k} ended with {got} tokens ({reason}), not {new_tokens}"
            )


class System:
    """One way of serving the workload on an engine."""

    def __init__(self, name: str, engine: Any, adapters: bool, single: bool = False) -> None:
        self.name = name
        self.engine = engine
        self.adapters = adapters  # whether requests name their adapters
        self.single = single  # every request on the first adapter instead of its own

    def lora_paths(self, work: Workload, rows: Sequence[int]) -> list[str] | None:
        if not self.adapters:
            return None
        return [work.adapters[0 if self.single else i] for i in rows]

    def submit(self, work: Workload, new_tokens: int) -> list[list[int]]:
        lora = self.lora_paths(work, range(len(work.prompts)))
        outs = self.engine.generate(
            input_ids=work.prompts, sampling_params=params(new_tokens), lora_path=lora
        )
        check(outs, len(work.prompts), new_tokens, self.name)
        return [o["output_ids"] for o in outs]

    def run(self, work: Workload, new_tokens: int) -> Run:
        self.engine.flush_cache().result(60)  # every run prefills its prompts in full
        before = self.engine.server_info()
        start = time.perf_counter()
        outputs = self.submit(work, new_tokens)
        seconds = time.perf_counter() - start
        after = self.engine.server_info()
        return Run(
            seconds=seconds,
            outputs=outputs,
            forwards=after["forward_passes"] - before["forward_passes"],
            slot_swaps=after.get("lora_slot_swaps", 0) - before.get("lora_slot_swaps", 0),
        )


class SeparateBatches(System):
    """One adapter's requests at a time: submit them, wait for all of them, then the next."""

    def submit(self, work: Workload, new_tokens: int) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in work.prompts]
        for name in work.names:
            rows = [i for i, a in enumerate(work.adapters) if a == name]
            outs = self.engine.generate(
                input_ids=[work.prompts[i] for i in rows],
                sampling_params=params(new_tokens),
                lora_path=name,
            )
            check(outs, len(rows), new_tokens, self.name)
            for i, out in zip(rows, outs, strict=True):
                outputs[i] = out["output_ids"]
        return outputs


def warm_up(system: System, work: Workload) -> int:
    """One untimed run of one request per adapter, with logprobs: they must be finite (a NaN or
    an infinity would mean the adapters broke the forward). Returns the logprobs checked."""
    first = {name: work.adapters.index(name) for name in work.names}
    rows = list(first.values())
    lora = system.lora_paths(work, rows)
    outs = system.engine.generate(
        input_ids=[work.prompts[i] for i in rows],
        sampling_params=params(4),
        lora_path=lora,
        return_logprob=True,
    )
    check(outs, len(rows), 4, system.name)
    values = [e[0] for o in outs for e in o["meta_info"]["output_token_logprobs"]]
    bad = [v for v in values if v is None or not (-1e30 < v <= 0.0)]
    if bad:
        raise SystemExit(f"{system.name}: non-finite or positive logprobs after warm-up: {bad[:4]}")
    system.engine.flush_cache().result(60)
    return len(values)


@dataclass
class Row:
    system: str
    requests: int
    output_tokens: int
    seconds: float  # the whole run (prefill and decode), best of the repeats
    prefill_seconds: float  # the one-token run, best of the repeats
    decode_steps: int  # decode forward passes of the whole run (all batches)
    decode_batch: float  # requests per decode step, on average
    forwards: int
    slot_swaps: int
    seconds_all: list[float] = field(default_factory=list)
    prefill_all: list[float] = field(default_factory=list)

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.prefill_seconds, 1e-9)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps * self.decode_batch / self.decode_seconds

    @property
    def step_ms(self) -> float:
        return 1000 * self.decode_seconds / self.decode_steps

    def as_json(self) -> dict[str, Any]:
        props = ("requests_per_s", "output_tok_s", "decode_tok_s", "step_ms", "decode_seconds")
        return {**asdict(self), **{p: getattr(self, p) for p in props}}


# ------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--max-loras-per-batch", type=int, default=8, help="adapter slots of the pool"
    )
    parser.add_argument(
        "--assign",
        choices=["round-robin", "random"],
        default="round-robin",
        help="how requests are spread over the adapters (random: seeded by --seed)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="keep only this many of the 24 layers"
    )
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (one prefill token, one decode step)")
    if args.requests < args.adapters:
        parser.error("--requests must be at least --adapters (every adapter gets a request)")

    shape = dict(QWEN25_05B)
    full_layers = shape["num_hidden_layers"]
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    layers = shape["num_hidden_layers"]
    line, machine = cpu_line()
    print(line, flush=True)
    trunk = (
        f"all {full_layers} layers"
        if layers == full_layers
        else f"only {layers} of its {full_layers} layers (--layers {layers}: not the full model)"
    )
    print(
        f"model: Qwen2.5-0.5B's shapes (hidden 896, intermediate 4864, 14 heads / 2 KV heads, "
        f"vocab 151936, tied embeddings), {trunk}; dummy weights, {args.dtype} on {args.device}",
        flush=True,
    )
    print(
        f"adapters: {args.adapters} random PEFT LoRA adapters, rank {args.rank}, alpha "
        f"{2 * args.rank}, q/k/v/o/gate/up/down of every layer; max_loras_per_batch "
        f"{args.max_loras_per_batch}",
        flush=True,
    )
    print(
        f"workload: {args.requests} requests ({args.assign} over the adapters), "
        f"{args.prompt_len}-token prompts, {args.max_new_tokens} output tokens each, greedy, "
        f"ignore_eos; engines on a thread of this process (engine_process=False); best of "
        f"{args.repeats}",
        flush=True,
    )

    rng = random.Random(args.seed)
    vocab = shape["vocab_size"]
    prompts = [
        [rng.randrange(ID_TOKENS_FROM, vocab) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    names = [f"adapter{k}" for k in range(args.adapters)]
    if args.assign == "round-robin":
        assigned = [names[i % args.adapters] for i in range(args.requests)]
    else:  # every adapter at least once, the rest at random
        assigned = names + [rng.choice(names) for _ in range(args.requests - args.adapters)]
        rng.shuffle(assigned)
    work = Workload(prompts, assigned)

    started = time.perf_counter()
    workdir = write_config(shape, args.dtype, "lora_bench_")
    adapter_root = Path(tempfile.mkdtemp(prefix="lora_bench_adapters_"))
    engines: list[Any] = []
    try:
        id_tokenizer(workdir, vocab)
        paths = {}
        for k, name in enumerate(names):
            paths[name] = str(adapter_root / name)
            write_adapter(adapter_root / name, shape, args.rank, seed=args.seed + 1 + k)
        size = sum(f.stat().st_size for f in adapter_root.rglob("*.safetensors"))
        print(f"adapters written: {size / 2**20:.1f} MiB in all", flush=True)
        systems = build_systems(workdir, paths, args, engines)
        firsts = {id(s.engine): s for s in reversed(systems)}  # the first system of each engine
        checked = sum(warm_up(s, work) for s in firsts.values())
        print(f"warm-up done: {checked} output logprobs checked, all finite", flush=True)
        rows, agreement = measure(systems, work, args)
        lora_info = {k: v for k, v in engines[0].server_info().items() if "lora" in k}
    finally:
        for engine in engines:
            engine.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(adapter_root, ignore_errors=True)
    report(rows, agreement, args)
    elapsed = time.perf_counter() - started
    print(f"\nthe run took {elapsed / 60:.1f} min", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": machine,
                    "args": vars(args),
                    "layers": layers,
                    "rows": [r.as_json() for r in rows],
                    "agreement": agreement,
                    "lora_slots": lora_info.get("lora_slots"),
                    "minutes": round(elapsed / 60, 2),
                },
                indent=2,
            )
        )
    sys.stdout.flush()


def build_systems(
    workdir: Path, paths: dict[str, str], args: argparse.Namespace, engines: list[Any]
) -> list[System]:
    """The engines (appended to `engines` as they start, so they can be shut down) and the
    systems over them, in the order they take turns."""
    from radixlm.runtime import Engine

    common: dict[str, Any] = dict(
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        show_progress=False,
        max_total_tokens=args.requests * (args.prompt_len + args.max_new_tokens) + 1024,
        max_running_requests=args.requests,
    )
    lora = Engine(
        str(workdir),
        lora_paths=paths,
        max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.rank,
        **common,
    )
    engines.append(lora)
    base = Engine(str(workdir), **common)
    engines.append(base)
    systems = [
        System("lora-batched", lora, adapters=True),
        SeparateBatches("lora-separate", lora, adapters=True),
        System("lora-single", lora, adapters=True, single=True),
        System("base", base, adapters=False),
    ]
    if args.device == "cuda":
        eager = Engine(str(workdir), disable_cuda_graph=True, **common)
        engines.append(eager)
        systems.append(System("base-eager", eager, adapters=False))
    return systems


def measure(
    systems: list[System], work: Workload, args: argparse.Namespace
) -> tuple[list[Row], dict[str, int]]:
    """Each system's prefill-only and full runs, --repeats times, taking turns (the order
    rotates each repeat); the best of each is kept. Also how many greedy outputs agree
    between the systems."""
    new = args.max_new_tokens
    full: dict[str, list[Run]] = {s.name: [] for s in systems}
    prefill: dict[str, list[Run]] = {s.name: [] for s in systems}
    for repeat in range(args.repeats):
        turn = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
        for system in turn:
            prefill[system.name].append(system.run(work, 1))
            full[system.name].append(system.run(work, new))
            best = min(r.seconds for r in full[system.name])
            print(
                f"  repeat {repeat + 1}: {system.name:14s} prefill "
                f"{prefill[system.name][-1].seconds:7.2f} s  full {full[system.name][-1].seconds:7.2f} s"
                f"  (best {best:.2f} s)",
                flush=True,
            )
    rows = []
    for system in systems:
        runs, ones = full[system.name], prefill[system.name]
        # Decode steps: the full run's forward passes less the prefill-only run's (one per
        # batch, or per wave where the adapters outnumber the slots).
        steps = max(1, runs[-1].forwards - ones[-1].forwards)
        rows.append(
            Row(
                system=system.name,
                requests=len(work.prompts),
                output_tokens=len(work.prompts) * new,
                seconds=min(r.seconds for r in runs),
                prefill_seconds=min(r.seconds for r in ones),
                decode_steps=steps,
                decode_batch=len(work.prompts) * (new - 1) / steps,
                forwards=runs[-1].forwards,
                slot_swaps=sum(r.slot_swaps for r in runs + ones),
                seconds_all=[r.seconds for r in runs],
                prefill_all=[r.seconds for r in ones],
            )
        )
    outputs = {name: runs[-1].outputs for name, runs in full.items()}
    n = len(work.prompts)
    same = sum(
        a == b for a, b in zip(outputs["lora-batched"], outputs["lora-separate"], strict=True)
    )
    differ = sum(a != b for a, b in zip(outputs["lora-batched"], outputs["base"], strict=True))
    agreement = dict(requests=n, batched_equals_separate=same, batched_differs_from_base=differ)
    return rows, agreement


def report(rows: list[Row], agreement: dict[str, int], args: argparse.Namespace) -> None:
    by = {r.system: r for r in rows}
    batched = by["lora-batched"]
    head = (
        f"{'system':14s} {'seconds':>8s} {'req/s':>7s} {'out tok/s':>9s} {'x batched':>9s} "
        f"{'prefill s':>9s} {'batch':>5s} {'step ms':>8s} {'decode tok/s':>12s} "
        f"{'forwards':>8s} {'swaps':>5s}"
    )
    print()
    print("x batched: lora-batched's output tok/s over the system's (>1: batched is faster)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.system:14s} {r.seconds:8.2f} {r.requests_per_s:7.2f} {r.output_tok_s:9.1f} "
            f"{batched.output_tok_s / r.output_tok_s:8.2f}x {r.prefill_seconds:9.2f} "
            f"{r.decode_batch:5.0f} {r.step_ms:8.1f} {r.decode_tok_s:12.1f} {r.forwards:8d} "
            f"{r.slot_swaps:5d}"
        )
    separate = by["lora-separate"]
    print()
    if args.adapters > args.max_loras_per_batch:
        print(
            f"note: {args.adapters} adapters for {args.max_loras_per_batch} slots: lora-batched "
            f"ran in waves (about {batched.decode_batch:.0f} requests a decode step), so its "
            "step time is not at the base runs' batch size"
        )
    print(
        f"batched multi-adapter over separate per-adapter batches: "
        f"{batched.output_tok_s / separate.output_tok_s:.2f}x output tok/s, "
        f"{separate.decode_seconds / batched.decode_seconds:.2f}x decode phase, "
        f"{separate.prefill_seconds / batched.prefill_seconds:.2f}x prefill phase"
    )
    for ref in [r for r in rows if r.system.startswith("base")]:
        print(
            f"LoRA overhead vs {ref.system} at batch {batched.decode_batch:.0f}: decode step "
            f"{batched.step_ms:.1f} ms vs {ref.step_ms:.1f} ms "
            f"({batched.step_ms / ref.step_ms - 1:+.1%}), prefill "
            f"{batched.prefill_seconds:.2f} s vs {ref.prefill_seconds:.2f} s "
            f"({batched.prefill_seconds / ref.prefill_seconds - 1:+.1%}), whole run "
            f"{batched.output_tok_s:.1f} vs {ref.output_tok_s:.1f} output tok/s "
            f"({batched.output_tok_s / ref.output_tok_s - 1:+.1%})"
        )
    single = by["lora-single"]
    print(
        f"{args.adapters} adapters in each step vs one: decode step {batched.step_ms:.1f} ms vs "
        f"{single.step_ms:.1f} ms ({batched.step_ms / single.step_ms - 1:+.1%}), prefill "
        f"{batched.prefill_seconds:.2f} s vs {single.prefill_seconds:.2f} s "
        f"({batched.prefill_seconds / single.prefill_seconds - 1:+.1%})"
    )
    a = agreement
    print(
        f"outputs: lora-batched equals lora-separate on {a['batched_equals_separate']} of "
        f"{a['requests']} requests; differs from base on {a['batched_differs_from_base']} of "
        f"{a['requests']} (the adapters change the greedy tokens)"
    )


if __name__ == "__main__":
    main()
