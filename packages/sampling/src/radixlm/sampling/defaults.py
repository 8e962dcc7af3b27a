"""SamplingDefaults: model-provided defaults (generation_config.json) under the request's values.

Precedence, highest first: a field the request set > the model's generation_config.json (mode
`model`, the default) > SamplingParams' own constants (SGLang's defaults). Mode `openai` skips
the model's file, so results match what OpenAI-API users expect from the constants alone — the
same switch as `--sampling-defaults {model,openai}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import ValidationError

from radixlm.sampling.errors import InvalidRequest
from radixlm.sampling.params import SamplingParams

DefaultsMode = Literal["model", "openai"]

# generation_config.json key -> SamplingParams field. `do_sample` is ignored on purpose (as vLLM
# does): the sampling values themselves say what the model's authors recommend.
GENERATION_CONFIG_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repetition_penalty",
        "max_new_tokens": "max_new_tokens",
    }
)


def _from_hf_value(name: str, value: Any) -> Any:
    # transformers uses top_k=0 for "disabled"; SGLang uses -1.
    if name == "top_k" and isinstance(value, int) and value <= 0:
        return -1
    return value


@dataclass(frozen=True)
class SamplingDefaults:
    """Default sampling values a model provides, and the mode that decides whether they apply."""

    values: Mapping[str, Any] = field(default_factory=dict)
    mode: DefaultsMode = "model"

    def __post_init__(self) -> None:
        if self.mode not in ("model", "openai"):
            raise ValueError(
                f"sampling defaults mode must be 'model' or 'openai'; got {self.mode!r}"
            )
        unknown = set(self.values) - set(GENERATION_CONFIG_FIELDS.values())
        if unknown:
            raise ValueError(f"not sampling fields with model defaults: {sorted(unknown)}")
        try:
            SamplingParams.model_validate(dict(self.values))
        except ValidationError as error:
            raise ValueError(
                f"the model's default sampling values are invalid: "
                f"{InvalidRequest.from_validation_error(error)}"
            ) from None

    @classmethod
    def from_generation_config(
        cls, source: str | Path | Mapping[str, Any] | None, mode: DefaultsMode = "model"
    ) -> SamplingDefaults:
        """Read defaults from a generation_config.json file, a model directory or a dict.

        A missing file means no model defaults. Unrelated keys (eos_token_id, ...) are ignored.
        """
        config: Mapping[str, Any]
        if source is None:
            config = {}
        elif isinstance(source, Mapping):
            config = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "generation_config.json"
            config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        values = {
            param: _from_hf_value(key, config[key])
            for key, param in GENERATION_CONFIG_FIELDS.items()
            if config.get(key) is not None
        }
        return cls(values=values, mode=mode)

    @property
    def effective(self) -> Mapping[str, Any]:
        """The values that apply under the current mode."""
        return self.values if self.mode == "model" else {}

    def apply(self, params: SamplingParams | None) -> SamplingParams:
        """A new SamplingParams: the request's set fields over the defaults. Does not mutate.

        Raises InvalidRequest when the combination is invalid (e.g. the request's
        min_new_tokens above the model's default max_new_tokens).
        """
        requested = params.model_dump(exclude_unset=True) if params is not None else {}
        if not self.effective:
            return params if params is not None else SamplingParams()
        return SamplingParams.parse({**self.effective, **requested}, field_prefix="")
