"""Grammar compilation off the step loop: a small thread pool, one compile per distinct spec.

xgrammar is imported only here (and in bitmask.py), on the first request with a grammar, so the
engine core imports without it. The tokenizer is needed once, to describe the vocabulary to
xgrammar (`TokenizerInfo`); the model's vocab size may exceed the tokenizer's (padded embeddings):
the extra ids are never allowed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.shared.grammar_spec import GrammarSpec

log = logging.getLogger(__name__)
CACHE_SIZE = 512  # compiled grammars kept (a few KB to a few MB each)


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """An xgrammar CompiledGrammar for `spec`; raises ValueError (or xgrammar's errors) when invalid."""
    if spec.kind == "json":
        # Compact JSON (no free whitespace): a sampled model cannot wander off into spaces and newlines.
        return compiler.compile_json_schema(spec.value, any_whitespace=False, separators=(",", ":"))
    if spec.kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        return compiler.compile_grammar(spec.choice_ebnf())
    return compiler.compile_grammar(spec.value)


class GrammarCompilerPool:
    """Compiles specs in background threads; `submit` returns a Future shared by equal specs."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_workers: int = 2) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.tokenizer_info = info  # (sent to the grammar process, which builds matchers from compiled grammars)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            return compile_spec(self._compiler, spec)
        except Exception:
            log.warning("grammar %s failed to compile: %s", spec.kind, json.dumps(spec.value)[:200])
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
