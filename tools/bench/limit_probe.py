#!/usr/bin/env python3
"""The machine's limit for a serving workload: how fast this machine's matrix multiplies could
run it, measured here with the benchmark's thread count and dtype.

    .venv/bin/python tools/bench/limit_probe.py --model-path DIR --threads 1 --batch 8 \\
        --prompt-tokens 7840 --decode-steps 8:31,8:31

What is counted, and what is not:

- Prefill: every unique prompt token costs the model's projection FLOPs, 2 x (the q, k, v, o,
  gate, up and down weights of every layer). Their rate is measured as `torch.nn.functional.
  linear` on one layer's seven weight shapes at M = `prefill_tokens` rows (default 512), best of
  five repetitions. A prompt token is unique when no earlier prompt (or earlier prompt plus its
  output) of the workload starts with the same tokens up to it; each prompt's last token always
  counts (its logits must be computed), as in engine_bench's optimal hit rate.
- Decode: one step at batch B is timed as a whole forward's worth of projections at M = B over
  separate weights for every layer (so the weights stream from memory as in a real step), plus
  the lm_head at M = B, best of five steps. A workload's decode steps are counted from its
  request count, concurrency and output length (`serve_demand`), or from its stages.
- Not counted: attention (scores and the KV reads), norms, rotary embeddings, sampling, the
  lm_head row of each prompt's last token, and any scheduling, tokenizing or HTTP cost. Leaving
  them out makes the limit a lower bound on the time: a system's share of it, limit / measured
  time, stays under 100% unless its kernels beat torch's matmul in this dtype (llama.cpp's
  quantized dot products can: its share is then over 100%).
  What attention would cost at the measured rate is reported beside the limit
  (`Rates.attention_seconds`: the query-key pairs of every computed token, `Demand.
  attention_keys`, times 4 x heads x head_dim x layers FLOPs): over a long shared prefix it is
  a fifth of a workload's FLOPs or more, time no system's share of the limit can include
  (the floor below counts it).

`limit = unique prompt tokens / prompt tokens per s + sum over decode batches of steps x step
time`. torch's decode steps at a few rows run well below its prefill rate, and a system with
its own decode kernels can beat them (radixlm's CPU decode path does). A harder bound is the
floor, `Rates.floor_seconds`: every FLOP counted (the decoded tokens' lm_head rows and, with
the workload's sequences, attention's query-key pairs included) at the faster of that rate
and radixlm's own float32 panel products' on the same shapes (`Rates.panel_gflops`: faster
than torch's on an AVX-512 EPYC), and no decode step shorter than one read of the weights
and of the cached keys and values it attends over (each distinct cached token once; less
what the caches hold) at the measured read bandwidth (a sum over 512 MB). A system whose
products run no faster than the fastest measured here and whose reads no faster than that
bandwidth cannot take less; a goal under the floor asks for faster products than any
measured here. It is not the silicon's bound: the cores' fused multiply-adds peak higher
(about 116 GFLOP/s of float32 on one core of that EPYC, against 91-105 for the products).
The floor leaves out norms, rotary embeddings, softmax, sampling and any scheduling,
tokenizing or HTTP cost.

The figures are this machine's at the moment of the probe, the best of five repetitions; on a
shared machine they still move with the load (53-76 GFLOP/s in one afternoon on a 2-core
EPYC shared with other jobs), so probe in the same run as the measurement and read a share
as +-20% there.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import read_bandwidth_gbs

# --------------------------------------------------------------------------- the arithmetic


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The matmul shapes of a decoder: per-layer projections and the lm_head."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a transformers config.json's fields (Llama / Qwen2 / Qwen3 naming)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
        )

    def layer_weights(self) -> list[tuple[int, int]]:
        """(out, in) of q, k, v, o, gate, up, down."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]

    @property
    def projection_params(self) -> int:
        """Weights multiplied for every token in every layer (the lm_head apart)."""
        return self.layers * sum(o * i for o, i in self.layer_weights())

    @property
    def flops_per_prompt_token(self) -> float:
        return 2.0 * self.projection_params

    def weight_bytes(self, dtype: str) -> int:
        """The bytes of the projections and the lm_head in `dtype` (a torch dtype's name)."""
        return (self.projection_params + self.vocab * self.hidden) * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """One cached token's keys and values over every layer, in `dtype`."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    @property
    def flops_per_key(self) -> float:
        """Attention's FLOPs per query-key pair over every layer: the score and the value's
        multiply-adds of every query head."""
        return 4.0 * self.heads * self.head_dim * self.layers

    @property
    def flops_per_decode_token(self) -> float:
        """A decoded token's projections and its row of the lm_head."""
        return self.flops_per_prompt_token + 2.0 * self.vocab * self.hidden


@dataclass(frozen=True)
class Demand:
    """What a workload asks of the model: prompt tokens to compute, and decode steps as
    (batch size, number of steps) pairs."""

    unique_prompt_tokens: int
    decode_steps: tuple[tuple[int, int], ...]
    #: query-key pairs attention multiplies: each computed prompt token with the keys up to
    #: its own, each decoded token with its context (see `attention_keys`); 0: not counted
    attention_keys: int = 0
    #: the prompt tokens' share of `attention_keys` (see `prompt_attention_keys`)
    prompt_attention_keys: int = 0
    #: each decode step's attention as (batch, cached tokens read, query-key pairs), in the
    #: order of `decode_steps` (see `decode_attention`); empty: the floor leaves attention out
    step_attention: tuple[tuple[int, int, int], ...] = ()

    @property
    def total_steps(self) -> int:
        return sum(steps for _, steps in self.decode_steps)

    @property
    def decode_tokens(self) -> int:
        return sum(batch * steps for batch, steps in self.decode_steps)

    def describe(self) -> str:
        steps = " + ".join(f"{n} steps at batch {b}" for b, n in self.decode_steps) or "none"
        return f"{self.unique_prompt_tokens} unique prompt tokens, decode {steps}"


@dataclass(frozen=True)
class Rates:
    """This machine's measured rates for one model shape, dtype and thread count."""

    shape: ModelShape
    dtype: str
    threads: int
    device: str
    prefill_gflops: float
    #: seconds per decode step, by batch size
    step_seconds: dict[int, float] = field(default_factory=dict)
    #: memory read bandwidth, GB/s (nan: not measured; the floor then counts FLOPs alone)
    read_gbps: float = math.nan
    #: bytes the device's caches hold (what a step could find there from the step before:
    #: the floor's reads leave it out)
    cache_bytes: int = 0
    #: radixlm's own float32 products (`kernels.cpu.f32_panel_linear`) on the same shapes,
    #: GFLOP/s (nan: not measured); the floor takes the faster of them and torch's
    panel_gflops: float = math.nan

    @property
    def floor_gflops(self) -> float:
        """The rate the floor counts FLOPs at: the fastest products measured here."""
        return max(
            self.prefill_gflops, self.panel_gflops if math.isfinite(self.panel_gflops) else 0
        )

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prefill_gflops * 1e9 / self.shape.flops_per_prompt_token

    def step_time(self, batch: int) -> float:
        """The measured step time at `batch` (KeyError naming the batch when it was not
        probed)."""
        if batch not in self.step_seconds:
            raise KeyError(f"no decode step probed at batch {batch}")
        return self.step_seconds[batch]

    def limit_seconds(self, demand: Demand) -> float:
        """The workload's time if every counted matmul ran at the measured rates."""
        prefill = demand.unique_prompt_tokens / self.prompt_tokens_per_s
        return prefill + sum(steps * self.step_time(b) for b, steps in demand.decode_steps)

    def floor_seconds(self, demand: Demand) -> float:
        """A lower bound on the workload's time for any system whose products run at no more
        than the fastest measured rate (`floor_gflops`) and whose reads at no more than the
        measured bandwidth: its unique prompt tokens' FLOPs at the rate, and each decode step
        at batch B the longer of B decoded tokens' FLOPs (their lm_head rows included) at the
        rate and one read of every weight (projections and lm_head, far more than the caches
        hold in the shapes benchmarked; less what they hold) at the bandwidth.

        With the demand's attention (`Demand.step_attention`), attention is in it too: the
        prompt tokens' query-key pairs at the rate, and in each step its pairs' FLOPs beside
        the products' and its reads of the cached keys and values (each distinct cached
        token once: a prefix the step's sequences share is read once) beside the weights',
        less what the caches could keep between steps (`cache_bytes`)."""
        shape, rate = self.shape, self.floor_gflops * 1e9
        floor = demand.unique_prompt_tokens * shape.flops_per_prompt_token / rate
        weights = shape.weight_bytes(self.dtype)
        bandwidth = self.read_gbps * 1e9 if math.isfinite(self.read_gbps) else math.inf
        if demand.step_attention:
            floor += demand.prompt_attention_keys * shape.flops_per_key / rate
            kv = shape.kv_bytes_per_token(self.dtype)
            for batch, keys, pairs in demand.step_attention:
                compute = (
                    batch * shape.flops_per_decode_token + pairs * shape.flops_per_key
                ) / rate
                read = max(weights + keys * kv - self.cache_bytes, 0) / bandwidth
                floor += max(compute, read)
            return floor
        read = max(weights - self.cache_bytes, 0) / bandwidth
        for batch, steps in demand.decode_steps:
            floor += steps * max(batch * shape.flops_per_decode_token / rate, read)
        return floor

    def attention_seconds(self, demand: Demand) -> float:
        """The workload's attention FLOPs (scores and values: 4 x heads x head_dim per
        query-key pair and layer) at the measured rate: time the limit leaves out."""
        return demand.attention_keys * self.shape.flops_per_key / (self.prefill_gflops * 1e9)

    def describe(self) -> str:
        steps = ", ".join(
            f"batch {b}: {t * 1000:.1f} ms" for b, t in sorted(self.step_seconds.items())
        )
        read = f"; read {self.read_gbps:.1f} GB/s" if math.isfinite(self.read_gbps) else ""
        if math.isfinite(self.panel_gflops):
            read += f"; radixlm's float32 panels {self.panel_gflops:.1f} GFLOP/s"
        if self.cache_bytes:
            read += f"; caches {self.cache_bytes / 2**20:.0f} MB"
        return (
            f"{self.dtype}, {self.threads} thread(s) on {self.device}: projections "
            f"{self.prefill_gflops:.1f} GFLOP/s = {self.prompt_tokens_per_s:.1f} prompt tok/s; "
            f"decode step {steps}{read}"
        )


Calls = Iterable[tuple[Sequence[int], Sequence[Sequence[int]]]]


def _sequences(calls: Calls) -> Iterator[tuple[Sequence[int], Sequence[int], int]]:
    """(prompt, output, first prompt position it computes) for each sequence of `calls`:
    (prompt, outputs) in the order sent, each output one sequence (no outputs: the prompt
    once); what a sequence computed (its prompt and all but its last output token) can be
    reused by later ones, and its last prompt token is always computed."""
    trie: dict[int, Any] = {}
    for prompt, outputs in calls:
        for output in outputs or [()]:
            node, shared = trie, 0
            for token in prompt:
                if token not in node:
                    break
                node, shared = node[token], shared + 1
            yield prompt, output, min(shared, max(len(prompt) - 1, 0))
            node = trie
            for token in [*prompt, *list(output)[:-1]]:
                node = node.setdefault(token, {})


def unique_prompt_tokens(calls: Calls) -> int:
    """Prompt tokens that no earlier sequence computed (see `_sequences`)."""
    return sum(len(prompt) - first for prompt, _output, first in _sequences(calls))


def attention_keys(calls: Calls) -> int:
    """The query-key pairs attention multiplies for `calls` (as `unique_prompt_tokens` takes
    them): each prompt token a sequence computes, at position p, with p + 1 keys; each decoded
    token with the keys of its context (an output's first token comes from the prefill, each
    later one from a step over the prompt and the tokens before it)."""
    pairs = 0
    for prompt, output, first in _sequences(calls):
        pairs += sum(range(first + 1, len(prompt) + 1))
        pairs += sum(len(prompt) + k for k in range(1, len(output)))
    return pairs


def prompt_attention_keys(calls: Calls) -> int:
    """The prompt tokens' share of `attention_keys`: each computed prompt token at position p
    with p + 1 keys."""
    return sum(sum(range(first + 1, len(prompt) + 1)) for prompt, _, first in _sequences(calls))


def decode_attention(
    batch: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> list[tuple[int, int, int]]:
    """The decode steps of (prompt, output) sequences decoding together, as (batch, cached
    tokens read, query-key pairs) per step: output token k (k >= 1; the first comes from the
    prefill) is decoded over the prompt and the k tokens before it, and reads the keys and
    values of all but the last, the one it writes; sequences that begin alike read their
    common tokens once (a cached prefix shared in a radix cache). A sequence whose output
    is done leaves the batch."""
    trie: dict[int, Any] = {}
    cached = 0  # distinct tokens in the trie

    def extend(node: dict[int, Any], token: int) -> dict[int, Any]:
        nonlocal cached
        if token not in node:
            node[token] = {}
            cached += 1
        return node[token]

    ends: list[dict[int, Any]] = []
    for prompt, _ in batch:
        node = trie
        for token in prompt:
            node = extend(node, token)
        ends.append(node)
    steps = []
    for k in range(1, max((len(output) for _, output in batch), default=0)):
        live = [i for i, (_, output) in enumerate(batch) if k < len(output)]
        pairs = sum(len(batch[i][0]) + k for i in live)
        steps.append((len(live), cached, pairs))
        for i in live:  # the token decoded at this step is cached for the next
            ends[i] = extend(ends[i], batch[i][1][k - 1])
    return steps


def serve_demand(prompts: Sequence[Sequence[int]], output_len: int, concurrency: int) -> Demand:
    """A serving run's demand: `prompts` (token ids, in order) sent at most `concurrency` at a
    time, each answered with `output_len` tokens. The first token of each answer comes from its
    prefill; the rest from decode steps of the requests in flight together, taken as waves of
    `concurrency` requests."""
    n = len(prompts)
    width = max(1, min(concurrency or n, n)) if n else 1
    # the outputs' tokens: -1 - i for the i-th (no prompt's token; the same in every output,
    # so that outputs of one prompt count as one: a lower bound on the keys read)
    output = [-1 - i for i in range(output_len)]
    answered = [(p, [output]) for p in prompts]
    waves = [[(p, output) for p in prompts[start : start + width]] for start in range(0, n, width)]
    steps: dict[int, int] = {}
    for wave in waves:
        steps[len(wave)] = steps.get(len(wave), 0) + max(output_len - 1, 0)
    decode = tuple((b, s) for b, s in steps.items() if s)
    return Demand(unique_prompt_tokens([(p, []) for p in prompts]), decode,
                  attention_keys(answered), prompt_attention_keys(answered),
                  tuple(step for wave in waves for step in decode_attention(wave)))  # fmt: skip


def share(limit: float, measured: float) -> float:
    """The measured time's share of the limit (limit / measured: 1.0 = at the limit)."""
    return limit / measured if measured > 0 and math.isfinite(measured) else float("nan")


# ------------------------------------------------------------------------------ the probe


def probe(
    shape: ModelShape,
    dtype: str = "float32",
    threads: int = 0,
    batches: Iterable[int] = (8,),
    device: str = "cpu",
    prefill_tokens: int = 512,
    repeats: int = 5,
    read_megabytes: int = 512,
) -> Rates:
    """Measures the rates (see the module docstring). `threads` > 0 sets torch's thread count
    for the probe (and leaves it set); 0 keeps torch's current one."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    dev = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device=dev, dtype=torch_dtype) * 0.02

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    linear = torch.nn.functional.linear
    shapes = shape.layer_weights()
    with torch.inference_mode():
        layer = [randn(o, i) for o, i in shapes]
        inputs = {i: randn(prefill_tokens, i) for _, i in shapes}
        best = math.inf
        for _ in range(repeats + 1):  # the first one warms up
            sync()
            start = time.perf_counter()
            for weight in layer:
                linear(inputs[weight.shape[1]], weight)
            sync()
            best = min(best, time.perf_counter() - start)
        flops = 2.0 * prefill_tokens * sum(o * i for o, i in shapes)
        gflops = flops / best / 1e9
        panels = (
            panel_gflops(layer, inputs, prefill_tokens, repeats)
            if dtype == "float32" and device == "cpu"
            else math.nan
        )
        del layer, inputs
        weights = [[randn(o, i) for o, i in shapes] for _ in range(shape.layers)]
        lm_head = randn(shape.vocab, shape.hidden)
        step_seconds: dict[int, float] = {}
        for batch in sorted(set(batches)):
            xs = {i: randn(batch, i) for _, i in shapes}
            step = math.inf
            for _ in range(repeats + 1):
                sync()
                start = time.perf_counter()
                for layer_weights in weights:
                    for weight in layer_weights:
                        linear(xs[weight.shape[1]], weight)
                linear(xs[shape.hidden], lm_head)
                sync()
                step = min(step, time.perf_counter() - start)
            step_seconds[batch] = step
        del weights, lm_head
    read = read_bandwidth_gbs(device, read_megabytes, repeats)
    threads = torch.get_num_threads()
    return Rates(
        shape, dtype, threads, device, gflops, step_seconds, read, cache_bytes(dev), panels
    )


def panel_gflops(layer: Sequence[Any], inputs: dict[int, Any], rows: int, repeats: int) -> float:
    """GFLOP/s of radixlm's float32 panel products (what its CPU path multiplies a float32
    model's prefill with) on one layer's weights, as the probe times torch's; nan where the
    kernels are not built here."""
    try:
        from radixlm.kernels import cpu
    except ImportError:
        return math.nan
    if not cpu.available():
        return math.nan
    packed = [
        (cpu.pack_f32_panels(weight), weight.shape[0], inputs[weight.shape[1]]) for weight in layer
    ]
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for panels, n, x in packed:
            cpu.f32_panel_linear(x, panels, n)
        best = min(best, time.perf_counter() - start)
    return 2.0 * rows * sum(w.shape[0] * w.shape[1] for w in layer) / best / 1e9


def cache_bytes(device: Any) -> int:
    """What the caches of `device` (a torch.device) hold: on a CPU every data or unified cache
    of every core, a shared one once (Linux's sysfs; 0 where it says nothing); on a GPU its
    L2."""
    if device.type == "cuda":
        import torch

        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    caches: dict[tuple[str, str], int] = {}
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            key = (
                (index / "level").read_text().strip(),
                (index / "shared_cpu_list").read_text().strip(),
            )
        except OSError:
            continue
        if kind != "Instruction" and size:
            caches[key] = int(size.rstrip("KMG")) * units.get(size[-1], 1)
    return sum(caches.values())


def compute_dtype(model_dir: Path, asked: str = "auto", device: str = "cpu") -> str:
    """The dtype radixlm computes `model_dir` in when started with `--dtype asked` (its own
    rule: a bfloat16 checkpoint runs in float32 on CPUs without fast bfloat16 matmuls)."""
    import torch

    from radixlm.runtime.loader import choose_dtype

    config = json.loads((model_dir / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype")
    chosen, _ = choose_dtype(asked, stored, torch.device(device))
    return str(chosen).removeprefix("torch.")


def parse_steps(text: str) -> tuple[tuple[int, int], ...]:
    """'8:31,4:31' -> ((8, 31), (4, 31)): decode steps as batch:steps pairs."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, sep, steps = part.partition(":")
        if not sep:
            raise ValueError(f"decode steps {part!r}: write BATCH:STEPS, e.g. 8:31")
        out.append((int(batch), int(steps)))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", type=Path, help="a model directory (its config.json)")
    parser.add_argument("--config", help="a config.json file instead of --model-path")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto: "
                        "what radixlm computes the checkpoint in here")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, action="append", help="decode batch sizes (8)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, help="unique prompt tokens of a workload")
    parser.add_argument("--decode-steps", default="", help="BATCH:STEPS,... e.g. 8:31,8:31")
    parser.add_argument("--json", help="write the rates (and the limit) here")
    args = parser.parse_args(argv)
    if args.config:
        config = json.loads(Path(args.config).read_text())
    elif args.model_path:
        config = json.loads((args.model_path / "config.json").read_text())
    else:
        parser.error("give --model-path or --config")
    dtype = args.dtype
    if dtype == "auto":
        dtype = (
            compute_dtype(args.model_path, "auto", args.device) if args.model_path else "float32"
        )
    batches = args.batch or [8]
    steps = parse_steps(args.decode_steps)
    needed = sorted({*batches, *(b for b, _ in steps)})
    rates = probe(ModelShape.from_config(config), dtype, args.threads, needed, args.device,
                  args.prefill_tokens)  # fmt: skip
    print(rates.describe())
    out: dict[str, Any] = {
        "dtype": rates.dtype, "threads": rates.threads, "device": rates.device,
        "prefill_gflops": rates.prefill_gflops, "prompt_tokens_per_s": rates.prompt_tokens_per_s,
        "step_seconds": rates.step_seconds,
    }  # fmt: skip
    if args.prompt_tokens is not None:
        demand = Demand(args.prompt_tokens, steps)
        out["limit_s"] = rates.limit_seconds(demand)
        print(f"{demand.describe()}: limit {out['limit_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
