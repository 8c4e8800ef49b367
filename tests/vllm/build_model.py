"""Build a tiny Llama with random weights and a byte-level BPE tokenizer from local text, for
the real-vLLM tier (nothing is downloaded). Run with the vLLM venv's Python:

    python build_model.py OUT_DIR {random|canonical}

`random`: raw random weights; its greedy output is full of lone bytes and non-canonical
merges, so most split points of it do not re-tokenize to the same ids. `canonical`: the
output layer can only produce whole " word" tokens, each of which re-tokenizes to itself, so
any split point of its output re-tokenizes canonically.
"""

from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if not loop.last or add_generation_prompt %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob(f"{Path(json.__file__).parent.parent}/*.py"))[:80]
    out = []
    for f in files:
        try:
            out.append(Path(f).read_text(errors="replace"))
        except (OSError, IsADirectoryError):
            continue
    return out


def main(out: str, kind: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    torch.manual_seed(1234)
    vocab = len(fast)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    if kind == "canonical":
        words = []
        for tid in range(vocab):
            piece = fast.convert_ids_to_tokens(tid)
            if not re.fullmatch(r"Ġ[a-z]{2,}", piece or ""):
                continue
            if fast.encode(" " + piece[1:], add_special_tokens=False) == [tid]:
                words.append(tid)
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[words] = True
        # Zeroed rows give a logit of exactly 0; among hundreds of random word rows some
        # logit is always above 0, so greedy decoding only ever picks a word (never eos: the
        # stream ends by max_tokens).
        with torch.no_grad():
            model.lm_head.weight[~keep] = 0.0
        (dest / "words.json").write_text(json.dumps(words))
    model.save_pretrained(dest, safe_serialization=True)
    print(dest, vocab)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
