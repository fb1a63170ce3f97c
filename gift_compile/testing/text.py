"""Local text -> fixed-length token batches, for benchmarks and tests (no network).

``load_token_ids`` tokenizes a text file with a Hugging Face ``tokenizers`` JSON file;
``TokenBatcher`` cuts next-token-prediction batches ``(inputs, targets)`` of shape
``(n_seqs, seq_len)`` out of that stream at seeded random offsets, so two batchers with
different seeds give independent batches from the same text.
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_token_ids(text_path: str | Path, tokenizer_path: str | Path, *, max_chars: int | None = None) -> torch.Tensor:
    """Token ids (1-D int64) of a text file; ``max_chars`` reads only a prefix (fast tests)."""
    from tokenizers import Tokenizer  # optional dependency (the ``titan`` extra)

    text = Path(text_path).read_text(encoding="utf-8")
    if max_chars is not None:
        text = text[:max_chars]
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.int64)
    if ids.numel() < 2:
        raise ValueError(f"{text_path}: tokenized to {ids.numel()} tokens; need at least 2")
    return ids


def vocab_size(tokenizer_path: str | Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()


class TokenBatcher:
    """Seeded random windows of ``seq_len + 1`` tokens from one token stream."""

    def __init__(self, ids: torch.Tensor, seq_len: int, *, seed: int = 0) -> None:
        if ids.dim() != 1:
            raise ValueError(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() <= seq_len + 1:
            raise ValueError(f"a stream of {ids.numel()} tokens is too short for seq_len={seq_len}")
        self.ids, self.seq_len = ids, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, n_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``(n_seqs, seq_len)``; targets are inputs shifted by one."""
        starts = torch.randint(0, self.ids.numel() - self.seq_len - 1, (n_seqs,), generator=self.generator)
        windows = self.ids[starts[:, None] + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]

    def batches(self, tokens: int, micro_seqs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches of ``micro_seqs`` sequences that together hold about ``tokens`` tokens."""
        n_seqs = max(1, round(tokens / self.seq_len))
        sizes = [micro_seqs] * (n_seqs // micro_seqs) + ([n_seqs % micro_seqs] if n_seqs % micro_seqs else [])
        return [self.batch(n) for n in sizes]
