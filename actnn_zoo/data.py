"""Real data that needs no download: scikit-learn's bundled digits and Python's own stdlib source.

Both loaders are deterministic (fixed split seed, sorted file order), so fp32, compressed and
checkpointed runs see exactly the same examples in the same order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Digits", "load_digits_data", "iterate_minibatches", "TextCorpus", "stdlib_source_text",
           "load_text_corpus", "random_windows", "sequential_windows"]


# ------------------------------------------------------------------------------- digits ----
@dataclass(frozen=True)
class Digits:
    """8x8 digit images (N, 1, 8, 8), normalised with the training set's mean and std."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    mean: float
    std: float


def load_digits_data(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """The 1797 sklearn digits, stratified train/test split with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                              stratify=y)
    x_tr = torch.tensor(x_tr, dtype=torch.float32)
    x_te = torch.tensor(x_te, dtype=torch.float32)
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def prep(a: Tensor) -> Tensor:
        return ((a - mean) / std).reshape(-1, 1, 8, 8).contiguous()

    return Digits(prep(x_tr), torch.tensor(y_tr, dtype=torch.int64), prep(x_te),
                  torch.tensor(y_te, dtype=torch.int64), mean, std)


def iterate_minibatches(x: Tensor, y: Tensor, batch_size: int, generator: Optional[torch.Generator]
                        = None, drop_last: bool = True) -> Iterator[Tuple[Tensor, Tensor]]:
    """One epoch of minibatches; shuffled by ``generator`` (its own RNG, so model-side random
    draws such as dropout or stochastic rounding never change the data order)."""
    n = x.shape[0]
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for i in range(0, stop, batch_size):
        idx = order[i:i + batch_size]
        yield x[idx], y[idx]


# --------------------------------------------------------------------------------- text ----
def stdlib_source_text(num_chars: int = 1_000_000) -> str:
    """The first ``num_chars`` characters of the standard library's top-level ``*.py`` files
    (the directory of ``os``), concatenated in sorted file-name order."""
    root = Path(os.path.dirname(os.__file__))
    parts: List[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= num_chars:
            break
    text = "\n".join(parts)[:num_chars]
    if len(text) < num_chars:
        raise ValueError(f"only {len(text)} characters of stdlib source under {root}")
    return text


@dataclass(frozen=True)
class TextCorpus:
    """Token ids for training and validation, and the vocabulary that maps them to text.

    ``chars`` is the sorted character set for a character vocabulary, or None for bytes
    (vocabulary 256, UTF-8 encoded)."""

    train: Tensor
    val: Tensor
    vocab_size: int
    chars: Optional[Tuple[str, ...]]

    def decode(self, ids: Tensor) -> str:
        if self.chars is None:
            return bytes(ids.tolist()).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in ids.tolist())


def load_text_corpus(num_chars: int = 1_000_000, vocab: str = "chars",
                     val_fraction: float = 0.1) -> TextCorpus:
    """Stdlib source as a token stream; the last ``val_fraction`` is the validation split."""
    text = stdlib_source_text(num_chars)
    if vocab == "bytes":
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        chars, size = None, 256
    elif vocab == "chars":
        chars = tuple(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
        size = len(chars)
    else:
        raise ValueError(f"vocab must be 'chars' or 'bytes', got {vocab!r}")
    split = int(len(ids) * (1 - val_fraction))
    return TextCorpus(ids[:split].clone(), ids[split:].clone(), size, chars)


def random_windows(ids: Tensor, context: int, batch_size: int, generator: torch.Generator
                   ) -> Tuple[Tensor, Tensor]:
    """A batch of random (input, next-token target) windows of length ``context``."""
    starts = torch.randint(0, ids.numel() - context - 1, (batch_size,), generator=generator)
    offsets = torch.arange(context + 1)
    win = ids[starts[:, None] + offsets]
    return win[:, :-1], win[:, 1:]


def sequential_windows(ids: Tensor, context: int, batch_size: int,
                       max_windows: Optional[int] = None) -> Iterator[Tuple[Tensor, Tensor]]:
    """Non-overlapping windows covering ``ids`` in order (for a deterministic validation loss)."""
    n = (ids.numel() - 1) // context
    if max_windows is not None:
        n = min(n, max_windows)
    x = ids[:n * context].view(n, context)
    y = ids[1:n * context + 1].view(n, context)
    for i in range(0, n, batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]
