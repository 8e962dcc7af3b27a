"""EAGLE and EAGLE-3 drafts: a small head over the target's own features proposes the next
tokens, one batched head forward per draft position.

EAGLE's head reads, at position j, the target's feature there (its final hidden state; for
EAGLE-3 the residual stream entering three of its layers, projected by the head's `fc`)
together with the embedding of token j + 1, and predicts the feature at j + 1 — hence token
j + 2. Drafting chains the head's own predicted features: (f'_p, d1) at the pending token's
position p gives d2, and so on.

The head's K/V lives in a pool indexed by the target's slot ids (as STANDALONE's draft
model), over the target's request table, and the target's features are kept per slot. The
head's K/V at a slot depends on the token after it as well, so each slot records that token
(-1: none), and a request reuses the K/V only where it continues with the same one. Each time
a request drafts, the head first computes what it is missing — at least the pair of its
last computed position and the new token — from the target's true features; its drafts'
K/V, built on predicted features, goes to scratch slots and is never kept.

Checkpoints use the published layouts (SGLang's and the EAGLE authors'): EAGLE — `fc`
(2 × hidden → hidden, with a bias) and decoder `layers.N` whose first has no input norm; the
target's embedding and LM head. EAGLE-3 — `fc` (3 × the target's hidden → hidden), one
`midlayer` whose attention reads the normed embedding and the normed feature side by side
(`input_layernorm`, `hidden_norm`), a final `norm` and its own `lm_head` over a smaller draft
vocabulary mapped to the target's by `d2t` (target id = draft id + d2t[draft id]); the
target's embedding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention import create_backend
from radixlm.runtime.forward_batch import BatchEntry, ForwardBatch
from radixlm.runtime.memory import KVPool
from radixlm.runtime.model_files import download_from_hub, looks_like_hub_id
from radixlm.runtime.model_runner import ModelRunner, kv_cache_dtype
from radixlm.runtime.models.arch import ArchConfig
from radixlm.runtime.models.decoder import (
    IGNORED_SUFFIXES,
    STACKED_PROJECTIONS,
    DecoderAttention,
    DecoderLayer,
    DecoderMLP,
    RMSNorm,
    copy_weight,
)
from radixlm.runtime.models.linear import HeadLayout, ReplicatedLinears
from radixlm.runtime.models.rope import RotaryEmbedding
from radixlm.runtime.speculative.costs import DraftCosts, StepCost

if TYPE_CHECKING:
    from radixlm.runtime.attention import AttentionBackend
    from radixlm.runtime.scheduler import Req, ScheduledBatch

logger = logging.getLogger("radixlm.runtime.speculative")


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [normed embedding, normed feature]."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        linears = ReplicatedLinears(dtype)
        size = arch.hidden_size
        self.input_layernorm = RMSNorm(size, arch.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(size, arch.rms_norm_eps, dtype)
        self.self_attn = DecoderAttention(arch, 0, linears, dtype)
        heads = HeadLayout.of(arch.num_heads, arch.num_kv_heads, arch.head_dim, linears.tp)
        self.self_attn.qkv_proj = linears.merged_column(
            2 * size, {"q": heads.q, "k": heads.kv, "v": heads.kv}, bias=arch.qkv_bias
        )
        self.mlp = DecoderMLP(arch, linears)

    def forward(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        attended: torch.Tensor = self.self_attn(both, cos, sin, backend)
        hidden = feature + attended
        mixed: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + mixed


class EagleHead(nn.Module):
    """An EAGLE (`kind="EAGLE"`) or EAGLE-3 draft head. `forward` gives, per token, the
    hidden state its logits come from and the feature the next draft position reads."""

    def __init__(
        self,
        arch: ArchConfig,
        kind: str,
        target_hidden: int,
        draft_vocab: int | None,
        fc_bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.kind = kind
        size = arch.hidden_size
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope, arch.max_position_embeddings)
        self.layers = nn.ModuleList()
        self.midlayer: Eagle3Layer | None = None
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        #: EAGLE-3's draft vocabulary: target id = draft id + d2t[draft id] (None: the
        #: target's vocabulary).
        self.d2t: torch.Tensor | None
        if kind == "EAGLE":
            self.fc = nn.Linear(2 * size, size, bias=True, dtype=dtype)
            linears = ReplicatedLinears(dtype)
            self.layers.extend(
                DecoderLayer(arch, i, linears, dtype) for i in range(arch.num_layers)
            )
        else:
            self.fc = nn.Linear(3 * target_hidden, size, bias=fc_bias, dtype=dtype)
            self.midlayer = Eagle3Layer(arch, dtype)
            self.norm = RMSNorm(size, arch.rms_norm_eps, dtype)
            if draft_vocab is not None:
                self.lm_head = nn.Linear(size, draft_vocab, bias=False, dtype=dtype)
                self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        if not hasattr(self, "d2t"):
            self.d2t = None
        for param in self.parameters():
            param.requires_grad_(False)

    @property
    def num_layers(self) -> int:
        return len(self.layers) if self.kind == "EAGLE" else 1

    def project(self, captured: torch.Tensor) -> torch.Tensor:
        """The feature the head reads from what the target captured (EAGLE-3: `fc` of its
        three layers' hidden states; EAGLE: the final hidden state itself)."""
        return self.fc(captured.to(self.fc.weight.dtype)) if self.kind == "EAGLE3" else captured

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = embeds.to(self.fc.weight.dtype)
        features = features.to(self.fc.weight.dtype)
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        if self.midlayer is not None:
            assert self.norm is not None
            out = self.midlayer(embeds, features, cos, sin, backend)
            return self.norm(out), out
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        for index, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            if index == 0:  # the first layer has no input norm
                attended: torch.Tensor = layer.self_attn(hidden, cos, sin, backend)
                hidden = hidden + attended
                mixed: torch.Tensor = layer.mlp(layer.post_attention_layernorm(hidden))
                hidden = hidden + mixed
            else:
                hidden = layer(hidden, cos, sin, backend)
        return hidden, hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a published checkpoint's tensors in (an optional `model.` prefix dropped; the
        embedding, `t2d` and unused norms skipped); ValueError names what is unknown or
        missing."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name.endswith(IGNORED_SUFFIXES) or name.startswith(("embed_tokens.", "t2d")):
                continue
            if name == "layers.0.input_layernorm.weight" and self.kind == "EAGLE":
                continue  # the first layer has no input norm
            if name == "d2t":
                if "d2t" not in buffers:
                    raise ValueError(
                        "the checkpoint maps a draft vocabulary (d2t) but has no lm_head"
                    )
                buffers["d2t"].copy_(tensor.to(torch.int64))
                loaded.add(name)
                continue
            prefix, _, leaf = name.rpartition(".")
            module_path, _, module_name = prefix.rpartition(".")
            if module_name in STACKED_PROJECTIONS:
                merged, shard = STACKED_PROJECTIONS[module_name]
                self._linear(raw, f"{module_path}.{merged}").load_weight(shard, leaf, tensor)
                loaded.add(f"{module_path}.{merged}.{shard}.{leaf}")
            elif module_name in ("o_proj", "down_proj"):
                self._linear(raw, prefix).load_weight(None, leaf, tensor)
                loaded.add(name)
            else:
                copy_weight(raw, params.get(name), tensor)
                loaded.add(name)
        wanted = {name for name in params if not _in_linear(self, name)}
        wanted.discard("layers.0.input_layernorm.weight")  # EAGLE's first layer has none
        missing = sorted(wanted - loaded)
        if missing:
            raise ValueError(f"the EAGLE checkpoint lacks {', '.join(missing[:6])}")

    def _linear(self, name: str, path: str) -> Any:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"the checkpoint has a tensor the {self.kind} head does not know: {name}"
            ) from None


def _in_linear(head: nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to a merged or row linear layer (loaded by shard)."""
    owner = name.rpartition(".")[0]
    return hasattr(head.get_submodule(owner), "load_weight") if owner else False


def _tensors(path: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors: its safetensors files, else its `pytorch_model*.bin`."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(str(file)).items()
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_eagle_head(path: str, kind: str, target: ModelRunner) -> tuple[EagleHead, tuple[int, ...]]:
    """The head in directory `path` (config.json and weights; a hub id `org/name` is
    downloaded, as models are) for `target`, and the target layers whose inputs EAGLE-3
    reads (() for EAGLE)."""
    import transformers

    root = Path(path).expanduser()
    if not root.exists() and looks_like_hub_id(path):
        # EAGLE-1 heads ship pytorch_model.bin, which model downloads skip.
        patterns = ["*.json", "*.safetensors", "pytorch_model*.bin"]
        root = download_from_hub(path, None, target.config.model.download_dir, patterns)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(
            f"speculative_draft_model_path {path!r} is not a directory with a config.json"
        )
    config = transformers.LlamaConfig.from_pretrained(str(root))
    raw = json.loads((root / "config.json").read_text())
    layers_named = any(k.startswith("midlayer.") for k, _ in _names(root))
    if kind == "EAGLE3" and not layers_named:
        raise ValueError(f"{path} is not an EAGLE-3 head (no midlayer.*): use EAGLE")
    if kind == "EAGLE" and layers_named:
        raise ValueError(f"{path} is an EAGLE-3 head (midlayer.*): use EAGLE3")
    target_arch = target.info.arch
    arch = ArchConfig.from_hf(config, architecture=f"{kind}Head", vocab_size=target.vocab_size)
    if arch.hidden_size != target_arch.hidden_size and kind == "EAGLE":
        raise ValueError(
            f"the EAGLE head's hidden size {arch.hidden_size} is not the target's "
            f"{target_arch.hidden_size}"
        )
    draft_vocab = raw.get("draft_vocab_size")
    has_head = any(name.removeprefix("model.") == "lm_head.weight" for name, _ in _names(root))
    head = EagleHead(
        arch,
        kind,
        int(raw.get("target_hidden_size") or target_arch.hidden_size),
        (draft_vocab or arch.vocab_size) if kind == "EAGLE3" and has_head else None,
        bool(raw.get("bias", False)),
        target.dtype,
    ).to(target.device)
    head.load_weights(_tensors(root))
    layers: tuple[int, ...] = ()
    if kind == "EAGLE3":
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        count = target_arch.num_layers
        # The residual stream entering these layers (the outputs of the ones before).
        layers = tuple(sorted(i + 1 for i in ids)) if ids else (2, count // 2, count - 3)
        if len(layers) != 3 or not all(0 < i < count for i in layers):
            raise ValueError(f"EAGLE-3 reads three layers of the target's {count}; got {layers}")
    return head, layers


def _names(root: Path) -> list[tuple[str, None]]:
    """The checkpoint's tensor names (reading only the safetensors headers when it has any)."""
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        names: list[tuple[str, None]] = []
        for file in files:
            with safe_open(str(file), "pt") as handle:
                names.extend((key, None) for key in handle.keys())  # noqa: SIM118
        return names
    return [(name, None) for name, _ in _tensors(root)]


class EagleDrafter:
    """Drafts from an EAGLE / EAGLE-3 head (see the module docstring)."""

    def __init__(
        self,
        head: EagleHead,
        target: ModelRunner,
        max_draft: int,
        disable_by_batch_size: int | None = None,
        step_tokens: int | None = None,
        costs: DraftCosts | None = None,
    ) -> None:
        self.head = head
        self.target = target
        self.max_draft = max_draft
        self.disable_by_batch_size = disable_by_batch_size
        self.step_tokens = step_tokens
        #: The target's step cost and the head's (a share of it).
        self.costs = costs or DraftCosts(StepCost.assumed(), None, step_tokens)
        self.max_catch_up = 8 * max_draft
        arch = head.arch
        slots = target.kv_pool.num_slots
        page = target.kv_pool.page_size
        scratch = target.req_to_token_pool.max_requests * max_draft
        scratch += -scratch % page
        self.pool = KVPool(
            head.num_layers,
            slots + scratch,
            arch.num_kv_heads,
            arch.head_dim,
            kv_cache_dtype(target.config.memory.kv_cache_dtype, target.dtype),
            target.device,
            page,
        )
        self.backend = create_backend(target.attention.name, self.pool)
        self._table = target.req_to_token_pool
        self._scratch_base = slots
        self._scratch_slots = self.pool.num_slots - slots
        self._context = target.context_length
        device = target.device
        #: Per target slot: the target's feature of its token.
        self._features = torch.zeros(slots + 1, arch.hidden_size, dtype=target.dtype, device=device)
        #: Per slot: the token after it that the head's K/V there was computed with (-1:
        #: none; the K/V reads that token's embedding).
        self._next = torch.full((slots + 1,), -1, dtype=torch.int64)

    def threshold(self, size: int) -> float:
        """See the scheduler's `Drafter`."""
        return self.costs.threshold(size)

    # ------------------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, asks: Sequence[tuple[Req, int]]) -> list[list[int]]:
        """Per (request, count): the head's greedy chain of `count` tokens."""
        drafts: list[list[int]] = [[] for _ in asks]
        live: list[tuple[int, Req, int]] = []
        room = self._scratch_slots
        for index, (req, count) in enumerate(asks):
            count = min(count, self._context - req.seq_len)
            if count <= 0 or count - 1 > room:
                continue
            if req.kv_len - self._first_missing(req, req.kv_len) > self.max_catch_up:
                continue  # it decoded long without drafts: catching up costs more than it saves
            room -= count - 1
            live.append((index, req, count))
        if not live:
            return drafts
        entries = [self._catch_up(req) for _i, req, _c in live]
        tokens, feature = self._forward(entries, self._features_of(entries))
        scratch: dict[Req, list[int]] = {}
        at = self._scratch_base
        for (index, req, count), token in zip(live, tokens, strict=True):
            drafts[index].append(token)
            scratch[req] = list(range(at, at + count - 1))
            at += count - 1
        rows = list(range(len(live)))
        for depth in range(1, max(count for _i, _r, count in live)):
            keep = [k for k, (_i, _r, count) in enumerate(live) if count > depth]
            picked = torch.tensor([rows.index(k) for k in keep], device=feature.device)
            feature = feature.index_select(0, picked)
            rows = keep
            step = [
                BatchEntry(
                    live[k][1].row,  # type: ignore[arg-type]
                    [drafts[live[k][0]][-1]],
                    live[k][1].kv_len + depth - 1,
                    [scratch[live[k][1]][depth - 1]],
                )
                for k in keep
            ]
            tokens, feature = self._forward(step, feature)
            for k, token in zip(keep, tokens, strict=True):
                drafts[live[k][0]].append(token)
        return drafts

    def _catch_up(self, req: Req) -> BatchEntry:
        """The entry that computes `req`'s missing head K/V, up to the pair of its last
        computed position and its pending token (each position reads the token after it)."""
        end = req.kv_len
        start = min(self._first_missing(req, end), end - 1)
        assert req.row is not None
        if req.row_synced < start:
            self._table.write(req.row, req.row_synced, req.kv_slots[req.row_synced : start])
        slots = req.kv_slots[start:end]
        after = req.tokens(start + 1, end + 1)
        self._next[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(after)
        req.draft_kv_len = end
        return BatchEntry(req.row, after, start, slots)

    def _first_missing(self, req: Req, end: int) -> int:
        """The first of positions [0, end) whose head K/V `req` cannot reuse: computed with
        another next token, or none (`end`: all reusable). The last position's next token
        must be known (`end` < seq_len)."""
        known = req.draft_kv_len
        if known >= end:
            return end
        have = self._next[torch.tensor(req.kv_slots[known:end], dtype=torch.int64)]
        want = torch.tensor(req.tokens(known + 1, end + 1), dtype=torch.int64)
        found = (have != want).nonzero()
        return end if found.numel() == 0 else known + int(found[0, 0])

    def _forward(
        self, entries: list[BatchEntry], features: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """Run the head over `entries` (`features`: one row per new token); the argmax after
        each entry's last token and the feature it predicts there."""
        batch = ForwardBatch.build(entries, self._table.req_to_token)
        batch.write_req_to_token()
        self.backend.prepare(batch)
        embeds = self.target.model.model.embed_tokens(batch.input_ids)
        hidden, feature = self.head(embeds, features, batch.positions, self.backend)
        last = torch.cumsum(batch.extend_lens, 0) - 1
        hidden, feature = hidden.index_select(0, last), feature.index_select(0, last)
        head = self.head
        if head.lm_head is not None and head.d2t is not None:
            ids = F.linear(hidden.float(), head.lm_head.weight.float()).argmax(dim=-1)
            ids = ids + head.d2t.index_select(0, ids)
        else:
            model = self.target.model
            logits = model.compute_logits(hidden.to(self.target.dtype))
            ids = logits[:, : self.target.vocab_size].argmax(dim=-1)
        return ids.tolist(), feature

    # ------------------------------------------------------------------- after target steps

    def refilled(self, slots: Sequence[int]) -> None:
        """The target's K/V of `slots` came from a hierarchical cache's lower tier: the head
        has no K/V of them (its features of those tokens are not kept down there either, so
        drafts over such a prefix read whatever the slots held: only their quality suffers,
        the target verifies them)."""
        if slots:
            self._next[torch.tensor(list(slots), dtype=torch.int64)] = -1

    def accepted(self, req: Req, slots: Sequence[int]) -> None:
        """Nothing to keep: the next drafting recomputes the accepted tokens' head K/V from
        the target's own features of them."""

    @torch.inference_mode()
    def follow(self, batch: ScheduledBatch, captured: torch.Tensor | None) -> None:
        """After a target forward: keep its features of the new tokens (their slots' head K/V
        is stale from now), and run the head over the prefill chunks of requests that may
        draft, up to the last position whose next token is known."""
        written = [slot for entry in batch.entries for slot in entry.out_slots]
        if not written:
            return
        index = torch.tensor(written, dtype=torch.int64)
        assert captured is not None and captured.shape[0] == len(written), "features per token"
        self._features[index.to(self._features.device)] = self.head.project(captured).to(
            self._features.dtype
        )
        self._next[index] = -1
        fills: list[BatchEntry] = []
        for entry in batch.entries:
            req = entry.req
            if not entry.is_prefill or not req.speculate or req.row is None:
                continue
            end = min(entry.prefix_len + len(entry.input_ids), req.seq_len - 1)
            start = self._first_missing(req, min(entry.prefix_len, end))
            if start >= end:
                continue
            if req.row_synced < start:
                self._table.write(req.row, req.row_synced, req.kv_slots[req.row_synced : start])
            slots = req.kv_slots[start:end]
            after = req.tokens(start + 1, end + 1)
            self._next[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(after)
            fills.append(BatchEntry(req.row, after, start, slots))
            req.draft_kv_len = end
        if fills:
            self._forward(fills, self._features_of(fills))

    def _features_of(self, entries: list[BatchEntry]) -> torch.Tensor:
        """The target's features of the entries' slots, in order."""
        slots = [slot for entry in entries for slot in entry.out_slots]
        index = torch.tensor(slots, dtype=torch.int64, device=self._features.device)
        return self._features.index_select(0, index)
