"""Train radixlm's built-in demo model: a tiny Llama with a byte-level BPE tokenizer, on CPU.

    python3 tools/demo_model/train.py --out DIR [--steps 1500]

Generates the corpus (tools/demo_model/corpus.py), trains the tokenizer and the model with plain
torch + transformers, checks the documented examples with greedy decoding, and saves a Hugging
Face model directory (config.json, model.safetensors, generation_config.json, tokenizer files
with a ChatML-style chat template).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import documents

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHECKS = [
    ("The capital of France is", " Paris"),
    ("Paris is the capital of", " France"),
    ("Here is the information of the capital of France in the JSON format.\n", '{"name":"Paris"'),
]


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        docs, vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT, IM_START, IM_END]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token=None,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 512
    return tokenizer


def packed_batches(ids: list[int], seq_len: int, batch: int, rng: random.Random) -> torch.Tensor:
    starts = [rng.randrange(0, len(ids) - seq_len - 1) for _ in range(batch)]
    return torch.tensor([ids[s : s + seq_len] for s in starts], dtype=torch.long)


def greedy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, n: int) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--documents", type=int, default=60_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    docs = documents(random.Random(args.seed), args.documents)
    tokenizer = train_tokenizer(docs, args.vocab_size)
    eos = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids: list[int] = []
    for encoded in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend([*encoded, eos])
    print(f"corpus: {len(docs)} documents, {len(ids)} tokens, vocab {len(tokenizer)}", flush=True)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95)
    )
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    model.train()
    start = time.time()
    for step in range(args.steps):
        batch = packed_batches(ids, args.seq_len, args.batch, rng)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - start:.0f}s", flush=True)

    model.eval()
    for prompt, expected in CHECKS:
        got = greedy(model, tokenizer, prompt, 12)
        print(f"{'ok ' if got.startswith(expected) else 'BAD'} {prompt!r} -> {got!r}")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List 3 countries and their capitals."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    print("chat ->", repr(greedy(model, tokenizer, chat, 40)))

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    GenerationConfig(eos_token_id=[eos, im_end], pad_token_id=eos, do_sample=False).save_pretrained(
        args.out
    )
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
