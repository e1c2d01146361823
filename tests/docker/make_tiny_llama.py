"""Write a tiny Llama with random weights (fixed seed) and a word-level tokenizer to a directory, for a vLLM
engine to serve where no model hub can be reached.  Runs in a venv or image with vLLM (transformers,
tokenizers, torch); never imports mpcache.

    python make_tiny_llama.py DIR

The vocabulary is "t0" ... "t511": a prompt "t5 t17 t3" is tokens 5, 17, 3, so the tokens a test sends are
known without the tokenizer.
"""

from __future__ import annotations

import sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 512


def main(directory: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    words = models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t0", eos_token="t1", unk_token="t2",
                            model_max_length=4096).save_pretrained(directory)


if __name__ == "__main__":
    main(sys.argv[1])
