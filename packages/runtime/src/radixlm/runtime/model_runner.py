"""ModelRunner: a loaded model, its KV pool and request table, an attention backend, a sampler.

The scheduler drives it one step at a time:

    batch = ForwardBatch.build(entries, runner.req_to_token_pool.req_to_token)
    out = runner.forward(batch)                       # logits of each request's last token
    sampled = runner.sample(out.next_token_logits, SamplingBatch.build(...))

The runner owns no request state: slot allocation (`runner.kv_pool`), request rows
(`runner.req_to_token_pool`) and prefix reuse belong to the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from radixlm import kernels
from radixlm.runtime.attention import AttentionBackend, create_backend
from radixlm.runtime.config import LoraConfig, RunnerConfig
from radixlm.runtime.cpu_decode import CpuDecodePath, MixedStep, NotTaken
from radixlm.runtime.cuda_graph import CudaGraphRunner, cuda_graphs_usable
from radixlm.runtime.distributed import SINGLE, TensorParallel
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.loader import ModelInfo, load_model
from radixlm.runtime.logprobs import TokenLogprob, collect_logprobs
from radixlm.runtime.lora.adapter import LoraAdapter, load_adapter
from radixlm.runtime.lora.manager import LoraManager, pool_shape
from radixlm.runtime.memory import KVPool, ReqToTokenPool, kv_pool_capacity
from radixlm.runtime.models import DecoderForCausalLM
from radixlm.runtime.models.decoder import STACKED_PROJECTIONS
from radixlm.runtime.models.decoder_pooling import DecoderForPooling
from radixlm.runtime.models.linear import PackedWeight, RowLinear, VocabEmbedding
from radixlm.runtime.quant.linear import finalize_quantized, lm_head_source, reopen_lm_head
from radixlm.runtime.sampler import SampleOutput, Sampler
from radixlm.runtime.sampling_batch import SamplingBatch

# Rows of prompt logits turned into logprobs at once (bounds the [rows, vocab] temporaries).
_LOGPROB_CHUNK = 256


logger = logging.getLogger("radixlm.runtime.runner")


@dataclass(frozen=True)
class LogitsOutput:
    """`next_token_logits` [B, vocab] float32: the logits after each request's last new token
    (with the batch's `logit_counts`, after each of that many last new tokens of each request,
    request after request).
    `input_logprobs[b]` holds request b's prompt logprobs when it asked for them (else None).

    With CUDA graphs the logits tensor is the graph's static output: consume (sample) it
    before the next forward."""

    next_token_logits: torch.Tensor
    input_logprobs: list[list[TokenLogprob] | None] | None = None
    #: `hidden_states[b]`: request b's final hidden states [its new tokens, hidden] (float32,
    #: on the CPU) when the batch asked for them (`hidden_state_requests`), else None.
    hidden_states: list[torch.Tensor | None] | None = None
    #: With the runner's `capture` set (EAGLE drafts): per new token, in batch order, its
    #: final hidden state ("final") or the residual stream entering the model's
    #: `capture_layers`, side by side ("aux"); None otherwise.
    captured: torch.Tensor | None = None


@dataclass(frozen=True)
class WeightPart:
    """What a rank holds of a checkpoint tensor: `values` sit at `start` along `dim` of the
    whole tensor, which is `size` long there (the whole of it: start 0, size its length)."""

    values: torch.Tensor
    dim: int
    start: int
    size: int


@dataclass
class RunnerStats:
    """Counters for tests and metrics (mutated by every forward)."""

    forward_calls: int = 0
    tokens_forwarded: int = 0
    graph_replays: int = 0


class ModelRunner:
    """Loads a model and runs forward passes and sampling steps on it."""

    def __init__(
        self,
        config: RunnerConfig,
        model: DecoderForCausalLM | None = None,
        info: ModelInfo | None = None,
        tp: TensorParallel = SINGLE,
        kv_slots: int | None = None,
        req_to_token_pool: ReqToTokenPool | None = None,
        extra_kv_bytes_per_token: int = 0,
    ) -> None:
        """Load the model (or use a given one with its info), size the pools, pick the backend,
        and capture CUDA graphs on CUDA. Under tensor parallelism (`tp`) this is one rank's
        runner: its shard of the weights, its heads' K/V; every rank's runner must run the
        same forwards in the same order (collectives pair them up).

        A speculative draft model's runner takes `kv_slots` (its pool's size, instead of the
        memory budget's) and the target's `req_to_token_pool` (its slots are the target's);
        the target's takes `extra_kv_bytes_per_token` (the draft's K/V per token, which shares
        the budget)."""
        self.config = config
        self.tp = tp
        if model is None or info is None:
            model, info = load_model(config.model, tp)
        self.model = model
        self.info = info
        #: A pooling model: forwards return hidden states, no logits (`radixlm.runtime.pooling`).
        self.pooling = info.pooling
        if self.pooling is not None and config.lora.active:
            raise ValueError("LoRA adapters are not served on pooling models yet; drop them")
        if info.encoder and kv_slots is None:
            # An encoder keeps no K/V: the pool is only the scheduler's token ledger.
            kv_slots = config.memory.max_total_tokens or max(1 << 16, 8 * info.context_length)
        self.device = info.device
        self.dtype = info.dtype
        if info.dtype_reason:
            logger.info("compute dtype %s on %s: %s", info.dtype, info.device, info.dtype_reason)
        if info.quantization is not None:
            logger.info("quantized weights: %s", info.quantization.describe())
        # The adapter pool's buffers are allocated before the KV pool is sized.
        #: The LoRA adapter pool (None: no adapters are served).
        self.lora: LoraManager | None = None
        #: The adapters read at start (rank 0 registers them with the engine core).
        self.initial_adapters: list[LoraAdapter] = []
        if config.lora.active:
            self.lora, self.initial_adapters = build_lora(config.lora, model, info)
        arch = info.arch
        memory = config.memory
        kv_dtype = kv_cache_dtype(memory.kv_cache_dtype, self.dtype)
        # This rank's K/V heads (split across ranks, or one replicated head each).
        kv_heads = arch.num_kv_heads // min(arch.num_kv_heads, tp.size)
        bytes_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * kv_dtype.itemsize
        if kv_slots is None:
            num_slots, _budget = kv_pool_capacity(
                bytes_per_token + extra_kv_bytes_per_token, self.device, memory
            )
            # Slot indices are shared by every rank (the scheduler on rank 0 hands them out).
            num_slots = tp.min_int(num_slots)
        else:
            num_slots = kv_slots
        self.kv_pool = KVPool(
            arch.num_layers,
            num_slots,
            kv_heads,
            arch.head_dim,
            kv_dtype,
            self.device,
            memory.page_size,
        )
        self.context_length = min(info.context_length, self.kv_pool.num_slots)
        if req_to_token_pool is None:
            req_to_token_pool = ReqToTokenPool(
                memory.max_running_requests, self.context_length, self.device
            )
        self.req_to_token_pool = req_to_token_pool
        self.attention: AttentionBackend = create_backend(config.attention.backend, self.kv_pool)
        if self.attention.name == "triton" and kv_dtype != self.dtype:
            raise ValueError(
                f"the triton attention backend needs the KV cache in the model's dtype "
                f"({self.dtype}); set kv_cache_dtype='auto' or use the torch_native backend"
            )
        self.sampler = Sampler(config.sampler)
        self.stats = RunnerStats()
        self.graph_runner: CudaGraphRunner | None = None
        # gloo's collectives cannot be captured in a CUDA graph (NCCL's can); the LoRA path
        # reads per-step segment tensors that a captured graph would not see; the experts of
        # a mixture of experts are grouped with a host read (`moe_align`), which a capture
        # forbids.
        graphs = (
            config.attention.cuda_graph
            and self.pooling is None
            and tp.backend != "gloo"
            and self.lora is None
            and info.arch.moe is None
        )
        if cuda_graphs_usable(self.device, graphs, self.attention):
            sizes = [
                s for s in config.attention.graph_batch_sizes() if s <= memory.max_running_requests
            ]
            if sizes:
                self.graph_runner = CudaGraphRunner(
                    self.model,
                    self.attention,  # type: ignore[arg-type]
                    self.kv_pool,
                    self.req_to_token_pool,
                    sizes,
                )
                self.graph_runner.capture()
        #: What each forward keeps of every new token for an EAGLE draft head: "none",
        #: "final" (its final hidden state) or "aux" (see `LogitsOutput.captured`).
        self.capture = "none"
        #: Decode steps in one C call on the CPU (`radixlm.runtime.cpu_decode`), or None.
        self.cpu_decode: CpuDecodePath | None = None
        self.build_cpu_decode()

    def capture_features(self, mode: str, layers: tuple[int, ...] = ()) -> None:
        """Keep every new token's features in each forward's output (`LogitsOutput.captured`):
        "final" hidden states, or "aux", the inputs of `layers`. Captured steps take neither
        CUDA graphs nor split mixed steps; "aux" also leaves the CPU decode path (its C call
        runs all layers at once)."""
        self.capture = mode
        self.graph_runner = None
        if mode == "aux":
            self.model.model.capture_layers = layers
            if self.cpu_decode is not None:
                logger.info("CPU decode path off: EAGLE-3 reads the hidden states of layers %s",
                            list(layers))  # fmt: skip
            self.cpu_decode = None

    def build_cpu_decode(self) -> None:
        """(Re)build the CPU decode path over the weights' and the KV pool's current tensors
        (it holds their addresses), or leave it off (logging why)."""
        self.cpu_decode = None
        deterministic = self.config.deterministic
        if deterministic and self.device.type != "cpu":
            raise ValueError(
                "enable_deterministic_inference runs on the CPU (radixlm's batch-invariant "
                f"kernels are C kernels); this model is on {self.device}: use device='cpu'"
            )
        if (
            self.device.type != "cpu"
            or self.tp.enabled
            or self.capture == "aux"
            or self.pooling is not None
        ):
            return
        if self.lora is not None:
            logger.info("CPU decode path off: LoRA adapters are served")
            return
        try:
            self.cpu_decode = CpuDecodePath.build(
                self.model, self.kv_pool, deterministic, self.context_length
            )
        except NotTaken as reason:
            if deterministic:
                raise ValueError(
                    f"enable_deterministic_inference needs every step in radixlm's CPU kernels, "
                    f"which cannot take this model: {reason} (they take float32 models with "
                    f"float32, int8 or int4 projections; try dtype='float32')"
                ) from None
            logger.info("CPU decode path off: %s", reason)
            return
        if deterministic:
            logger.info("deterministic inference: every step runs in the batch-invariant C kernels")
            return
        logger.info("CPU decode path on: decode steps of up to %d requests run in one C call",
                    kernels.cpu.MAX_ROWS)  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self.info.arch.vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (parameters, packed copies and quantized buffers)."""
        seen: set[int] = set()
        total = 0
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        for module in self.model.modules():
            packing = getattr(module, "packing", None) or getattr(module, "head_packing", None)
            for copy in (getattr(packing, "packed", None), getattr(packing, "panels", None)):
                if isinstance(copy, torch.Tensor):
                    tensors.append(copy)
        for tensor in tensors:
            if id(tensor) not in seen and not tensor.is_meta:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
        return total

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Run the model over the batch's new tokens (their K/V go to the pool).

        Mutates the KV pool and the request table (the new tokens' slots).
        """
        self.stats.forward_calls += 1
        self.stats.tokens_forwarded += batch.num_tokens
        batch.write_req_to_token()
        if self.pooling is not None:
            return self._forward_pooling(batch)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            self.stats.graph_replays += 1
            return LogitsOutput(self.graph_runner.replay(batch))
        if self.cpu_decode is not None and self.cpu_decode.can_run(batch):
            hidden = self.cpu_decode.forward(batch)
        elif (
            self.cpu_decode is not None
            and self.capture == "none"
            and (mixed := self.cpu_decode.split(batch))
        ):
            return self._forward_mixed(batch, self.cpu_decode, mixed)
        else:
            self.attention.prepare(batch)
            hidden = self.model(
                batch.input_ids,
                batch.model_positions,
                self.attention,
                batch.input_embeds,
                batch.input_embeds_rows,
            )
        head = self._head
        wanted = batch.logit_rows()
        if wanted is not None:  # several rows of some requests (they verify drafts)
            logits = head(hidden.index_select(0, wanted))
        elif batch.num_tokens == batch.batch_size:  # one token per request: every row is last
            logits = head(hidden)
        else:
            last = torch.cumsum(batch.extend_lens, 0) - 1
            logits = head(hidden.index_select(0, last))
        input_logprobs = self._input_logprobs(hidden, batch) if batch.input_logprobs else None
        hidden_states = self._hidden_states(hidden, batch) if batch.hidden_state_requests else None
        captured = None
        if self.capture == "final":
            captured = hidden
        elif self.capture == "aux":
            captured = torch.cat(self.model.model.captured, dim=-1)
            self.model.model.captured = []
        return LogitsOutput(logits, input_logprobs, hidden_states, captured)

    def _forward_pooling(self, batch: ForwardBatch) -> LogitsOutput:
        """A pooling model's step: the new tokens' final hidden states, no logits. An encoder
        runs each sequence whole and bidirectionally (its prompt is one chunk, never cached)."""
        if self.info.encoder:
            hidden = self.model(batch.input_ids, batch.extend_lens_cpu, batch.token_type_ids)
        else:
            self.attention.prepare(batch)
            hidden = self.model(batch.input_ids, batch.model_positions, self.attention, None, None)
        empty = hidden.new_empty(batch.batch_size, 0, dtype=torch.float32)
        return LogitsOutput(empty, None, self._hidden_states(hidden, batch))

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """A pooling model's head over pooled rows [B, hidden] -> float32 [B, outputs] (the
        rows themselves for an embedder)."""
        model: Any = self.model
        with torch.inference_mode():
            if self.info.encoder:
                if not model.has_head:
                    return pooled.float()
                return model.head(pooled.to(self.device, self.dtype)).float()  # type: ignore[no-any-return]
            if not isinstance(model, DecoderForPooling):  # a causal LM served as an embedder
                return pooled.float()
            return model.pool_head(pooled.to(self.device))

    def _forward_mixed(
        self, batch: ForwardBatch, path: CpuDecodePath, step: MixedStep
    ) -> LogitsOutput:
        """A mixed step on the CPU decode path: its decodes through the path, the prefill
        chunks through the model's forward (requests never attend to each other's tokens, so
        the two parts are what the whole step computes), then one LM head over every
        request's last row (every row of a decode that verifies drafts), in batch order."""
        rest = step.rest
        self.attention.prepare(rest)
        hidden = self.model(rest.input_ids, rest.model_positions, self.attention, None, None)
        part = path.forward_part(batch, step)
        rest_last = hidden.index_select(0, torch.cumsum(rest.extend_lens, 0) - 1)
        if batch.logit_counts is None:  # every decode adds one token
            last = hidden.new_empty(batch.batch_size, hidden.shape[-1])
            last[step.other_rows] = rest_last
            last[step.rows] = part
            return LogitsOutput(path.logits(last))
        # Decodes that verify drafts want every row; the rest their last one, in batch order.
        pieces: list[torch.Tensor] = []
        taken = set(step.rows.tolist())
        at_part = at_rest = 0
        for index, length in enumerate(batch.extend_lens_cpu):
            if index in taken:
                pieces.append(part[at_part : at_part + length])
                at_part += length
            else:
                pieces.append(rest_last[at_rest : at_rest + 1])
                at_rest += 1
        return LogitsOutput(path.logits(torch.cat(pieces)))

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of these final hidden rows (the CPU decode path's head when it runs)."""
        if self.cpu_decode is None:
            return self.model.compute_logits(hidden)
        return self.cpu_decode.logits(hidden)

    @staticmethod
    def _hidden_states(hidden: torch.Tensor, batch: ForwardBatch) -> list[torch.Tensor | None]:
        """The rows of the requests that asked, copied to the CPU (the others cost nothing)."""
        result: list[torch.Tensor | None] = [None] * batch.batch_size
        starts = [0]
        for length in batch.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + length)
        for index in batch.hidden_state_requests:
            rows = hidden[starts[index] : starts[index] + batch.extend_lens_cpu[index]]
            result[index] = rows.float().cpu()
        return result

    def _input_logprobs(
        self, hidden: torch.Tensor, batch: ForwardBatch
    ) -> list[list[TokenLogprob] | None]:
        result: list[list[TokenLogprob] | None] = [None] * batch.batch_size
        starts = [0]
        for length in batch.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + length)
        for request in batch.input_logprobs:
            first = starts[request.batch_index] + request.start
            scored: list[TokenLogprob] = []
            for offset in range(0, len(request.targets), _LOGPROB_CHUNK):
                targets = request.targets[offset : offset + _LOGPROB_CHUNK]
                rows = hidden[first + offset : first + offset + len(targets)]
                path = self.cpu_decode
                logits = (
                    path.logits(rows)
                    if path is not None and path.deterministic
                    else self.model.compute_logits(rows)
                )
                logprobs = torch.log_softmax(logits, dim=-1)
                scored.extend(
                    collect_logprobs(
                        logprobs,
                        torch.tensor(targets, device=logprobs.device),
                        [request.top_logprobs_num] * len(targets),
                        [request.token_ids] * len(targets),
                    )
                )
            result[request.batch_index] = scored
        return result

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SampleOutput:
        """Next tokens (and logprobs) of each row of `logits` under `sampling`."""
        return self.sampler(logits, sampling)

    def step(
        self, batch: ForwardBatch, sampling: SamplingBatch
    ) -> tuple[SampleOutput, LogitsOutput]:
        """forward + sample in one call."""
        out = self.forward(batch)
        return self.sample(out.next_token_logits, sampling), out

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Replace weights in place from (HF name, tensor) pairs (e.g. another model's; a
        tensor or a lazy checkpoint slice, of which each layer reads this rank's shard under
        tensor parallelism); returns the names taken. A model quantized at load time
        quantizes the new weights as the loader did (its LM head's int8 copy too). Raises
        ValueError on an unknown name or a shape mismatch: the tensors before it were
        replaced already, and the model runs on what it holds then."""
        quantized = self.info.quantization is not None
        head = lm_head_source(self.model) if quantized else None
        new_head = False

        def converted() -> Iterator[tuple[str, Any]]:
            nonlocal new_head
            for name, tensor in weights:
                if name == head and not new_head:
                    reopen_lm_head(self.model)
                    new_head = True
                if isinstance(tensor, torch.Tensor):
                    tensor = tensor.to(device=self.device, dtype=self.dtype)
                yield name, tensor

        try:
            with torch.no_grad():
                loaded = self.model.load_weights(converted())
        finally:
            if quantized:
                # The layers whose rows changed build their matmul again; the LM head's
                # int8 copy is made again when its weight changed.
                finalize_quantized(self.model)
                if new_head and self.graph_runner is not None:
                    self.graph_runner.capture()  # the graphs read the earlier head's buffers
            self.build_cpu_decode()  # the layers may hold new tensors
        return loaded

    def checkpoint_names(self) -> set[str]:
        """The checkpoint (HF) names of every tensor the model needs."""
        return set(self.model.checkpoint_names())

    def weight(self, name: str) -> torch.Tensor:
        """A weight by its checkpoint (HF) name as the model holds it now (this rank's shard
        under tensor parallelism): a parameter, or a stacked projection's own rows (`q_proj`
        of `qkv_proj`). KeyError when there is none."""
        return self.weight_part(name).values

    def weight_part(self, name: str) -> WeightPart:
        """`weight(name)` with where it sits in the checkpoint's tensor: this rank's rows of a
        column-parallel projection or of the vocabulary, its input columns of a row-parallel
        one, or the whole tensor. KeyError when there is none."""
        params = dict(self.model.named_parameters())
        prefix, _, leaf = name.rpartition(".")
        wrapped = f"{prefix}.base.{leaf}"  # a layer a LoRA wrapper holds
        if name not in params and wrapped in params:
            name, prefix = wrapped, f"{prefix}.base"
        if name in params:
            owner = self.model.get_submodule(prefix) if prefix else self.model
            values = self._held(owner, params[name].detach())
            if isinstance(owner, VocabEmbedding):
                rows = owner.vocab_end - owner.vocab_start
                return WeightPart(values[:rows], 0, owner.vocab_start, owner.vocab_size)
            if isinstance(owner, RowLinear) and leaf == "weight":
                part = owner.input_part
                return WeightPart(values, 1, part.start, part.size)
            return WeightPart(values, 0, 0, values.shape[0] if values.dim() else 1)
        module_path, _, module_name = prefix.rpartition(".")
        if module_name in STACKED_PROJECTIONS:
            merged, shard = STACKED_PROJECTIONS[module_name]
            try:
                module = self.model.get_submodule(f"{module_path}.{merged}")
            except AttributeError:
                raise KeyError(name) from None
            module = getattr(module, "base", module)  # (a LoRA wrapper's layer)
            ranges = getattr(module, "shard_ranges", {})
            tensor = getattr(module, leaf, None)
            if shard in ranges and isinstance(tensor, torch.Tensor):
                tensor = self._held(module, tensor.detach()) if leaf == "weight" else tensor
                start, end = ranges[shard]
                piece = getattr(module, "parts", {}).get(shard)
                where = (piece.start, piece.size) if piece is not None else (0, end - start)
                return WeightPart(tensor.detach()[start:end], 0, *where)
        raise KeyError(name)

    def _held(self, owner: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, or its oneDNN-packed copy or panels read back when the plain one was
        released."""
        if tensor.numel():
            return tensor
        packing = self.model.head_packing if owner is self.model.head else None
        packing = packing or getattr(owner, "packing", None)
        if isinstance(packing, PackedWeight) and (plain := packing.plain()) is not None:
            return plain
        packed = getattr(packing, "packed", None)
        return packed.to_dense() if isinstance(packed, torch.Tensor) else tensor

    def reset(self) -> None:
        """Free every KV slot and request row (the engine's flush_cache)."""
        self.kv_pool.reset()
        self.req_to_token_pool.reset()


_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def build_lora(
    config: LoraConfig, model: torch.nn.Module, info: ModelInfo
) -> tuple[LoraManager, list[LoraAdapter]]:
    """Read the start-up adapters, size the pool after them and wrap the model's layers."""
    if info.quantization is not None:
        raise ValueError("LoRA adapters cannot be served over quantized weights yet")
    initial = [load_adapter(name, path, info.arch) for name, path in config.paths]
    shape = pool_shape(initial, config.max_loras_per_batch, config.max_rank, config.target_modules)
    for adapter in initial:
        shape.check(adapter)
    return LoraManager(model, info.arch, shape, info.dtype, info.device), initial


def kv_cache_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for the `kv_cache_dtype` setting `name` (auto: `compute`)."""
    return compute if name == "auto" else _KV_DTYPES[name]
