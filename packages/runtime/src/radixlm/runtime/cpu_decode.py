"""The CPU decode path: a decode step of a Llama-like model in one C call.

A small model's decode step on the CPU costs more in Python and operator
dispatch (about 60 torch operations per decoder layer around the four projections) than in
the projections themselves. A step of at most `MAX_BATCH` requests that each add one token
runs every decoder layer through `radixlm.kernels.cpu.decode.DecodeLayers` (one call per
`DecodeLayers.max_rows` requests: 64 when every projection is float32, else
`kernels.cpu.MAX_ROWS`), and so does any step of at most `MAX_BATCH` new tokens (drafts
to verify, a short prefill chunk or a jump-forward extend beside the decodes: each token a
row of its own), when the model and its KV pool are float32 and every projection is

- int4 or int8 in the layouts of `radixlm.kernels.cpu` (load-time `int8`/`int4`
  quantization, or a GGUF file's Q4_0/Q4_1/Q4_K and Q8_0 tensors): the same products as the
  per-layer path (activations rounded to int8 per 32 columns);
- or plain float32: those layers then hold
  their weights in panels instead of packing them for oneDNN (`PackedWeight.use_panels`: the
  plain weight released), and the path takes every step, prefills and mixed steps too, in
  calls of up to `kernels.cpu.PANELS_MAX_ROWS` tokens: the panel products take any number of
  rows at full speed, so a mixed step reads the weights once for its decodes and its prefill
  chunks together, and a prefill skips the ~60 torch operations per layer as a decode does.

The norms, rotary embedding, K/V writes and attention run in C too (on AVX-512 a prefill
chunk's rows attend with the query vectors across the lanes, and requests that share a
cached prefix, as the radix cache shares its slots, read the shared keys once for all of
them: see `radixlm.kernels.cpu.decode`); the embedding lookup and the final norm stay in
torch. A float32 LM head multiplies in C as well,
every step's rows (`logits`), from its weight in panels (`kernels.cpu.pack_f32_panels`, laid
out when the path is built, so again after weights are loaded; the head's packing holds them,
so `compute_logits` reads them too): memory-bound at a few rows, the product then streams the
weight in the order it lies and needs no horizontal sums, which at a small hidden size cost
as much as the products. An untied head's plain weight is released; a tied head's is the
embedding table, which stays beside the panels, as oneDNN's packed copy did.

The model runner builds it once after loading (`CpuDecodePath.build`, which says why not when
it cannot) and uses it for the steps `can_run` accepts; everything else takes the model's own
forward. `RADIXLM_CPU_KERNELS=0` turns it off with the other C kernels.

Built `deterministic` (batch-invariant inference), the path takes every step, prefills too,
at any number of torch threads, in calls of `DecodeLayers.max_rows` token rows, and so does
the LM head: each C product gives a row the same bits whatever the call's other rows
(`gemv.c`), attention reads a row's keys in one order, norms and SiLU are per row, and the
rotary angles come from a table by position, computed once (so that no elementwise kernel's
split into vector and remainder loops, which follows the step's size and threads, can touch
them: torch 2.13's cos here gives the same bits either way, other builds need not). A
request's K/V, logits and so its tokens are then the same alone or in any batch, in any
chunk of a prefill, computed now or taken from the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixlm import kernels
from radixlm.kernels.cpu.decode import (
    DecodeLayers,
    DecoderLayerWeights,
    DecoderShape,
    LinearWeights,
)
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory import KVPool
from radixlm.runtime.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP
from radixlm.runtime.models.linear import MergedColumnLinear, PackedWeight, RowLinear
from radixlm.runtime.quant.gguf_linear import GGUFLinear
from radixlm.runtime.quant.linear import Int8GroupedHead, QuantizedLinear

logger = logging.getLogger(__name__)

#: Decode steps of up to this many requests take the path (in calls of DecodeLayers.max_rows).
MAX_BATCH = 64


class NotTaken(Exception):
    """Why the CPU decode path does not take this model."""


def _bias(module: object) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        raise NotTaken("a projection's bias is not float32")
    tensor: torch.Tensor = bias.data.contiguous()
    return tensor


def _float_projection(module: MergedColumnLinear | RowLinear, what: str) -> LinearWeights:
    """A float32 projection's weight as the C product reads it (a layer that would pack it
    for oneDNN at its first call multiplies the plain weight from now on)."""
    if module.weight.dtype != torch.float32:
        raise NotTaken(f"{what} is {module.weight.dtype}, not float32")
    packing = getattr(module, "packing", None)
    if isinstance(packing, PackedWeight):
        # Held in panels from now on (prefills multiply them too), the plain weight released.
        panels = packing.use_panels(module.weight)
        if panels is None:
            raise NotTaken(f"{what}'s weight was packed for oneDNN already")
        rows = module.out_features
        return LinearWeights("float32_panels", panels, bias=_bias(module), rows=rows)
    return LinearWeights("float32", module.weight.data.contiguous(), bias=_bias(module))


def _projection(module: object, what: str) -> LinearWeights:
    """The C layout of one projection, or NotTaken."""
    if isinstance(module, (MergedColumnLinear, RowLinear)):
        return _float_projection(module, what)
    if isinstance(module, GGUFLinear):
        operands = module.cpu_int8_operands()
        if operands is not None:
            values, scales = operands
            return LinearWeights("int8", values, scales, bias=_bias(module))
    if not isinstance(module, QuantizedLinear) or module.qweight.numel() == 0:
        raise NotTaken(f"{what} is not an int4 or int8 layer")
    quant = module.quant
    if quant.format == "int4" and module.padded_in == module.in_features:
        return LinearWeights(
            "int4",
            module.qweight.contiguous(),
            module.scales.to(torch.float32).contiguous(),
            module.zeros.to(torch.float32).contiguous(),
            module.group_size,
            _bias(module),
        )
    if quant.format == "int8" and not quant.activations_int8:
        return LinearWeights(
            "int8", module.qweight.contiguous(), module.scale.to(torch.float32).contiguous(),
            bias=_bias(module),
        )  # fmt: skip
    raise NotTaken(f"{what} is {quant.format} in a layout the C kernels do not take")


def _float_head(model: DecoderForCausalLM) -> torch.Tensor | None:
    """The LM head's float32 weight in panels for the C product, or None: a quantized head,
    a bf16 one, or a weight oneDNN packed (and released) already. The head's packing holds
    the panels when it has one (an untied head's plain weight is released; a tied one's is
    the embedding table, which stays), so that `compute_logits` reads them too; else they
    are a copy of the weight."""
    if model.quantized_head is not None:
        return None
    weight = model.lm_head_weight.data
    packing = model.head_packing
    if packing is not None and packing.panels is not None:
        return packing.panels  # (a path built again over the same weights)
    if weight.dtype != torch.float32 or weight.numel() == 0 or not weight.is_contiguous():
        return None
    if packing is None:
        return kernels.cpu.pack_f32_panels(weight)
    return packing.use_panels(model.head.weight)


def _invariant_head(
    model: DecoderForCausalLM,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """The LM head as a product whose bits per row do not depend on the call's other rows
    (deterministic inference), and the most rows a call takes; or NotTaken."""
    head = model.quantized_head
    if head is None:
        panels = _float_head(model)
        if panels is None:
            raise NotTaken("the LM head is neither float32 nor int8 in groups of 32 columns")
        vocab = model.head.per_rank
        product = lambda rows: kernels.cpu.f32_panel_linear(rows, panels, vocab)  # noqa: E731
        return product, kernels.cpu.F32_MAX_ROWS
    if not isinstance(head, Int8GroupedHead) or head.in_features % kernels.cpu.BLOCK:
        raise NotTaken("the LM head is neither float32 nor int8 in groups of 32 columns")
    values, scales = head.qweight.contiguous(), head.scales.to(torch.float32).contiguous()
    return (lambda rows: kernels.cpu.int8_linear(rows, values, scales)), kernels.cpu.MAX_ROWS


def _streamed(weights: list[DecoderLayerWeights], head: nn.Module | None) -> list[torch.Tensor]:
    """The tensors a decode step reads whole, every step: the projections' quantized weights
    and scales or float32 panels, and a quantized LM head's (the module's own tensor
    objects, so that moving them moves what the per-layer forward reads too). A plain
    float32 weight is a `.data` alias of its parameter, which stays where it is."""
    tensors = []
    for layer in weights:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if linear.kind != "float32":
                tensors += [
                    t for t in (linear.weight, linear.scales, linear.zeros) if t is not None
                ]
    if isinstance(head, Int8GroupedHead):
        tensors += [head.qweight, head.scales]
    return tensors


def _layer(layer: nn.Module, index: int, pool: KVPool) -> DecoderLayerWeights:
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, DecoderMLP):
        raise NotTaken(f"layer {index} is not a dense decoder layer (mixture of experts?)")
    attention = layer.self_attn
    q_norm = attention.q_norm.weight.data if attention.q_norm is not None else None
    k_norm = attention.k_norm.weight.data if attention.k_norm is not None else None
    what = f"layer {index}"
    return DecoderLayerWeights(
        input_norm=layer.input_layernorm.weight.data,
        post_norm=layer.post_attention_layernorm.weight.data,
        qkv=_projection(attention.qkv_proj, f"{what}'s q/k/v projection"),
        o=_projection(attention.o_proj, f"{what}'s output projection"),
        gate_up=_projection(layer.mlp.gate_up_proj, f"{what}'s gate/up projection"),
        down=_projection(layer.mlp.down_proj, f"{what}'s down projection"),
        k_pool=pool.k_buffers[index],
        v_pool=pool.v_buffers[index],
        q_norm=q_norm,
        k_norm=k_norm,
        window=attention.spec.sliding_window,
    )


class CpuDecodePath:
    """Decode steps of `model` through `DecodeLayers` (see the module docstring)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        layers: DecodeLayers,
        max_batch: int = MAX_BATCH,
        head: torch.Tensor | None = None,
        invariant: Invariant | None = None,
    ) -> None:
        self.model = model
        self.layers = layers
        #: The most requests a step may have to take this path (in calls of `layers.max_rows`).
        self.max_batch = max_batch
        #: The LM head's float32 weight in panels for the C product, or None.
        self.head = head
        self.vocab = model.head.per_rank  # (the whole vocabulary: no tensor parallelism)
        #: Deterministic inference: the path takes every step (see the module docstring).
        self.invariant = invariant

    @property
    def deterministic(self) -> bool:
        return self.invariant is not None

    @classmethod
    def build(
        cls, model: nn.Module, pool: KVPool, deterministic: bool = False, max_positions: int = 0
    ) -> CpuDecodePath:
        """The path for this model and pool; raises NotTaken saying why it cannot run.
        `deterministic` builds it for batch-invariant inference (every step, rotary angles of
        positions below `max_positions` from a table)."""
        if pool.device.type != "cpu":
            raise NotTaken("the model is not on the CPU")
        if not kernels.cpu.available():
            raise NotTaken("radixlm's CPU kernels are not built here (or are turned off)")
        if type(model) is not DecoderForCausalLM:
            raise NotTaken(f"{type(model).__name__} is not a plain decoder")
        if model.tp.enabled:
            raise NotTaken("tensor parallelism")
        if model.dtype != torch.float32 or pool.dtype != torch.float32:
            raise NotTaken("the model or its KV cache is not float32")
        arch = model.arch
        weights = [_layer(layer, i, pool) for i, layer in enumerate(model.model.layers)]
        first = model.model.layers[0]
        assert isinstance(first, DecoderLayer)  # (_layer checked every layer)
        spec = first.self_attn.spec
        shape = DecoderShape(
            hidden=arch.hidden_size,
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate=arch.intermediate_size,
            rms_norm_eps=arch.rms_norm_eps,
            scaling=spec.scaling,
        )
        invariant = None
        if deterministic:
            if model.model.capture_layers:
                raise NotTaken("an EAGLE-3 head reads the hidden states of inner layers")
            rotary = model.model.rotary
            positions = torch.arange(max(1, max_positions), device=pool.device)
            cos, sin = rotary.cos_sin(positions, torch.float32)
            head, head_rows = _invariant_head(model)
            count = len(positions)
            invariant = Invariant(head, head_rows, cos.reshape(count, -1), sin.reshape(count, -1))
        # Before DecodeLayers records their addresses: what each step streams from memory.
        moved = kernels.cpu.move_to_huge_pages(_streamed(weights, model.quantized_head))
        try:
            layers = DecodeLayers(shape, weights, invariant=deterministic)
        except ValueError as error:
            raise NotTaken(str(error)) from None
        head_panels = _float_head(model)
        if head_panels is not None:
            moved += kernels.cpu.move_to_huge_pages([head_panels])
        if moved:
            logger.info("CPU decode path: %.1f MB of weights on huge pages", moved / 2**20)
        return cls(model, layers, head=head_panels, invariant=invariant)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `compute_logits` of these rows: in C from the head's panels for a
        float32 head on one thread (any number of rows, each row's logits the same bits at
        any count), else the model's own product."""
        rows = hidden.shape[0]
        if self.invariant is not None:  # every row count, in calls of the head's rows
            hidden = hidden.contiguous()
            step = self.invariant.rows
            return torch.cat(
                [self.invariant.head(hidden[i : i + step]) for i in range(0, rows, step)]
            )
        if self.head is None:
            return self.model.compute_logits(hidden)
        return kernels.cpu.f32_panel_linear(hidden.contiguous(), self.head, self.vocab)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether this step is one the path takes: a decode step of at most `max_batch`
        requests, or any step of at most `max_batch` new tokens in all (drafts to verify,
        decodes beside a short prefill chunk or a jump-forward extend), or, when every
        projection is float32 in panels, any step; no given embeddings or M-RoPE positions."""
        if self.invariant is not None:  # every step (M-RoPE models the build refuses)
            return batch.mrope_positions is None
        tokens = batch.num_tokens
        return (
            # Up to max_batch new tokens, as many as a decode step may have (a few calls;
            # past that a GEMM over a prefill's rows costs less than reading the weights once
            # per call), unless the products are the panels', which take a whole chunk at once.
            # A step of drafts or a jump-forward then takes the path whatever its company: which
            # kernels compute a token does not follow how the scheduler grouped it.
            (tokens <= self.max_batch or self.layers.panels_only)
            and batch.input_embeds is None
            and batch.mrope_positions is None
        )

    def split(self, batch: ForwardBatch) -> MixedStep | None:
        """A mixed step (prefill chunks beside decodes) as the path's part and the rest, or
        None when it is not one to split: no decode (or nothing else, or more than
        `max_batch` of them), given embeddings, M-RoPE positions, or
        rows asked for their prompt logprobs or hidden states. A decode is a request adding
        one token, or one whose every new token wants its logits (it verifies drafts:
        speculative decoding), up to `max_batch` tokens of them in all."""
        lengths = batch.extend_lens_cpu
        counts = batch.logit_counts or (1,) * len(lengths)
        singles = [
            i
            for i, (length, count) in enumerate(zip(lengths, counts, strict=True))
            if length == 1 or count == length
        ]
        path_tokens = sum(lengths[i] for i in singles)
        if (
            not singles
            or len(singles) == len(lengths)
            or path_tokens > self.max_batch  # (at least one token per decode)
            or batch.input_embeds is not None
            or batch.mrope_positions is not None
            or batch.input_logprobs
            or batch.hidden_state_requests
        ):
            return None
        starts, total = [], 0
        for length in lengths:
            starts.append(total)
            total += length
        taken = set(singles)
        others = [i for i in range(len(lengths)) if i not in taken]
        device = batch.device
        single_rows = torch.tensor(singles, device=device)
        other_rows = torch.tensor(others, device=device)
        tokens = torch.tensor(
            [t for i in singles for t in range(starts[i], starts[i] + lengths[i])], device=device
        )
        other_tokens = torch.tensor(
            [t for i in others for t in range(starts[i], starts[i] + lengths[i])], device=device
        )
        rest = ForwardBatch(
            input_ids=batch.input_ids.index_select(0, other_tokens),
            positions=batch.positions.index_select(0, other_tokens),
            out_cache_loc=batch.out_cache_loc.index_select(0, other_tokens),
            req_pool_indices=batch.req_pool_indices.index_select(0, other_rows),
            prefix_lens=batch.prefix_lens.index_select(0, other_rows),
            extend_lens=batch.extend_lens.index_select(0, other_rows),
            seq_lens=batch.seq_lens.index_select(0, other_rows),
            req_to_token=batch.req_to_token,
            prefix_lens_cpu=tuple(batch.prefix_lens_cpu[i] for i in others),
            extend_lens_cpu=tuple(lengths[i] for i in others),
            req_pool_indices_cpu=tuple(batch.req_pool_indices_cpu[i] for i in others),
        )
        token_rows = torch.repeat_interleave(
            batch.req_pool_indices.index_select(0, single_rows),
            batch.extend_lens.index_select(0, single_rows),
            output_size=path_tokens,
        )
        return MixedStep(single_rows, tokens, other_rows, rest, token_rows)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states [T, hidden] of the new tokens (after the final norm), as
        the model's own forward returns them; writes their K/V into the pool.

        Each new token is a row of its own: its request's table row, and the length up to
        it (position + 1). A request's rows are in order, and a layer writes a row's K/V
        before it attends, so each token sees the ones before it in the same step."""
        if batch.num_tokens == batch.batch_size:  # one token per request
            rows, lengths = batch.req_pool_indices, batch.seq_lens
        else:
            rows = torch.repeat_interleave(
                batch.req_pool_indices, batch.extend_lens, output_size=batch.num_tokens
            )
            lengths = batch.positions + 1
        return self.run(
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.req_to_token,
            rows,
            lengths,
            batch.input_embeds,
            batch.input_embeds_rows,
        )

    def forward_part(self, batch: ForwardBatch, step: MixedStep) -> torch.Tensor:
        """`forward` over the decodes of a split mixed step: [their tokens, hidden]."""
        positions = batch.positions.index_select(0, step.tokens)
        return self.run(
            batch.input_ids.index_select(0, step.tokens),
            positions,
            batch.out_cache_loc.index_select(0, step.tokens),
            batch.req_to_token,
            step.token_rows,
            positions + 1,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        table: torch.Tensor,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        embeds: torch.Tensor | None = None,
        embeds_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new token per request (request i's row `rows[i]` of `table`, `lengths[i]`
        tokens with the new one): the final hidden states [len(rows), hidden]. Rows
        `embeds_rows` take `embeds` instead of their ids' lookup (a prompt given as
        embeddings; only deterministic steps bring them)."""
        decoder = self.model.model
        hidden = decoder.embed_tokens(input_ids)
        if embeds is not None and embeds_rows is not None:
            hidden[embeds_rows] = embeds.to(hidden.dtype)
        hidden = hidden.contiguous()
        count = hidden.shape[0]
        if self.invariant is not None:
            cos, sin = self.invariant.angles(positions)
        else:
            cos, sin = decoder.rotary.cos_sin(positions, torch.float32)
            cos, sin = cos.reshape(count, -1), sin.reshape(count, -1)
        # Requests are independent within a layer: more than a call takes run in chunks (a
        # request's rows in order: each chunk's K/V is in the pool before the next attends).
        step = self.layers.max_rows
        for start in range(0, count, step):
            chunk = slice(start, start + step)
            self.layers(
                hidden[chunk],
                cos[chunk],
                sin[chunk],
                out_slots[chunk],
                table,
                rows[chunk],
                lengths[chunk],
            )
        normed: torch.Tensor = decoder.norm(hidden)
        return normed


@dataclass(frozen=True)
class MixedStep:
    """A mixed step split in two (`CpuDecodePath.split`): its decodes (batch indices `rows`,
    their tokens' indices `tokens`) for the path, and the other requests
    (batch indices `other_rows`) as a batch of their own for the model's forward."""

    rows: torch.Tensor
    tokens: torch.Tensor
    other_rows: torch.Tensor
    rest: ForwardBatch
    #: The table row of each of the path's tokens.
    token_rows: torch.Tensor


@dataclass(frozen=True)
class Invariant:
    """What the path needs for batch-invariant steps: the LM head over at most `rows` rows a
    call, and the rotary cos / signed sin of every position [positions, head_dim], computed
    once."""

    head: Callable[[torch.Tensor], torch.Tensor]
    #: The most rows one call of `head` takes.
    rows: int
    cos: torch.Tensor
    sin: torch.Tensor

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the tables (contiguous copies) for these positions."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is past the rotary table of "
                f"{self.cos.shape[0]} positions (the context length)"
            )
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
