"""Prompt text for e2e tests, sized in tokens of the tiny-chat tokenizer (make_model.py)."""

from __future__ import annotations

import random

from .make_model import WORDS


def filler_text(n_tokens: int, seed: object) -> str:
    """About `n_tokens` tokens of pseudo-English (the tokenizer spends ~1.0 token per word of WORDS).

    `seed` picks the words and leads the text, so texts with different seeds share no cached prefix beyond the
    chat template's first few tokens, and the same seed always gives the same text.
    """
    rng = random.Random(repr(seed))
    return f"[{seed}] " + " ".join(rng.choices(WORDS, k=max(n_tokens - 8, 1)))
