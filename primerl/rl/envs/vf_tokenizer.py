"""A small Hugging Face tokenizer with Qwen3's chat tokens, built locally (no hub download).

For random-init policies trained through verifiers: ``renderers``' ``qwen3`` renderer needs a
tokenizer whose vocabulary has Qwen3's special tokens (``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>``, ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``) and encodes any text. This one is byte-level BPE: the
256 byte tokens first (so every string round-trips), then merges learned by ``tokenizers``' own
trainer from a fixed corpus of chat scaffolding and tool-call JSON (so templates cost few tokens),
then the special tokens. A Qwen3-style ``chat_template`` is included so a template-driven
renderer works too. Built from the same corpus, the directory is the same on every machine.

>>> path = build_qwen3_tokenizer("outputs/tok")      # writes tokenizer.json, tokenizer_config.json
>>> AutoTokenizer.from_pretrained(path)               # len == QWEN3_TINY_VOCAB
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>")
QWEN3_TINY_VOCAB = 512  # tokenizer size (bytes + merges + specials); a policy's vocab_size must cover it

# Qwen3's chat template reduced to what this tokenizer's users render: system / user / assistant
# (with tool calls) / tool turns and the generation prompt (``enable_thinking=false`` prefills an
# empty think block, as Qwen3's does).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "{% if loop.first and message.content %}{{ '\n' }}{% elif not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\n' }}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

_CORPUS = [
    "<|im_start|>", "system\n", "user\n", "assistant\n", "<think>\n\n</think>\n\n", "<|im_end|>\n", "\n",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>",
    '{"type": "function", "function": {"name": "', '", "description": "', '", "parameters": {"type": "object", '
    '"properties": {', '"type": "string"', '"type": "integer"', '}, "required": [', ']}}}',
    '\n{"name": "', '", "arguments": {', '}}\n', '": "', '", "', '": ',
    # primerl's example tasksets (primerl/rl/envs/vf_plugins): their prompts and tool schema
    "Reverse: ", "What is the secret of ", "?", '\n{"name": "lookup", "arguments": {"key": "', '"}}\n',
    '{"type": "function", "function": {"name": "lookup", "description": "Return the secret stored under key.", '
    '"parameters": {"type": "object", "properties": {"key": {"title": "Key", "type": "string"}}, "required": ["key"], '
    '"title": "lookupArguments"}}}',
    "reverse", "text", "answer", "secret", "key", "letter", "count", "word",
    "the ", "a ", "is ", "of ", "to ", "and ", "in ", "you ", "with ", "for ", "call ", "tool ", "function ",
]


def _train_merges(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # no regex split: merges may span word boundaries, so a template line can become one token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    # each string many times, in a fixed order: the merges depend only on this corpus
    tok.train_from_iterator((s for _ in range(8) for s in _CORPUS), trainer=trainer)
    return tok


def build_qwen3_tokenizer(path: str | Path, *, vocab_size: int = QWEN3_TINY_VOCAB) -> str:
    """Write the tokenizer directory at ``path`` (created; files overwritten) and return it as a str.
    Its ids: BPE tokens ``0 .. vocab_size - 10``, then the 9 special tokens; ``len(tokenizer) ==
    vocab_size``."""
    from tokenizers import AddedToken

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"build_qwen3_tokenizer: vocab_size must be > {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = _train_merges(vocab_size)
    base = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    pad = vocab_size - tok.get_vocab_size()
    if pad < 0:
        raise RuntimeError(f"build_qwen3_tokenizer: trainer produced {base} tokens, more than {vocab_size - 9}")
    if pad:  # the corpus ran out of merges: fill with inert tokens so ids and len() stay fixed
        tok.add_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(pad)])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS), "add_bos_token": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "additional_special_tokens": list(SPECIAL_TOKENS)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return str(out)


__all__ = ["build_qwen3_tokenizer", "SPECIAL_TOKENS", "QWEN3_TINY_VOCAB", "CHAT_TEMPLATE"]
