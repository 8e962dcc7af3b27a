"""LoRA adapters over the base model: PEFT directories (or tensors) read and checked (`adapter`), the
wrapped layers that add each row's own adapter delta (`layers`), and one rank's slot pool
(`manager`). The scheduler's slot table is `radixlm.runtime.scheduler.adapters`."""

from radixlm.runtime.lora.adapter import (
    TARGET_MODULES,
    LoraAdapter,
    LoraAdapterError,
    adapter_from_tensors,
    load_adapter,
)
from radixlm.runtime.lora.manager import LoraManager, PoolShape

__all__ = [
    "TARGET_MODULES",
    "LoraAdapter",
    "LoraAdapterError",
    "LoraManager",
    "PoolShape",
    "adapter_from_tensors",
    "load_adapter",
]
