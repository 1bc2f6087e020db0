"""Compiled grammars and the matcher each request gets.

llguidance builds a grammar's parser once (`LLMatcher`); a request takes a `deep_copy` of it, which shares
the compiled lexer and parser and costs microseconds. `GrammarCompiler` keeps the most recently used compiled
grammars, so the second request of a schema skips the compilation (an LRU, bounded in count).

The tokenizer llguidance needs (every token's bytes) is built once per process, on the first constrained
request, from the model's own tokenizer files.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import llguidance

from meshserve.structured_output.grammar import GrammarSpecError, check_grammar, first_lines
from meshserve.wire.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)
DEFAULT_CACHE_SIZE = 256


def grammar_limits() -> llguidance.LLParserLimits:
    """Bounds on the work one grammar may make the engine do: a pathological constraint (a regex such as
    `a{1000}{1000}`) puts its matcher in an error state within about 0.15 s on this class of CPU instead of
    holding a step for seconds; schemas of thousands of properties stay well inside them."""
    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=100_000, max_lexer_states=50_000)


def load_ll_tokenizer(model_dir: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer: every id in [0, vocab_size) and its end-of-sequence ids."""
    import llguidance.hf
    from transformers import AutoTokenizer  # imported here: only a process serving a constraint needs it

    started = time.perf_counter()
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                             eos_token=list(eos_token_ids) or None)
    logger.info("grammar tokenizer for %s built in %.2f s", model_dir, time.perf_counter() - started)
    return tokenizer


def first_mask_checked(matcher: llguidance.LLMatcher) -> llguidance.LLMatcher:
    """`matcher` once its first mask computed within the limits (most of a grammar's lexer is built then);
    GrammarSpecError when it cannot be."""
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise GrammarSpecError(first_lines(matcher.get_error()))
    matcher.reset()
    return matcher


def grammar_compiler_for(hf_tokenizer: object) -> GrammarCompiler:
    """A compiler over an already loaded HF fast tokenizer (the API server's)."""
    import llguidance.hf

    return GrammarCompiler(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer)))


class GrammarCompiler:
    """Compiled grammars of one tokenizer, most recently used kept; `matcher(spec)` is a request's own."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the runner's mask thread and its step thread both ask for matchers
        self.hits = 0
        self.misses = 0

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `spec`'s grammar; GrammarSpecError when it does not compile."""
        key = (spec.kind, spec.json, spec.regex, tuple(spec.choice or ()), spec.grammar, spec.lenient)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return compiled.deep_copy()
        compiled = first_mask_checked(llguidance.LLMatcher(self.tokenizer, check_grammar(spec), log_level=0,
                                                           limits=grammar_limits()))
        with self._lock:
            self.misses += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()
