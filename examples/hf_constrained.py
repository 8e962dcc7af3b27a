"""radixlm-constrained with plain `transformers`: `model.generate` under a JSON schema and a regex.

The built-in demo model (radixlm-runtime's `builtin_model_path()`, a Hugging Face directory) is
loaded with `AutoModelForCausalLM` / `AutoTokenizer`; no radixlm engine is involved. The
`GrammarLogitsProcessor` masks every step's logits to what the grammar allows, so the output
always parses: here a `{name, population}` record for the capital of France, then a regex.

    python examples/hf_constrained.py
    python examples/hf_constrained.py --model-path /path/to/any/hf/causal-lm --backend outlines
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from radixlm.constrained import GrammarSpec
from radixlm.constrained.hf import GrammarLogitsProcessor

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}
JSON_PROMPT = "Here is the information of the capital of France in the JSON format.\n"
REGEX_PROMPT = "Paris is the capital of"


def constrained_generate(
    model: Any, tokenizer: Any, prompt: str, spec: GrammarSpec, backend: str, max_new: int
) -> str:
    """Greedy `model.generate` under `spec`; the generated text (prompt excluded)."""
    processor = GrammarLogitsProcessor.from_tokenizer(
        tokenizer,
        spec,
        backend=backend,
        vocab_size=model.config.vocab_size,  # the embedding may be wider than the vocab
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(
        **inputs,
        logits_processor=LogitsProcessorList([processor]),  # a new processor per call
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    text: str = tokenizer.decode(new_tokens, skip_special_tokens=True)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a local HF model (default: the built-in one)")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "outlines"])
    args = parser.parse_args()
    if args.model_path is None:
        from radixlm.runtime import builtin_model_path  # only for the demo model's files

        args.model_path = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    model = AutoModelForCausalLM.from_pretrained(args.model_path)

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    text = constrained_generate(model, tokenizer, JSON_PROMPT, spec, args.backend, 64)
    print("json_schema:", text)
    record = json.loads(text)  # always parses: the grammar closed it
    print(f"  name={record['name']!r} population={record['population']}")

    spec = GrammarSpec("regex", "(France|England)")
    print("regex:", constrained_generate(model, tokenizer, REGEX_PROMPT, spec, args.backend, 8))


if __name__ == "__main__":
    main()
