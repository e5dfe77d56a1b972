"""Benchmark prompts: random token ids of chosen lengths, and a synthetic chat-like mix.

Prompt ids are drawn from a pool: the ids of a fixed random-word text as the tokenizer splits it
(the server's `/tokenize`, or a local tokenizer with `--tokenizer`). Both sources give the same pool
for the same tokenizer, so one seed gives the same prompts whichever is used, and the ids are
ordinary text tokens, never special ones. Text prompts (`--prompt-format text`, chat) are those ids
decoded; the server re-tokenizes them, so their lengths are close to, not exactly, the target.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

LengthDist = Literal["fixed", "uniform", "normal"]
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sta",
    "tor",
    "vel",
    "qui",
    "zen",
    "pha",
    "dro",
    "gle",
    "ing",
    "er",
    "tion",
    "ous",
    "an",
    "the",
    "re",
    "co",
    "mp",
    "ut",
    "ex",
    "pl",
    "ai",
    "ni",
    "ght",
    "sh",
    "ow",
)
_CORPUS_WORDS = 6000
_CORPUS_SEED = 1234  # fixed: the pool depends on the tokenizer only


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None  # set when prompts go out as text

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def corpus_text() -> str:
    """Made-up words, digits and punctuation: splits into many ordinary, non-special tokens."""
    rng = random.Random(_CORPUS_SEED)
    words = []
    for i in range(_CORPUS_WORDS):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        words.append(word.capitalize() if i % 11 == 0 else word)
        if i % 13 == 0:
            words.append(str(rng.randint(0, 9999)))
        if i % 17 == 0:
            words[-1] += rng.choice(".,;:!?")
    return " ".join(words)


class TokenSource:
    """Encode/decode and the id pool, from a local tokenizer or from a server's /tokenize."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], special: set[int]):
        self.encode, self.decode = encode, decode
        self.pool = sorted(set(encode(corpus_text())) - special)
        if len(self.pool) < 100:
            raise ValueError(f"the tokenizer split the corpus into only {len(self.pool)} distinct ids")

    @classmethod
    def local(cls, path: str | Path) -> TokenSource:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(path))
        return cls(
            lambda text: list(tok.encode(text, add_special_tokens=False)),
            lambda ids: str(tok.decode(ids)),
            set(tok.all_special_ids),
        )

    @classmethod
    def server(cls, base_url: str, model: str, headers: dict[str, str]) -> TokenSource:
        """vLLM's and pagedserve's `/tokenize` and `/detokenize` helper routes."""
        client = httpx.Client(base_url=base_url, headers=headers, timeout=120)

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            response = client.post(path, json={"model": model, **body})
            if response.status_code != 200:
                raise RuntimeError(
                    f"{path} answered {response.status_code}: {response.text[:300]} "
                    "(pass --tokenizer DIR to tokenize locally)"
                )
            return dict(response.json())

        encode = lambda text: list(post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])
        decode = lambda ids: str(post("/detokenize", {"tokens": ids})["prompt"])
        return cls(encode, decode, set())


def sample_length(rng: random.Random, mean: int, dist: LengthDist, range_ratio: float) -> int:
    """fixed: `mean`; uniform: in mean * [1 - r, 1 + r]; normal: sd mean * r, clipped to that range."""
    if dist == "fixed" or range_ratio <= 0:
        return mean
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    if dist == "uniform":
        return rng.randint(low, high)
    return min(high, max(low, round(rng.gauss(mean, mean * range_ratio))))


def random_requests(
    source: TokenSource, num: int, input_len: int, output_len: int, dist: LengthDist, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = sample_length(rng, input_len, dist, range_ratio)
        n_out = sample_length(rng, output_len, dist, range_ratio)
        out.append(BenchRequest(rng.choices(source.pool, k=n_in), n_out))
    return out


# (share, prompt length x, output length x) of --input-len / --output-len
CHAT_MIX = {
    "long-prompt-short-answer": (0.4, 4.0, 0.125),
    "short-prompt-long-answer": (0.4, 0.125, 2.0),
    "balanced": (0.2, 1.0, 1.0),
}


def chat_mix_requests(
    source: TokenSource, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Like chat traffic: summaries of long documents, long answers to short questions, some of both;
    lengths uniform within +-range_ratio of each kind's mean."""
    rng = random.Random(seed)
    kinds = list(CHAT_MIX.values())
    out = []
    for _ in range(num):
        _, in_x, out_x = rng.choices(kinds, weights=[k[0] for k in kinds])[0]
        n_in = sample_length(rng, max(1, round(input_len * in_x)), "uniform", range_ratio)
        n_out = sample_length(rng, max(1, round(output_len * out_x)), "uniform", range_ratio)
        out.append(BenchRequest(rng.choices(source.pool, k=n_in), n_out))
    return out


def build(
    source: TokenSource,
    kind: str,
    num: int,
    input_len: int,
    output_len: int,
    dist: LengthDist,
    range_ratio: float,
    seed: int,
    as_text: bool,
) -> list[BenchRequest]:
    if kind == "random":
        requests = random_requests(source, num, input_len, output_len, dist, range_ratio, seed)
    elif kind == "chat-mix":
        requests = chat_mix_requests(source, num, input_len, output_len, range_ratio, seed)
    else:
        raise ValueError(f"unknown dataset {kind!r}")
    if as_text:
        for request in requests:
            request.prompt_text = source.decode(request.prompt_ids)
    return requests


def fingerprint(requests: Sequence[BenchRequest]) -> str:
    """Identifies a prompt set, so that results of separate runs are only compared on the same one."""
    import hashlib

    digest = hashlib.sha256()
    for request in requests:
        digest.update(repr((request.prompt_ids, request.output_len)).encode())
    return digest.hexdigest()[:16]
