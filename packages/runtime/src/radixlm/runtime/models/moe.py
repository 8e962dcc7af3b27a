"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

The shared decoder with a `SparseMoeBlock` in place of the MLP on its sparse layers: a router
(a replicated [experts, hidden] matrix) scores the experts of each token, the top k are kept
with each family's normalisation, and `radixlm.kernels.fused_moe` runs the chosen experts'
gate/up and down projections over the tokens grouped by expert (one sort, one grouped matmul
per projection; Triton on GPUs, torch elsewhere). Qwen2-MoE adds a shared expert, scaled by a
sigmoid gate, to every token.

Under tensor parallelism every expert's intermediate dimension is split across the ranks (the
column / row pattern of a dense MLP), and the partial outputs are summed by the layer's one
all-reduce. With expert parallelism (`ep_size`) the experts are placed on ranks instead:
`ep_size` groups of `num_experts / ep_size` experts, the intermediate dimension split across
the `tp_size / ep_size` ranks of a group. With `ep_size == tp_size` (whole experts per rank)
the tokens are exchanged with all-to-all: each rank takes a share of them and sends each
chosen (token, expert) row to the expert's rank (`_dispatched`). Otherwise each rank runs its
experts for the tokens routed to them (the others' ids become -1) and the same all-reduce adds
the groups' outputs.

Checkpoints name the experts per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`) or stacked (`mlp.experts.gate_up_proj`
[experts, 2 * intermediate, hidden] and `mlp.experts.down_proj`, transformers 5's layout);
both load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import fused_moe
from radixlm.runtime.distributed import TensorParallel
from radixlm.runtime.models.arch import MoEConfig
from radixlm.runtime.models.linear import LinearFactory, Part, mark_sharded, materialize

#: Per-expert checkpoint projection name -> (stacked parameter, which half of gate/up or None).
EXPERT_PROJECTIONS: dict[str, tuple[str, str | None]] = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", None),
    "w1": ("w13", "gate"),  # Mixtral
    "w3": ("w13", "up"),
    "w2": ("w2", None),
}
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def sparse_layers(hf_config: Any, num_experts: int) -> frozenset[int]:
    """Qwen's rule: a layer has experts unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer (all of them by default)."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    layers = int(hf_config.num_hidden_layers)
    return frozenset(
        i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts and which part of their intermediate dimension this rank holds."""

    first: int
    count: int
    columns: Part

    @classmethod
    def of(cls, moe: MoEConfig, tp: TensorParallel) -> ExpertPlacement:
        ep = moe.ep_size
        if ep < 1 or tp.size % ep:
            raise ValueError(f"ep_size ({ep}) must divide tp_size ({tp.size})")
        if moe.num_experts % ep:
            raise ValueError(
                f"the number of experts ({moe.num_experts}) must be divisible by ep_size ({ep})"
            )
        group_size = tp.size // ep  # ranks sharing one group of experts
        if moe.intermediate_size % group_size:
            raise ValueError(
                f"the experts' intermediate size ({moe.intermediate_size}) must be divisible by "
                f"tp_size / ep_size ({group_size})"
            )
        count = moe.num_experts // ep
        group = tp.rank // group_size
        columns = Part(moe.intermediate_size, group_size, tp.rank % group_size)
        return cls(first=group * count, count=count, columns=columns)

    def local(self, expert: int) -> int | None:
        """This rank's index of global expert `expert` (None: another rank holds it)."""
        index = expert - self.first
        return index if 0 <= index < self.count else None


class RoutedExperts:
    """Where the MoE blocks leave the experts they chose during one forward, when asked:
    per sparse layer the [tokens, top_k] ids (global)."""

    def __init__(self) -> None:
        self.enabled = False
        self.layers: list[torch.Tensor] = []

    def record(self, ids: torch.Tensor) -> None:
        if self.enabled:
            self.layers.append(ids)

    def take(self) -> torch.Tensor | None:
        """[tokens, sparse layers, top_k] int32 of the last forward, or None."""
        if not self.layers:
            return None
        out = torch.stack(self.layers, dim=1).to(torch.int32)
        self.layers = []
        return out


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SwiGLU MLP (split like one under tensor
    parallelism), its output scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, intermediate: int, linears: LinearFactory) -> None:
        super().__init__()
        if intermediate % linears.tp.size:
            raise ValueError(
                f"shared_expert_intermediate_size ({intermediate}) must be divisible by "
                f"tp_size ({linears.tp.size})"
            )
        self.local = intermediate // linears.tp.size
        self.gate_up_proj = linears.merged_column(
            hidden, {"gate": intermediate, "up": intermediate}, bias=False
        )
        self.down_proj = linears.row(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.split(self.gate_up_proj(x), self.local, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class SparseMoeBlock(nn.Module):
    """Router, experts (this rank's part) and the optional shared expert of one layer."""

    def __init__(
        self,
        hidden: int,
        moe: MoEConfig,
        linears: LinearFactory,
        dtype: torch.dtype,
        routed: RoutedExperts,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.tp = linears.tp
        self.routed = routed
        self.placement = ExpertPlacement.of(moe, linears.tp)
        count, inter = self.placement.count, self.placement.columns.local
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        # Each local expert's [gate rows; up rows] and down projection.
        self.w13 = nn.Parameter(torch.empty(count, 2 * inter, hidden, dtype=dtype), False)
        self.w2 = nn.Parameter(torch.empty(count, hidden, inter, dtype=dtype), False)
        if self.tp.enabled:
            mark_sharded(self.w13, self.w2)
        #: What runs this rank's experts, with `radixlm.kernels.fused_moe`'s signature. A
        #: benchmark swaps in `radixlm.kernels.reference.moe_per_expert_loop`, the naive loop
        #: over experts, to measure the fused path against it (tools/bench/moe_bench.py).
        self.experts_impl: Callable[..., torch.Tensor] = fused_moe
        #: Expert parallelism over every rank (`ep_size == tp_size`): each rank takes its
        #: share of the tokens and sends each chosen (token, expert) pair to the rank that
        #: holds the expert (`_dispatched`), instead of running its experts on every token.
        self.dispatch = moe.ep_size > 1 and moe.ep_size == linears.tp.size
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden, moe.shared_intermediate_size, linears)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.weight.requires_grad_(False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights, top-k global expert ids) of each token, as transformers computes
        them: softmax in float32 over every expert, top k, the family's normalisation."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.moe.weights_in_float:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        self.routed.record(ids)
        out = self._dispatched(x, weights, ids) if self.dispatch else self._local(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)  # all-reduced by its row layer
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts (or its columns of every expert) on every token, summed over
        the ranks by one all-reduce. Ids of experts another rank holds become -1."""
        placement = self.placement
        if placement.count != self.moe.num_experts:
            local = ids - placement.first
            ids = torch.where((local >= 0) & (local < placement.count), local, -1)
        out = self.experts_impl(x, self.w13, self.w2, weights, ids)
        return self.tp.all_reduce(out) if self.tp.enabled else out

    def _dispatched(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Expert parallelism with all-to-all: rank r takes the r-th share of the tokens,
        sends each of their chosen (token, expert) rows to the expert's rank, runs its own
        experts on the rows it receives, sends the results back, weights and sums them per
        token, and the ranks gather every token's output."""
        tp, count = self.tp, self.placement.count
        tokens, k = ids.shape
        share = -(-tokens // tp.size)
        begin = min(tp.rank * share, tokens)
        end = min(begin + share, tokens)
        mine = ids[begin:end].reshape(-1)
        owner = mine // count
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=tp.size)
        ones = [1] * tp.size
        got = tp.all_to_all(sent, ones, ones)
        send_splits, recv_splits = sent.tolist(), got.tolist()
        rows = tp.all_to_all(x[begin:end][order // k], recv_splits, send_splits)
        local = tp.all_to_all((mine % count)[order], recv_splits, send_splits)
        unit = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=x.device)
        computed = self.experts_impl(rows, self.w13, self.w2, unit, local[:, None])
        back = tp.all_to_all(computed, send_splits, recv_splits)
        scale = weights[begin:end].reshape(-1)[order].float()
        summed = torch.zeros(share, x.shape[1], dtype=torch.float32, device=x.device)
        summed.index_add_(0, order // k, back.float() * scale[:, None])
        return tp.all_gather(summed.to(x.dtype), dim=0)[:tokens]

    # Weights -------------------------------------------------------------------------------

    def load_expert(self, expert: int, projection: str, tensor: Any) -> bool:
        """Copy one expert's projection (HF per-expert layout); False when another rank
        holds that expert (nothing to do here)."""
        local = self.placement.local(expert)
        if expert >= self.moe.num_experts:
            raise ValueError(f"expert {expert} of a model with {self.moe.num_experts} experts")
        if local is None:
            return False
        target, half = EXPERT_PROJECTIONS[projection]
        columns = self.placement.columns
        with torch.no_grad():
            if target == "w13":
                piece = columns.take(tensor, 0)
                rows = columns.local
                begin = 0 if half == "gate" else rows
                _copy(self.w13[local, begin : begin + rows], piece, f"expert {expert} {projection}")
            else:
                _copy(self.w2[local], columns.take(tensor, 1), f"expert {expert} {projection}")
        return True

    def load_stacked(self, name: str, tensor: Any) -> None:
        """Copy transformers 5's stacked `gate_up_proj` [E, 2I, H] or `down_proj` [E, H, I]."""
        full = materialize(tensor)
        experts, inter = self.moe.num_experts, self.moe.intermediate_size
        if name == "gate_up_proj":
            if full.dim() != 3 or full.shape[0] != experts or full.shape[1] != 2 * inter:
                raise ValueError(
                    f"experts.gate_up_proj has shape {tuple(full.shape)}, the model expects "
                    f"[{experts}, {2 * inter}, hidden]"
                )
            for expert in range(experts):
                self.load_expert(expert, "gate_proj", full[expert, :inter])
                self.load_expert(expert, "up_proj", full[expert, inter:])
        else:
            for expert in range(experts):
                self.load_expert(expert, "down_proj", full[expert])

    def expert_names(self, prefix: str) -> Iterator[str]:
        """The per-expert checkpoint names this block needs (all experts: every rank reads
        the names, and skips those of experts it does not hold)."""
        for expert in range(self.moe.num_experts):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                yield f"{prefix}.experts.{expert}.{projection}.weight"


def _copy(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(target.shape)}"
        )
    target.copy_(tensor)


def split_moe_weights(
    weights: Iterable[tuple[str, Any]],
    blocks: dict[str, SparseMoeBlock],
    loaded: set[str],
) -> Iterator[tuple[str, Any]]:
    """Load the expert tensors of `weights` into `blocks` (by their `...mlp` prefix), adding
    the canonical per-expert names to `loaded`; yield every other tensor (Mixtral's
    `block_sparse_moe` renamed `mlp`)."""
    for raw, tensor in weights:
        name = raw.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.match(name)
        if match is not None and match.group(3) in EXPERT_PROJECTIONS:
            block = blocks.get(match.group(1))
            if block is None:
                raise ValueError(f"the checkpoint has a tensor the model does not know: {raw}")
            expert = int(match.group(2))
            try:
                block.load_expert(expert, match.group(3), tensor)
            except ValueError as error:
                raise ValueError(f"{raw}: {error}") from None
            canonical = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(
                match.group(3), match.group(3)
            )
            loaded.add(f"{match.group(1)}.experts.{expert}.{canonical}.weight")
            continue
        stacked = _STACKED.match(name)
        if stacked is not None:
            block = blocks.get(stacked.group(1))
            if block is None:
                raise ValueError(f"the checkpoint has a tensor the model does not know: {raw}")
            try:
                block.load_stacked(stacked.group(2), tensor)
            except ValueError as error:
                raise ValueError(f"{raw}: {error}") from None
            which = (
                ("gate_proj", "up_proj") if stacked.group(2) == "gate_up_proj" else ("down_proj",)
            )
            for expert in range(block.moe.num_experts):
                loaded.update(f"{stacked.group(1)}.experts.{expert}.{p}.weight" for p in which)
            continue
        yield name, tensor
