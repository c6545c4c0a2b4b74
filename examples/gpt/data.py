"""The training text, generated: a deterministic grammar of sentences about attention, nothing downloaded.

A character-level model needs a few tens of kilobytes of text with structure to learn: words that recur, a fixed
word order, punctuation. :func:`generate_text` writes sentences from a small grammar with Python's ``random.Random``
(seeded, so every machine builds the same text), and :class:`CharData` turns it into training batches.
"""

from __future__ import annotations

import random

import torch

__all__ = ["generate_text", "CharData"]

SUBJECTS = ["the query", "the key", "the value", "each block", "the kernel", "a warp", "the softmax", "the tile",
            "every row", "the outer loop", "the inner loop", "the scheduler"]
VERBS = ["reads", "writes", "scales", "loads", "keeps", "skips", "merges", "stores", "sums", "rescales", "streams",
         "masks"]
OBJECTS = ["the running max", "a block of keys", "the output", "the log-sum-exp", "the scores", "the mask",
           "every column", "the statistics", "one row of values", "the gradient", "a tile of queries"]
PLACES = ["on chip", "in sram", "from hbm", "once", "in order", "without a copy", "before the loop ends",
          "for each head"]
LINKS = ["when", "because", "while", "after", "so that"]


def _clause(rng: random.Random) -> str:
    """subject verb object [place]: the grammar's one phrase shape."""
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.5:
        words.append(rng.choice(PLACES))
    return " ".join(words)


def generate_text(n_chars: int = 40_000, seed: int = 0) -> str:
    """About ``n_chars`` characters of sentences, one or two clauses each, a paragraph break every few sentences."""
    rng = random.Random(seed)
    sentences: list[str] = []
    size = 0
    while size < n_chars:
        sentence = _clause(rng)
        if rng.random() < 0.4:
            sentence = f"{sentence} {rng.choice(LINKS)} {_clause(rng)}"
        sentence += "." + ("\n" if rng.random() < 0.2 else " ")
        sentences.append(sentence)
        size += len(sentence)
    return "".join(sentences)


class CharData:
    """A text as character ids, and random windows of it as (input, next-character target) batches.

    ``batches(steps, batch, context, seed)`` draws every window start up front from its own generator, so two
    training runs given the same seed see exactly the same batches in the same order.
    """

    def __init__(self, text: str):
        self.vocab = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.vocab)}
        self.ids = torch.tensor([self.index[ch] for ch in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batches(self, steps: int, batch: int, context: int, seed: int = 0):
        """Yield ``steps`` pairs (x, y) of shape (batch, context), y being x shifted by one character."""
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(self.ids) - context - 1, (steps, batch), generator=generator)
        offsets = torch.arange(context)
        for step_starts in starts:
            windows = step_starts[:, None] + offsets                       # (batch, context)
            yield self.ids[windows], self.ids[windows + 1]
