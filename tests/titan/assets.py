"""TEST-ONLY offline assets for torchtitan on CPU: nothing is downloaded. A JSON-lines text set
(``data/data.json``, ``{"text": ...}`` per line, the layout torchtitan's ``c4_test`` loader reads
with ``datasets.load_dataset(path, split="train")``) of seeded random sentences over a fixed
word list, and a word-level tokenizer built with the ``tokenizers`` package (a torchtitan
dependency) over the same words (``tokenizer/tokenizer.json`` + ``tokenizer_config.json``, the
files torchtitan's ``HuggingFaceTokenizer`` loads). Vocabulary: 3 special tokens + 500 words,
under the debug model's 2048."""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
WORDS = 500
DOCUMENTS = 400


def _words() -> list[str]:
    pick = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < WORDS:
        words.add("".join(pick.choice(letters) for _ in range(pick.randint(2, 7))))
    return sorted(words)


def make_assets(directory: Path) -> tuple[Path, Path]:
    """Write the text set and the tokenizer under ``directory``; returns (data dir, tokenizer dir)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _words()
    data, tokenizer_dir = directory / "data", directory / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    pick = random.Random(1)
    with open(data / "data.json", "w") as out:
        for _ in range(DOCUMENTS):
            text = " ".join(pick.choice(words) for _ in range(pick.randint(20, 120)))
            out.write(json.dumps({"text": text}) + "\n")
    vocab = {UNK: 0, BOS: 1, EOS: 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([UNK, BOS, EOS])
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True, "add_eos_token": True}))
    return data, tokenizer_dir


if __name__ == "__main__":
    import sys

    print(*make_assets(Path(sys.argv[1])))
