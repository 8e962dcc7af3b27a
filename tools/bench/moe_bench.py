#!/usr/bin/env python3
"""Mixture-of-experts decode: radixlm's fused MoE beside its per-expert loop and transformers.

A MixtralForCausalLM at Mixtral-8x7B's proportions, scaled down for a CPU by default: 8
experts, top 2, hidden 1024, expert intermediate 3584 (Mixtral's 4096:14336 = 1:3.5), head
dim 128 (8 heads / 2 KV heads, Mixtral's 4:1 grouping), vocab 32000, 4 layers. `--hidden`,
`--intermediate`, `--layers`, `--experts`, `--top-k`, `--vocab` (and `--heads`,
`--kv-heads`) change it; `--preset mixtral-8x7b` is the real shape (hidden 4096, intermediate
14336, 32 layers, 32 heads / 8 KV heads: 46.7 B parameters, 93 GB in bfloat16), for a GPU.
The model directory holds only config.json and the id tokenizer of `_common.py`. Systems:

  fused              a radixlm engine (`load_format="dummy"`): each SparseMoeBlock runs
                     `radixlm.kernels.fused_moe` (one sort, one grouped matmul per projection;
                     Triton on CUDA, the torch reference elsewhere);
  loop               the same engine with `radixlm.kernels.reference.moe_per_expert_loop`
                     swapped into every block (`SparseMoeBlock.experts_impl`): for each expert
                     hit, `where(topk_ids == e)`, its gate, up and down projections, index_add;
  transformers       transformers' `generate` on the same weights (greedy, one static batch,
                     padded left), its default experts implementation: `grouped_mm` in
                     transformers 5 (sort by expert, one grouped matmul per projection);
  transformers-loop  the same model with `experts_implementation="eager"`: MixtralExperts'
                     own per-expert loop (one-hot mask, where, two linears per expert).

The transformers model is built from the same config with random weights (seed 0, std 0.02,
as radixlm's dummy ones) and the engine is given those weights before its first forward, so
every system computes the same function. `--skip-transformers` leaves transformers out (and
then the engine keeps its own dummy weights): the real shape does not fit twice on one GPU.

For each batch size (`--batch-sizes`, default 1,8,32): that many greedy requests of
`--prompt-len` random token ids, `--max-new-tokens` output tokens each (`ignore_eos`), all
submitted at once. Each system runs one output token (the prefill) and the full count; the
difference is the decode phase, and decode tok/s = batch x (new tokens - 1) / decode phase.
Every system is warmed up at every batch size first; the radix cache is flushed before each
engine run; the best of `--repeats` is kept, the systems taking turns. The engine runs on a
thread of this process (`engine_process=False`), without CUDA graphs on CUDA (the loop syncs
with the host in every layer). fused's output tokens are checked against loop's (greedy: they
should be identical) and compared with transformers'.

    .venv/bin/python tools/bench/moe_bench.py                       # ~2 min on 2 idle cores
    .venv/bin/python tools/bench/moe_bench.py --layers 2 --batch-sizes 1,8 --repeats 1
    python3 tools/bench/moe_bench.py --preset mixtral-8x7b --skip-transformers \\
        --json moe.json                           # a GPU with ~100 GB free: bfloat16, Triton
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from _common import ID_TOKENS_FROM, id_tokenizer, read_bandwidth_gbs, write_config
from lora_bench import cpu_line

#: Mixtral-8x7B's architecture (without token ids: the id tokenizer's EOS 0 is set below).
MIXTRAL_8X7B_SHAPE: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.02,
    "output_router_logits": False,
}

#: The CPU default: Mixtral's proportions at a quarter of its width, 4 of its 32 layers.
SMALL = {"hidden": 1024, "intermediate": 3584, "layers": 4}
PRESETS = {
    "small": SMALL,
    "mixtral-8x7b": {"hidden": 4096, "intermediate": 14336, "layers": 32},
}


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The config.json of the benchmark's model: Mixtral-8x7B's, with the flags' sizes."""
    heads = args.heads or max(1, args.hidden // 128)
    if args.hidden % heads:
        raise SystemExit(f"--hidden {args.hidden} is not a multiple of --heads {heads}")
    kv_heads = args.kv_heads or max(1, heads // 4)
    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    return {
        **MIXTRAL_8X7B_SHAPE,
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": args.hidden // heads,
        "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def expected_experts_hit(experts: int, top_k: int, batch: int) -> float:
    """Experts a layer reads at one decode step of `batch` tokens when each token picks
    `top_k` of them uniformly (as the dummy routers do): E x (1 - ((E - k) / E)^B)."""
    return experts * (1 - ((experts - top_k) / experts) ** batch)


def step_bytes(shape: dict[str, Any], batch: int, itemsize: int) -> float:
    """Weight bytes one decode step reads: every layer's attention and router, the experts
    hit (expected), the LM head. (The KV cache of short prompts is negligible beside them.)"""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape["head_dim"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    experts, top_k = shape["num_local_experts"], shape["num_experts_per_tok"]
    layer: float = hidden * (q + 2 * kv) + q * hidden + experts * hidden + 2 * hidden
    layer += expected_experts_hit(experts, top_k, batch) * 3 * hidden * inter
    head: int = shape["vocab_size"] * hidden
    return itemsize * (int(shape["num_hidden_layers"]) * layer + head)


def parameter_counts(shape: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, those one token's decode step reads at batch 1: its top-k experts)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape["head_dim"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    expert = 3 * hidden * inter
    experts, top_k = shape["num_local_experts"], shape["num_experts_per_tok"]
    router = experts * hidden
    norms = 2 * hidden
    layers = shape["num_hidden_layers"]
    embeddings = 2 * shape["vocab_size"] * hidden + hidden
    total = layers * (attention + router + norms + experts * expert) + embeddings
    active = layers * (attention + router + norms + top_k * expert) + embeddings
    return total, active


# ------------------------------------------------------------------------------- the systems


@dataclass
class Run:
    seconds: float
    outputs: list[list[int]]
    forwards: int | None = None  # the engine's forward passes (None: transformers)


class System(Protocol):
    """One way of generating for the batch."""

    name: str

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        """Generate `new_tokens` greedy tokens for every prompt, all at once (timed)."""
        ...


#: transformers' experts implementations -> the system's name.
HF_SYSTEMS = {"grouped_mm": "transformers", "eager": "transformers-loop"}


def params(new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}


def check_lengths(outputs: list[list[int]], count: int, new_tokens: int, system: str) -> None:
    if len(outputs) != count or any(len(o) != new_tokens for o in outputs):
        lengths = sorted({len(o) for o in outputs})
        raise SystemExit(
            f"{system}: {len(outputs)} outputs of {lengths} tokens, expected {count} of "
            f"{new_tokens}"
        )


class EngineSystem:
    """The radixlm engine with one experts implementation in every SparseMoeBlock."""

    def __init__(self, name: str, engine: Any, experts_impl: Any) -> None:
        self.name = name
        self.engine = engine
        self.experts_impl = experts_impl

    def use(self) -> int:
        """Put this system's experts implementation into every block, between two steps of
        the engine thread; returns the blocks changed."""
        from radixlm.runtime.models.moe import SparseMoeBlock

        impl = self.experts_impl

        def swap(core: Any) -> int:
            blocks = [
                m for m in core.executor.runner.model.modules() if isinstance(m, SparseMoeBlock)
            ]
            for block in blocks:
                block.experts_impl = impl
            return len(blocks)

        changed: int = self.engine.run_in_loop(swap)
        return changed

    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        self.use()
        self.engine.flush_cache().result(60)  # every run prefills its prompts in full
        before = self.engine.server_info()["forward_passes"]
        start = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params(new_tokens))
        seconds = time.perf_counter() - start
        forwards = self.engine.server_info()["forward_passes"] - before
        for out in outs:
            reason = (out["meta_info"].get("finish_reason") or {}).get("type")
            if reason != "length":
                raise SystemExit(f"{self.name}: a request ended with {reason}, not length")
        outputs = [o["output_ids"] for o in outs]
        check_lengths(outputs, len(prompts), new_tokens, self.name)
        return Run(seconds, outputs, forwards)


def pad_left(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask of a batch padded on the left (generate's convention)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


class TransformersSystem:
    """transformers' generate, greedy, one static batch, with one experts implementation."""

    def __init__(self, name: str, model: Any, experts: str, device: str) -> None:
        self.name = name
        self.model = model
        self.experts = experts
        self.device = device

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Run:
        self.model.set_experts_implementation(self.experts)
        ids, mask = pad_left(prompts, pad=0)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        if self.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        outputs = out[:, ids.shape[1] :].tolist()
        check_lengths(outputs, len(prompts), new_tokens, self.name)
        return Run(seconds, outputs)


def hf_model(workdir: Path, dtype: str, device: str) -> Any:
    """The transformers model of `workdir`'s config with random weights (seed 0) on
    `device`, generating until the length limit (no EOS)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(str(workdir))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=getattr(torch, dtype)
        )
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine's requests
    return model.eval()


def build_systems(
    workdir: Path, args: argparse.Namespace, max_batch: int, engines: list[Any]
) -> tuple[list[System], dict[str, Any]]:
    """The systems in the order they take turns, and facts about them for the report."""
    from radixlm.kernels import fused_moe
    from radixlm.kernels.reference import moe_per_expert_loop
    from radixlm.runtime import Engine

    extra: dict[str, Any] = {}
    if args.device == "cuda":
        extra["disable_cuda_graph"] = True
    engine = Engine(
        str(workdir),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        show_progress=False,
        max_total_tokens=max_batch * (args.prompt_len + args.max_new_tokens) + 256,
        max_running_requests=max_batch,
        **extra,
    )
    engines.append(engine)
    fused = EngineSystem("fused", engine, fused_moe)
    systems: list[System] = [fused, EngineSystem("loop", engine, moe_per_expert_loop)]
    facts: dict[str, Any] = {
        "engine_threads": engine.run_in_loop(lambda core: torch.get_num_threads()),
        "moe_blocks": fused.use(),
        "weights": "radixlm dummy (seed 0)",
    }
    if not args.skip_transformers:
        model = hf_model(workdir, args.dtype, args.device)

        def load(core: Any) -> None:
            core.executor.runner.load_weights(model.state_dict().items())

        engine.run_in_loop(load, timeout=600)
        facts["weights"] = "transformers' random init (seed 0), loaded into the engine"
        for experts in args.hf_experts:
            name = HF_SYSTEMS.get(experts, f"transformers-{experts}")
            systems.append(TransformersSystem(name, model, experts, args.device))
    return systems, facts


# ------------------------------------------------------------------------------- measuring


#: Column labels of the ratios.
SHORT = {"loop": "loop", "transformers": "hf", "transformers-loop": "hf-loop"}


@dataclass
class Row:
    batch: int
    new_tokens: int
    seconds: dict[str, float]  # the whole run, best of the repeats
    prefill_seconds: dict[str, float]  # the one-token run, best of the repeats
    decode_tok_s: dict[str, float] = field(default_factory=dict)
    same_as_fused: dict[str, int] = field(default_factory=dict)  # requests with fused's tokens
    engine_decode_forwards: int | None = None  # the full run's forwards less the one-token's
    roofline_tok_s: float = 0.0  # batch / (weight bytes per step / read bandwidth)


def measure_batch(
    systems: list[System], prompts: list[list[int]], args: argparse.Namespace, floor_s: float
) -> Row:
    """Every system at this batch: warmed up, then --repeats one-token and full runs each;
    `floor_s` is the decode step's bandwidth floor."""
    new, batch = args.max_new_tokens, len(prompts)
    for system in systems:  # oneDNN / Triton build their kernels for these shapes here
        system.run(prompts, 2)
    full: dict[str, list[Run]] = {s.name: [] for s in systems}
    ones: dict[str, list[Run]] = {s.name: [] for s in systems}
    for repeat in range(args.repeats):
        turn = systems[repeat % len(systems) :] + systems[: repeat % len(systems)]
        for system in turn:
            ones[system.name].append(system.run(prompts, 1))
            full[system.name].append(system.run(prompts, new))
            print(
                f"  batch {batch:3d} repeat {repeat + 1}: {system.name:17s} one token "
                f"{ones[system.name][-1].seconds:7.2f} s  {new} tokens "
                f"{full[system.name][-1].seconds:7.2f} s",
                flush=True,
            )
    row = Row(
        batch=batch,
        new_tokens=new,
        seconds={n: min(r.seconds for r in runs) for n, runs in full.items()},
        prefill_seconds={n: min(r.seconds for r in runs) for n, runs in ones.items()},
        roofline_tok_s=batch / floor_s,
    )
    fused_full, fused_one = full["fused"][-1].forwards, ones["fused"][-1].forwards
    if fused_full is not None and fused_one is not None:
        row.engine_decode_forwards = fused_full - fused_one
    for name in full:
        decode = max(row.seconds[name] - row.prefill_seconds[name], 1e-9)
        row.decode_tok_s[name] = batch * (new - 1) / decode
        row.same_as_fused[name] = sum(
            a == b for a, b in zip(full["fused"][-1].outputs, full[name][-1].outputs, strict=True)
        )
    return row


def report(rows: list[Row], names: list[str]) -> None:
    others = [n for n in names if n != "fused"]
    head = f"{'batch':>5} | " + " ".join(f"{n:>17s}" for n in names)
    head += " | " + " ".join(f"{'fused/' + SHORT.get(n, n):>13s}" for n in others)
    head += f" | {'roofline':>8s} {'fused %':>7s}"
    print()
    print(
        "decode tok/s (the full run less the one-token run); ratios: fused's over the other's; "
        "roofline: batch / (weight bytes a step reads / read bandwidth)"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        cells = " ".join(f"{row.decode_tok_s[n]:17.1f}" for n in names)
        ratios = " ".join(
            f"{row.decode_tok_s['fused'] / row.decode_tok_s[n]:12.2f}x" for n in others
        )
        fused_share = 100 * row.decode_tok_s["fused"] / row.roofline_tok_s
        print(
            f"{row.batch:>5} | {cells} | {ratios} | {row.roofline_tok_s:8.1f} {fused_share:6.0f}%"
        )
    print()
    for row in rows:
        same = ", ".join(f"{n} {row.same_as_fused[n]}/{row.batch}" for n in others)
        steps = row.engine_decode_forwards
        print(
            f"batch {row.batch}: requests with fused's exact greedy tokens: {same}; the "
            f"engine's decode forwards {steps} (expected {row.new_tokens - 1})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--hidden", type=int, default=None, help="default: the preset's")
    parser.add_argument("--intermediate", type=int, default=None, help="each expert's")
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=None, help="default: hidden / 128")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: heads / 4")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per system (best kept)")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if present"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--hf-experts",
        default="grouped_mm,eager",
        help="transformers' experts implementations to run (grouped_mm: its default; eager: "
        "its per-expert loop)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures here (after each batch size)")
    args = parser.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.hf_experts = [e for e in args.hf_experts.split(",") if e]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (one prefill token, one decode step)")
    if not 1 <= args.top_k <= args.experts:
        parser.error("--top-k must be between 1 and --experts")
    if args.vocab <= ID_TOKENS_FROM:
        parser.error(f"--vocab must be above {ID_TOKENS_FROM} (the id tokenizer's bytes)")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    shape = model_shape(args)
    total, active = parameter_counts(shape)
    itemsize = getattr(torch, args.dtype).itemsize
    line, machine = cpu_line()
    print(line, flush=True)
    print(
        f"model: MixtralForCausalLM, {shape['num_local_experts']} experts top "
        f"{shape['num_experts_per_tok']}, hidden {shape['hidden_size']}, expert intermediate "
        f"{shape['intermediate_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads, vocab "
        f"{shape['vocab_size']}; {total / 1e9:.2f} B parameters ({total * itemsize / 1e9:.1f} "
        f"GB), {active / 1e9:.2f} B read per token at batch 1; {args.dtype} on {args.device}",
        flush=True,
    )
    print(
        f"workload: batches {batch_sizes}, {args.prompt_len}-token prompts, "
        f"{args.max_new_tokens} new tokens each, greedy, ignore_eos; best of {args.repeats}",
        flush=True,
    )

    bandwidth = read_bandwidth_gbs(args.device)
    floors = {b: step_bytes(shape, b, itemsize) / (bandwidth * 1e9) for b in batch_sizes}
    print(
        f"read bandwidth {bandwidth:.1f} GB/s; weights read per decode step (experts hit, "
        "uniform routing): "
        + ", ".join(
            f"batch {b} {step_bytes(shape, b, itemsize) / 1e9:.2f} GB "
            f"({expected_experts_hit(args.experts, args.top_k, b):.1f} experts a layer)"
            for b in batch_sizes
        ),
        flush=True,
    )

    rng = random.Random(args.seed)
    most = max(batch_sizes)
    prompts = [
        [rng.randrange(ID_TOKENS_FROM, args.vocab) for _ in range(args.prompt_len)]
        for _ in range(most)
    ]
    started = time.perf_counter()
    workdir = write_config(shape, args.dtype, "moe_bench_")
    engines: list[Any] = []
    rows: list[Row] = []
    try:
        id_tokenizer(workdir, args.vocab)
        systems, facts = build_systems(workdir, args, most, engines)
        names = [s.name for s in systems]
        print(
            f"systems: {', '.join(names)}; weights: {facts['weights']}; {facts['moe_blocks']} "
            f"MoE blocks swapped between fused and loop; torch threads: {torch.get_num_threads()}"
            f" here, {facts['engine_threads']} on the engine thread "
            f"(set up in {time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        for batch in batch_sizes:
            rows.append(measure_batch(systems, prompts[:batch], args, floors[batch]))
            if args.json:  # after each batch: a run cut short still leaves its figures
                meta = {
                    "machine": machine,
                    "args": vars(args),
                    "config": shape,
                    "parameters": total,
                    "active_parameters": active,
                    "read_bandwidth_gbs": bandwidth,
                    **facts,
                }
                write_json(args.json, meta, rows, started)
    finally:
        for engine in engines:
            engine.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    report(rows, names)
    identical = all(r.same_as_fused["loop"] == r.batch for r in rows)
    print(
        "fused and loop gave "
        + ("identical token ids on every request" if identical else "DIFFERENT token ids")
    )
    print(f"\nthe run took {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    sys.stdout.flush()


def write_json(path: str, meta: dict[str, Any], rows: list[Row], started: float) -> None:
    Path(path).write_text(
        json.dumps(
            {
                **meta,
                "rows": [asdict(r) for r in rows],
                "fused_equals_loop": all(r.same_as_fused["loop"] == r.batch for r in rows),
                "minutes": round((time.perf_counter() - started) / 60, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
