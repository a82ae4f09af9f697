"""Structured outputs on the worker: building each constrained sequence's grammar matcher off the step
thread, and the forbidden-token masks of a step's constrained sample rows (docs/architecture.md,
"Structured outputs").

Matchers are built on their own threads (a large grammar, or a recomputed sequence's rebuild over many
outputs, takes a while) beside the steps, which never wait for one (workers/preparation.py).
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from phaseserve import grammar
from phaseserve.workers.preparation import Preparation
from phaseserve.workers.sequence_state import SequenceState

DEFAULT_GRAMMAR_PREPARE_TIMEOUT_S = 10.0  # the worker's --grammar-prepare-timeout
# threads building matchers: one request's long build does not hold every other constrained request's
GRAMMAR_THREADS = 2

# (sample rows, their forbidden tokens, the error of each constrained entry that has one)
EntryMasks = tuple[list[int], torch.Tensor, dict[int, str | None]]


class GrammarMasks:
    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int],
                 prepare_timeout: float = DEFAULT_GRAMMAR_PREPARE_TIMEOUT_S):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.prepare_timeout = prepare_timeout
        self._tokenizer_json = os.path.join(str(model_dir), "tokenizer.json")
        self._threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        # computes half of a step's masks beside the model thread when torch runs on more than one core
        self._mask_helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") \
            if torch.get_num_threads() > 1 else None
        self.histogram = grammar.MaskHistogram()  # since the last step result

    def warm_up(self) -> None:
        """Start building the engine's index of the vocabulary, so the first constrained request does not
        wait for it."""
        if os.path.isfile(self._tokenizer_json):
            self._threads.submit(self._engine_tokenizer)

    def prepare(self, spec, output_ids: list[int]) -> Preparation:
        """A sequence's matcher, building on a grammar thread from now on."""
        return Preparation(self._threads, functools.partial(self.build_matcher, spec, list(output_ids)),
                           self.prepare_timeout)

    def take(self) -> list[float]:
        """StepResult.grammar_masks of the masks computed since the last call ([] when none)."""
        return self.histogram.take()

    def _engine_tokenizer(self):
        return grammar.engine_tokenizer(self._tokenizer_json, self.vocab_size, tuple(sorted(self.eos_token_ids)))

    def build_matcher(self, spec, output_ids: list[int]) -> grammar.GrammarMatcher:
        """On a grammar thread: the sequence's matcher, advanced over the outputs it already has, and its first
        mask computed once (the engine's costly first look at a grammar happens here, not in a step; a
        grammar it refuses there is an error the step reports)."""
        matcher = grammar.GrammarMatcher(spec, self._engine_tokenizer(), output_ids)
        if matcher.error is None:
            grammar.fill_masks([matcher], grammar.allocate_masks(1, self.vocab_size))
        return matcher

    @staticmethod
    def cut_to_grammar(seq: SequenceState, drafts: list[int]) -> None:
        """A constrained sequence verifies only the drafts its grammar allows (none while its matcher is still
        being built), so every position verified has a mask and every token kept is valid."""
        if seq.matcher is None:
            return
        m = seq.matcher.result() if seq.matcher.done() else None
        n = m.accepted_prefix(drafts) if m is not None and m.error is None else 0
        del drafts[n:]

    def _masks(self, futures: list[Preparation]) -> tuple[torch.Tensor, list[str | None]]:
        """The forbidden tokens of each constrained row ([B, vocab] bool), and per row the error of a matcher
        that could not be built or advanced (None: fine). Every preparation given is done."""
        matchers, errors = [], []
        for f in futures:
            try:
                m = f.result()
                errors.append(m.error)
            except Exception as e:  # the gateway checked the grammar: this is a worker-side failure
                m, _ = None, errors.append(f"grammar: {e}")
            matchers.append(m)
        ok = [m for m, e in zip(matchers, errors) if e is None]
        masks = grammar.allocate_masks(len(matchers), self.vocab_size)
        if len(ok) == len(matchers):
            seconds = grammar.fill_masks(ok, masks, self._mask_helper)
        elif ok:  # a failed row keeps everything allowed; it is not sampled from
            rows = torch.tensor([i for i, e in enumerate(errors) if e is None])
            part = masks[rows].contiguous()
            seconds = grammar.fill_masks(ok, part, self._mask_helper)
            masks[rows] = part
        if ok:
            self.histogram.add(seconds / len(ok), len(ok))
        return grammar.disallowed_tokens(masks, self.vocab_size), errors

    def entry_masks(self, entries: list[int], sampling: list[tuple[SequenceState, list[int]]],
                    first_row: list[int]) -> list[EntryMasks]:
        """The masks of the constrained `entries` of a step's sampling: a plain decode's one row, or a
        verification's row per position (its drafts are left only to a built matcher that allows them,
        cut_to_grammar)."""
        plain = [k for k in entries if not sampling[k][1]]
        out = []
        if plain:
            disallowed, errs = self._masks([sampling[k][0].matcher for k in plain])
            out.append(([first_row[k] for k in plain], disallowed, dict(zip(plain, errs))))
        for k in entries:
            seq, d = sampling[k]
            if d:
                t = time.perf_counter()
                masks = grammar.allocate_masks(1 + len(d), self.vocab_size)
                seq.matcher.result().fill_proposal_masks(d, masks)
                self.histogram.add((time.perf_counter() - t) / (1 + len(d)), 1 + len(d))
                out.append((list(range(first_row[k], first_row[k] + 1 + len(d))),
                            grammar.disallowed_tokens(masks, self.vocab_size), {}))
        return out
