"""Local text datasets for torchtitan's text dataloader, and the bundled default corpus.

torchtitan's ``HuggingFaceTextDataLoader`` looks datasets up by name in
``torchtitan.hf_datasets.text_datasets.DATASETS``; :func:`register_datasets` adds:

- ``tinyshakespeare``: the bundled public-domain corpus (``assets/tinyshakespeare.txt``), one
  sample per speech (blank-line separated paragraph). Needs no network and no ``../shared``.
- ``text_lines`` / ``text_lines_valid``: any local UTF-8 file given by
  ``--dataloader.dataset_path`` (``--validator.dataloader.dataset_path``), one sample per
  non-blank line (WikiText-2's format; its blank lines are ``" \\n"``).

The default tokenizer (:func:`default_tokenizer_dir`) is a byte-level BPE with 2,048 entries
(the Llama-3 debug model's vocabulary) trained from the bundled corpus with ``tokenizers`` at
first use and cached; training is deterministic and takes about a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
DEFAULT_CORPUS = ASSETS / "tinyshakespeare.txt"
VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"


def _paragraphs(path: str) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _as_dataset(samples: list[str]):
    # In-memory: no Hugging Face cache directory, no network.
    from datasets import Dataset

    return Dataset.from_dict({"text": samples})


def load_paragraphs(path: str):
    return _as_dataset(_paragraphs(path))


def load_lines(path: str):
    if not path or not Path(path).is_file():
        raise FileNotFoundError(f"text dataset file {path!r} not found; set --dataloader.dataset_path to a UTF-8 text file")
    return _as_dataset(_lines(path))


def _text(sample) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add the local datasets to torchtitan's registry (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    text_datasets.DATASETS["tinyshakespeare"] = DatasetConfig(path=str(DEFAULT_CORPUS), loader=load_paragraphs, sample_processor=_text)
    for name in ("text_lines", "text_lines_valid"):
        text_datasets.DATASETS[name] = DatasetConfig(path="", loader=load_lines, sample_processor=_text)


def _cache_root() -> Path:
    root = os.environ.get("GIFT_TITAN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "gift-compile")
    return Path(root)


def default_tokenizer_dir() -> Path:
    """A tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) for the bundled
    corpus, built on first use. The path is keyed by the corpus hash, so it is rebuilt if the
    corpus changes; concurrent ranks write to a temporary name and rename atomically."""
    digest = hashlib.sha256(DEFAULT_CORPUS.read_bytes() + f"v{VOCAB_SIZE}".encode()).hexdigest()[:12]
    target = _cache_root() / f"tokenizer-{digest}"
    if (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    build_tokenizer(DEFAULT_CORPUS, target)
    return target


def build_tokenizer(corpus: Path, target: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    try:
        os.rename(tmp, target)
    except OSError:  # another rank won the race: keep its copy
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


__all__ = ["DEFAULT_CORPUS", "default_tokenizer_dir", "register_datasets"]
