"""Prompt lookup ("ngram") drafting: find the context's last n tokens earlier in the context and propose what
followed them there. Free to run, and right whenever the output copies its input (edits, summaries, RAG).

For n from prompt_lookup_max down to prompt_lookup_min, the most recent earlier occurrence of the last n tokens
wins; its continuation (up to k tokens) is the draft. One numpy comparison of all windows per n.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedserve.services.engine.request import Request


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            find_continuation(np.asarray(r.all_token_ids), self.prompt_lookup_min, self.prompt_lookup_max, k)
            for r, k in zip(requests, max_num_tokens, strict=True)
        ]


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (n in
    [min_n, max_n]) of `tokens` [num_tokens]; [] when no suffix recurs."""
    num_tokens = tokens.shape[0]
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Windows that start before the suffix itself and have at least one token after them.
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.shape[0]:
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []
