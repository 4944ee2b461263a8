"""Write a tiny randomly initialised Llama model with a byte-level tokenizer to a folder.

For smoke-testing a P/D setup (examples/vllm_1p1d.sh) where no model can be
downloaded: ``vllm serve FOLDER`` loads it like any local checkpoint. Its
output is noise; what the run shows is that the KV cache moved and decode ran.

    python examples/vllm_tiny_model.py /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write config, weights and tokenizer")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (a TP size must divide it)")
    args = parser.parse_args(argv)
    try:
        import torch
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        print(f"error: {exc}; run this with the Python of your vLLM environment", file=sys.stderr)
        return 2

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The capital of France is Paris.", "Prefill and decode run on different engines.",
              "KV cache blocks move between engines."] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(args.folder)

    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=args.kv_heads, head_dim=32, max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(args.folder)
    print(f"wrote a {args.layers}-layer tiny Llama ({args.kv_heads} KV heads) to {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
