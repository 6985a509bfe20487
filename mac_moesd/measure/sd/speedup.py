"""Measured speculative decoding on this machine, against plain decode of the same target.

- batch 1, ``real``: mlx-lm's own ``speculative_generate_step`` against its ``generate_step``,
  where mlx-lm rolls both models' caches back correctly (every layer a plain KV cache, or a
  sliding window the decode never fills); else the suite's loop, labelled so.
- any batch: the suite's loop (``sd_loop``), modes ``real``, ``self-draft`` and
  ``emulated-acceptance``, with a rollback correct for every cache kind (``rollback``).

Every configuration is audited once, untimed (``audit``): the caches a decode leaves must
equal plain decoding's of the same tokens, and at temperature 0 the SD output must equal plain
greedy output but for float near-ties. A configuration that fails either is marked invalid.

Prompts: a model with real weights decodes a prompt set (``inputs.prompts``: ``code``, ``chat``
or a file) through its tokenizer; pair i of the timed runs uses prompts i*B .. i*B+B-1 of the set
(cycling), each batch's prompts cut to its shortest, keeping their ends. A random-weight model
decodes random token ids of ``context`` tokens. The prompt is prefilled outside the timed region;
the timed region is decode only. Plain and speculative runs alternate on the same prompt, and the
speedup is the median of per-pair ratios (``pair_speedups``: each SD run's rounds per second at
the tokens per round all the configuration's SD runs realised together), measured to a stated
precision: pairs are added until the distribution-free 95% confidence interval of that median
(``timing.median_ci``) is within +-``precision`` of it, or the configuration's time ``budget_s``
is spent (``repeats`` is the fewest pairs). After each pair the
round's parts are timed on the same decoder (``round_parts``), so that a prediction from this
stage's own forwards stands beside the fitted model's. At temperature 0 every speculative output is compared
with the plain greedy output of the same pair (``greedy_check``); at temperature > 0 both sample,
seeded, with mlx-lm's acceptance rule. In ``real`` mode with prompts, an untimed pass over the
prompt set (``acceptance_run``) records acceptance per gamma and temperature, with both acceptance
rules at temperature > 0.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from mac_moesd.analysis import acceptance, theory
from mac_moesd.analysis.spec_runs import decoding_context, feeds_last_draft, measured_acceptance, run_alpha
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.results import ResultsStore, keys, schema
from mac_moesd.inputs import prompts as prompt_sets
from mac_moesd.inputs import zoo
from mac_moesd.machine import memory
from mac_moesd.units import human_bytes
from mac_moesd.measure.clock import timing
from mac_moesd.measure.decoding.acceptance_run import greedy_check, logit_margin, measure_acceptance
from mac_moesd.measure.decoding.mtp_head import MTPHead
from mac_moesd.measure.decoding import prompt_lookup
from mac_moesd.measure.sd.round_parts import RoundParts, lookup_prediction, round_prediction
from mac_moesd.measure.sd.audit import audit_configuration
from mac_moesd.measure.decoding.sd_loop import Decoded, Decoder, common_prompt, within
from mac_moesd.measure.caches.rolled_cache import PREFILL_CHUNK
from mac_moesd.measure.caches import rollback as rollbacks

if TYPE_CHECKING:
    from mac_moesd.inputs.models import Sources

__all__ = ["RUN_TOKENS", "SpecConfig", "require_valid", "run_spec", "stored_and_valid"]

MODES = ("real", "self-draft", "emulated-acceptance")
RANDOM_IDS = "random token ids"
LOOP = "mac-moesd loop"
# Batch 1, real mode, where mlx-lm's SD would not roll these caches back correctly.
LOOP_FOR_MLX_LM = "mac-moesd loop (mlx-lm cannot roll these caches back)"
LOOP_FOR_LOOKUP = "mac-moesd loop (mlx-lm has no prompt lookup)"
# Tokens each sequence generates per timed run, in `spec` and in every `run`. The machine's noise
# comes in phases longer than a token, so two short runs back to back share more of one phase:
# on the suite's 2-core CPU box a +-3% median of plain runs timed against themselves took 10 s of
# timed decoding at 32 tokens against 24 s at 64 (tiny-moe; its hybrid twin 73 s and 69 s), and
# the SD stage reached +-3% within its budget more often (docs/design.md §4.5). A short run
# wastes no verified token: the suite's loop counts those its last round overshot, and mlx-lm
# drafts no more than the run has left.
RUN_TOKENS = 32
# The fewest samples of a round's parts a configuration measured to its precision takes: after its
# pairs stop, the parts are timed on (within its budget) until they have this many. One sample a
# pair leaves a configuration whose CI closed at 11-16 pairs with parts whose sum strays 5-7% (a
# round's parts on tiny-moe, B=1 gamma 2, in 16-sample chunks: -5%..+7%; in 32: -2.5%..+2.8%).
PARTS_SAMPLES = 32


@dataclass(frozen=True)
class SpecConfig:
    target: str
    draft: str
    batches: tuple[int, ...] = (1, 2, 4)
    gammas: tuple[int, ...] = (2, 4)
    alphas: tuple[float, ...] = (theory.DEFAULT_ALPHA,)
    mode: str = "emulated-acceptance"
    context: int = 64  # prompt tokens of a random-weight model (real prompts set their own)
    new_tokens: int = RUN_TOKENS  # tokens each sequence generates per timed run
    repeats: int = 8  # the fewest (plain, SD) pairs a configuration takes
    precision: float = 0.03  # pairs until the median ratio's 95% CI is within +-this of it...
    budget_s: float = 120.0  # ...or this many seconds of the configuration are spent
    bits: int | None = None
    seed: int = 0
    prompts: str | None = None  # code|chat|FILE; None: code for a model with weights
    temperatures: tuple[float, ...] = (0.0,)
    max_prompts: int | None = None  # prompts of the set the acceptance pass decodes (None: all)
    rollback: str = "auto"  # rollback.STRATEGIES
    stop_when_decided: bool = False  # a quick run: stop once the CI settles "pays off" or not
    lookup: schema.LookupRule = field(default_factory=prompt_lookup.lookup_rule)  # the n-gram lengths of --draft prompt-lookup

    @property
    def lookup_rule(self) -> schema.LookupRule | None:
        """The n-gram rule the SD loop drafts with: ``lookup`` with prompt lookup, else None."""
        return self.lookup if self.drafter_kind == "prompt-lookup" else None

    @property
    def drafter_kind(self) -> str:
        """``model`` (a draft model), ``self`` (self-draft), ``prompt-lookup`` or ``mtp-head``."""
        if self.mode == "self-draft":
            return "self"
        return keys.drafter_kind(self.draft)

    def __post_init__(self):
        if self.draft == keys.PROMPT_LOOKUP and self.mode != "real":
            raise BadInput("--draft prompt-lookup proposes real tokens from the context: it runs with "
                           "--mode real only")
        if self.draft == keys.MTP_HEAD and self.mode != "emulated-acceptance":
            raise BadInput("--draft mtp-head is an emulated MTP head at the target's dimensions, whose "
                           "drafts mean nothing: it runs with --mode emulated-acceptance (--alpha) only")
        if self.mode not in MODES:
            raise BadInput(f"--mode must be one of {', '.join(MODES)}")
        if any(not 0 < a < 1 for a in self.alphas):
            raise BadInput("--alpha values must be in (0, 1)")
        if min(self.batches) < 1 or min(self.gammas) < 1 or self.new_tokens < 1 or self.repeats < 1:
            raise BadInput("--batch, --gamma, --tokens and --repeats must be >= 1")
        if not 0 < self.precision < 1 or self.budget_s <= 0:
            raise BadInput("--precision must be in (0, 1) and --budget > 0")
        if any(t < 0 for t in self.temperatures):
            raise BadInput("--temperature values must be >= 0")
        if self.mode != "real" and any(t != 0 for t in self.temperatures):
            raise BadInput("--temperature above 0 needs --mode real (other modes impose acceptance)")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise BadInput("--max-prompts must be >= 1")
        if self.rollback not in rollbacks.STRATEGIES:
            raise BadInput(f"--rollback must be one of {', '.join(rollbacks.STRATEGIES)}")


def resolve_sources(cfg: SpecConfig) -> Sources:
    """``cfg``'s target and drafter model as found on this machine."""
    from mac_moesd.inputs import models

    return models.Sources(models.resolve(cfg.target), models.resolve(cfg.draft) if cfg.drafter_kind == "model" else None)


@dataclass(frozen=True)
class PromptIds:
    """Token ids of every prompt (None: random ids), with what they are."""

    name: str  # the prompt set's name, or RANDOM_IDS
    ids: list[list[int]] | None
    encoding: str  # "chat template", "plain" or "random"

    def batch(self, index: int, batch: int) -> list[list[int]]:
        """Prompts index*batch .. index*batch+batch-1 of the set, cycling."""
        ids = self.ids
        assert ids is not None, "random ids are not a prompt set"
        return [ids[(index * batch + k) % len(ids)] for k in range(batch)]


def prompt_ids(cfg: SpecConfig, target_source, draft_source) -> PromptIds:
    """The prompts as token ids through the target's tokenizer, or random ids for random weights.
    The drafter must tokenise them alike when it has a tokenizer of its own."""
    if not target_source.has_weights:
        if cfg.prompts is not None:
            raise BadInput(f"--prompts needs a model with weights: {target_source.name} has random "
                           "weights, whose acceptance on real text means nothing")
        return PromptIds(RANDOM_IDS, None, "random")
    tokenizer = prompt_sets.load_tokenizer(target_source.weights_dir)
    if tokenizer is None:
        if cfg.prompts is not None:
            raise BadInput(f"--prompts needs a tokenizer: {target_source.weights_dir} has none")
        return PromptIds(RANDOM_IDS + " (the model has no tokenizer)", None, "random")
    prompt_set = prompt_sets.load_prompts(cfg.prompts or "code")
    ids = prompt_sets.tokenize(prompt_set, tokenizer)
    draft_tokenizer = (prompt_sets.load_tokenizer(draft_source.weights_dir)
                       if draft_source is not None and draft_source.has_weights else None)
    if draft_tokenizer is not None and prompt_sets.tokenize(prompt_set, draft_tokenizer) != ids:
        raise BadInput(f"{target_source.name} and {draft_source.name} tokenise the prompts "
                       "differently: speculative decoding needs one tokenizer")
    encoding = "chat template" if getattr(tokenizer, "has_chat_template", False) else "plain"
    return PromptIds(prompt_set.name, ids, encoding)


def settle() -> None:
    """Wait for every forward still queued. mlx-lm's ``generate_step`` queues step N+1 before it
    yields token N and does not wait for it when the loop ends, so a timed run would otherwise
    start by waiting for the previous run's leftover forward (on mlx-lm's generation stream)."""
    mx.synchronize(generation_stream)
    mx.synchronize()


@dataclass(frozen=True)
class Precision:
    """When a configuration has enough (plain, SD) pairs: at least ``min_pairs``, then once the
    95% CI of the median per-pair speedup (``timing.median_ci``) is within +-``target`` of the median, or (with
    ``stop_when_decided``, a quick run) once that CI lies wholly more than ``target`` away from
    1.0, so that more pairs would narrow the figure but not change the answer, or once
    ``budget_s`` seconds of the configuration are spent. ``parts_samples``: the fewest times
    ``paired``'s ``between`` runs (the round's parts), topped up after the pairs within the budget;
    a quick run takes one a pair (``PARTS_SAMPLES`` otherwise)."""

    min_pairs: int
    target: float
    budget_s: float
    stop_when_decided: bool = False
    parts_samples: int = 0

    @classmethod
    def of(cls, cfg: SpecConfig) -> Precision:
        return cls(cfg.repeats, cfg.precision, cfg.budget_s, cfg.stop_when_decided,
                   0 if cfg.stop_when_decided else PARTS_SAMPLES)

    def half_width(self, speedups: list[float], ci: tuple[float, float] | None = None) -> float:
        low, high = ci or timing.median_ci(speedups)
        return (high - low) / 2 / statistics.median(speedups)

    def decided(self, speedups: list[float], ci: tuple[float, float] | None = None) -> bool:
        """Whether the CI says SD pays off (above 1 + target) or does not (below 1 - target)."""
        low, high = ci or timing.median_ci(speedups)
        return low > 1 + self.target or high < 1 - self.target

    def stop_reason(self, speedups: list[float], elapsed_s: float) -> str | None:
        """Why the pairs so far are enough ("precision", "decided" or "budget"; "repeats" where
        the CI says so with fewer pairs than a 95% interval needs, ``timing.MEDIAN_CI_MIN``,
        which only a ``min_pairs`` below it allows), or None while they are not."""
        if len(speedups) < self.min_pairs:
            return None
        ci = timing.median_ci(speedups)
        reason = ("precision" if self.half_width(speedups, ci) <= self.target
                  else "decided" if self.stop_when_decided and self.decided(speedups, ci) else None)
        if reason is not None:
            return reason if len(speedups) >= timing.MEDIAN_CI_MIN else "repeats"
        return "budget" if elapsed_s >= self.budget_s else None

    def enough(self, speedups: list[float], elapsed_s: float) -> bool:
        return self.stop_reason(speedups, elapsed_s) is not None


def pooled_tokens_per_round(spec: list[Decoded]) -> float | None:
    """Tokens a round credited (all sequences), pooled over SD decodes: their tokens over their
    verify forwards; None where a decode did not count its rounds, or where its rounds differ in
    work (prompt lookup: each verifies its proposal's width, so a round that proposed nothing is
    a cheap one-token step, and its acceptance goes with its cost rather than with chance)."""
    if not spec or any(d.verifies < 1 or d.widths is not None for d in spec):
        return None
    return sum(d.tokens for d in spec) / sum(d.verifies for d in spec)


def pair_speedups(plain: list[Decoded], plain_s: list[float], spec: list[Decoded], spec_s: list[float]
                  ) -> list[float]:
    """Each pair's SD tokens/s over its plain tokens/s, the SD run's rate taken as its rounds per
    second times the tokens per round its configuration's SD runs realised together
    (``pooled_tokens_per_round``). A run's tokens per round vary with the acceptance its rounds
    happened to draw: at batch 1, gamma 4, alpha 0.7 that alone spreads a 64-token run's tokens/s
    by about 12%, more than the machine's own noise, and it is not the machine's speed. Pooled,
    the pairs spread by the timing alone, and the speedup is the one at the acceptance the runs
    realised together, which the row reports and both predictions are made at. Decodes whose
    rounds are not pooled (``pooled_tokens_per_round`` None) keep their own tokens/s."""
    per_round = pooled_tokens_per_round(spec)
    spec_rates = [(per_round * d.verifies if per_round else d.tokens) / t for d, t in zip(spec, spec_s)]
    return [r / (p.tokens / t) for r, p, t in zip(spec_rates, plain, plain_s)]


def paired(plain, speculative, prepare, precision: Precision,
           between: Callable[[int], None] | None = None
           ) -> tuple[list[float], list[float], list[Decoded], list[Decoded]]:
    """Alternate plain and speculative runs (after one warm-up of each, which compiles every
    shape), so drift and background load hit both alike, until ``precision`` says there are
    enough pairs. ``prepare(i)`` readies pair i (its prompt, caches back to the prefill) outside
    the timed region, which then waits for the device to finish all earlier work (``settle``);
    ``between(i)``, called on pair i's readied caches after its two runs, times what else the
    stage measures beside them, and again on the last pair's caches after the pairs stop until it
    has run ``precision.parts_samples`` times or the budget is spent. Returns both lists of times
    and of results."""
    def ready(index):
        prepare(index)
        settle()

    started = time.perf_counter()
    ready(0)
    plain()
    ready(0)
    speculative()
    plain_times: list[float] = []
    spec_times: list[float] = []
    plain_out: list[Decoded] = []
    spec_out: list[Decoded] = []
    speedups: list[float] = []  # all of them again after each pair: the pooled tokens per round moved
    i = 0
    while not precision.enough(speedups, time.perf_counter() - started):
        ready(i)
        start = time.perf_counter()
        plain_out.append(plain())
        plain_times.append(time.perf_counter() - start)
        ready(i)
        start = time.perf_counter()
        spec_out.append(speculative())
        spec_times.append(time.perf_counter() - start)
        speedups = pair_speedups(plain_out, plain_times, spec_out, spec_times)
        if between is not None:
            ready(i)
            between(i)
        i += 1
    samples = i
    while (between is not None and samples < precision.parts_samples
           and time.perf_counter() - started < precision.budget_s):
        ready(i - 1)
        between(i - 1)
        samples += 1
    prepare(None)
    return plain_times, spec_times, plain_out, spec_out


def summarise_pairs(plain_out: list[Decoded], plain_times, spec_out: list[Decoded], spec_times,
                    precision: Precision) -> dict:
    """Median tokens/s both ways, their CVs, and the median, range and 95% CI of the per-pair
    speedups (``pair_speedups``), with whether the CI met the precision asked for."""
    plain_rates = [d.tokens / t for d, t in zip(plain_out, plain_times)]
    spec_rates = [d.tokens / t for d, t in zip(spec_out, spec_times)]
    speedups = pair_speedups(plain_out, plain_times, spec_out, spec_times)

    def cv(rates):
        return statistics.stdev(rates) / statistics.mean(rates) if len(rates) > 1 else 0.0

    stopped = precision.stop_reason(speedups, math.inf)  # the last pair's reason to stop
    return {
        "tokens_per_s_plain": statistics.median(plain_rates),
        "tokens_per_s_sd": statistics.median(spec_rates),
        "cv_plain": cv(plain_rates),
        "cv_sd": cv(spec_rates),
        "cv_pairs": cv(speedups),
        "measured_speedup": statistics.median(speedups),
        "speedup_range": [min(speedups), max(speedups)],
        "pairs": len(speedups),
        "measured_ci": list(timing.median_ci(speedups)),
        "measured_ci_method": "order statistics",
        "pooled_tokens_per_round": pooled_tokens_per_round(spec_out),
        "precision": precision.target,
        "precision_met": stopped == "precision",
        "stopped": stopped,
        "budget_s": precision.budget_s,
    }


class Decoders:
    """One ``Decoder`` alive at a time: for pair i of a batch, built on its prompts (random ids:
    one decoder for every pair) and reset to its prefill before each use."""

    def __init__(self, target, draft, batch: int, prompts: PromptIds, context: int,
                 rng: np.random.Generator, vocab: int, random_tokens: bool = False, rollback: str = "auto",
                 lookup: schema.LookupRule | None = None):
        self.target, self.draft, self.batch, self.prompts = target, draft, batch, prompts
        self.rollback, self.vocab, self.lookup = rollback, vocab, lookup
        self.random_tokens = vocab if random_tokens else None
        self.random_prompt = (None if prompts.ids is not None
                              else mx.array(rng.integers(0, vocab, (batch, context + 1))))
        self.index: int | None = None
        self.current: Decoder | None = None

    def prepare(self, index: int | None) -> None:
        if index is None:  # done with this configuration
            if self.current is not None:
                self.current.reset()
            return
        if self.current is None or (self.prompts.ids is not None and index != self.index):
            self.current = None  # free the old caches before the new prefill
            self.current = Decoder(self.target, self.draft, self.prompt(index), self.random_tokens,
                                   self.rollback, self.vocab, self.lookup)
        else:
            self.current.reset()
        self.index = index

    def prompt(self, index: int) -> mx.array:
        """Pair ``index``'s prompt (batch, n): the caches hold its first n-1 tokens."""
        return (self.random_prompt if self.random_prompt is not None
                else common_prompt(self.prompts.batch(index, self.batch)))

    def mlx_lm_can_run(self, new_tokens: int, gamma: int) -> bool:
        """Whether mlx-lm's batch-1 SD rolls both models' caches back correctly over the longest
        decode of these prompts (``rollback.mlx_lm_can_roll_back``); never for prompt lookup,
        which mlx-lm does not have."""
        if self.lookup is not None:
            return False
        longest = self.prompt(0).shape[1] if self.prompts.ids is None else max(map(len, self.prompts.ids))
        self.prepare(0)
        caches = self.decoder.target_cache + self.decoder.draft_cache
        return rollbacks.mlx_lm_can_roll_back(caches, longest + new_tokens + gamma + 1)

    def greedy_margin(self, plain_out: list[Decoded]):
        """``greedy_check``'s ``margin_of`` for pairs decoded from ``prompt(i)``."""
        def margin(i: int, row: int, at: int) -> tuple[float, bool]:
            decoded = plain_out[i].outputs
            assert decoded is not None
            return logit_margin(self.target, self.prompt(i)[row], decoded[row], at, self.vocab)

        return margin

    @property
    def decoder(self) -> Decoder:
        """The decoder ``prepare`` readied."""
        assert self.current is not None, "no decoder prepared"
        return self.current

    @property
    def context(self) -> int:
        return self.decoder.context

    def parts_timer(self, parts: RoundParts | None, temperature: float = 0.0) -> Callable[[int], None] | None:
        """``paired``'s ``between``: one sample of each of the round's parts on the current
        decoder's caches, in an order shuffled from a fixed seed (the empty round choosing its
        tokens as the decoder does at ``temperature``)."""
        if parts is None:
            return None
        order = random.Random(0)
        return lambda index: parts.time(self.target, self.draft, self.decoder.target_rolled,
                                        self.decoder.draft_rolled, order,
                                        lambda logits: self.decoder.emit(logits, temperature))


def shared_sampler(temperature: float, vocab: int | None):
    """mlx-lm's sampler at ``temperature``, choosing among the first ``vocab`` ids (``Decoder``)."""
    sampler = make_sampler(temp=temperature)
    return lambda logprobs: sampler(within(logprobs, vocab))


def mlx_lm_speculative(d: Decoder, gamma: int, new_tokens: int, sampler) -> Decoded:
    """One batch-1 decode by mlx-lm's ``speculative_generate_step`` on the decoder's caches."""
    steps = list(speculative_generate_step(
        d.pending[0], d.target, d.draft, num_draft_tokens=gamma, max_tokens=new_tokens,
        sampler=sampler, prompt_cache=d.target_cache + d.draft_cache))
    flags = [bool(flag) for _, _, flag in steps]
    outputs = np.array([[t for t, _, _ in steps]])
    return Decoded(new_tokens, acceptance.mlx_lm_rounds(flags, gamma, new_tokens), outputs,
                   verifies=acceptance.mlx_lm_verifies(flags))


def mlx_lm_batch1(decoders: Decoders, new_tokens: int, gamma: int, temperature: float,
                  precision: Precision, parts: RoundParts | None = None,
                  ) -> tuple[dict, list[Decoded], list[Decoded]]:
    """Batch 1 with mlx-lm's own speculative decoding against its own plain decode, on the
    decoder's prefilled caches (``prompt_cache``: the target's layers, then the drafter's);
    ``parts`` times the round's forwards after each pair."""
    sampler = shared_sampler(temperature, decoders.vocab)
    contexts: dict[int, int] = {}

    def prepare(index):
        decoders.prepare(index)
        if index is not None:
            contexts[index] = decoders.context

    def plain():
        d = decoders.decoder
        tokens = [t for t, _ in generate_step(d.pending[0], d.target, max_tokens=new_tokens,
                                              sampler=sampler, prompt_cache=d.target_cache)]
        return Decoded(new_tokens, outputs=np.array([tokens]))

    def spec():
        return mlx_lm_speculative(decoders.decoder, gamma, new_tokens, sampler)

    plain_times, spec_times, plain_out, spec_out = paired(plain, spec, prepare, precision,
                                                          decoders.parts_timer(parts, temperature))
    row = summarise_pairs(plain_out, plain_times, spec_out, spec_times, precision)
    row["plain_step_s"] = statistics.median(plain_times) / new_tokens
    return {**row, "engine": "mlx-lm", "context": statistics.mean(contexts.values())}, plain_out, spec_out


def loop_run(decoders: Decoders, cfg: SpecConfig, gamma: int, alpha: float | None, temperature: float,
             rng: np.random.Generator, parts: RoundParts | None = None) -> tuple[dict, list[Decoded], list[Decoded]]:
    """The suite's loop at the decoders' batch, paired with its plain decode; ``parts`` times
    the round's forwards after each pair."""
    contexts: dict[int, int] = {}  # each pair's prompt's

    def prepare(index):
        decoders.prepare(index)
        if index is not None:
            contexts[index] = decoders.context

    plain_times, spec_times, plain_out, spec_out = paired(
        lambda: decoders.decoder.plain(cfg.new_tokens, temperature),
        lambda: decoders.decoder.speculative(cfg.new_tokens, gamma, cfg.mode, alpha, temperature, rng=rng),
        prepare, Precision.of(cfg), decoders.parts_timer(parts, temperature))
    row = summarise_pairs(plain_out, plain_times, spec_out, spec_times, Precision.of(cfg))
    row["plain_step_s"] = statistics.median(plain_times) / cfg.new_tokens
    return {**row, "engine": LOOP, "context": statistics.mean(contexts.values())}, plain_out, spec_out


def estimate(cfg: SpecConfig, target, draft, context: int | None = None) -> dict:
    """Peak memory of the run at its largest batch and gamma (``memory.spec_estimate``), at
    ``context`` prompt tokens (default ``cfg.context``)."""
    return memory.spec_estimate(target, draft, max(cfg.batches), max(cfg.gammas), context or cfg.context,
                                cfg.new_tokens, PREFILL_CHUNK,
                                cfg.drafter_kind == "model" and cfg.mode == "real" and 1 in cfg.batches,
                                mtp_head=cfg.drafter_kind == "mtp-head")


def plan_models(cfg: SpecConfig, available_bytes: int | None, dtype: str | None = None,
                context: int | None = None, sources: Sources | None = None):
    """Target and drafter, built lazily, at full depth if they fit with two caches per batch;
    else both cut to the same fraction of their layers (halving the target's) so the cost of a
    draft step relative to a target step stays about the same; else refuse. Nothing allocated."""
    from mac_moesd.inputs import models

    sources = sources or resolve_sources(cfg)
    target_src, draft_src = sources.target, sources.draft
    full = int(target_src.config["num_hidden_layers"])
    draft_full = int(draft_src.config["num_hidden_layers"]) if draft_src else 0
    unit = zoo.slice_unit(target_src.config)

    @functools.lru_cache(maxsize=None)
    def at(layers: int):
        target = models.build(target_src, dtype, cfg.bits, layers, seed=cfg.seed)
        draft = None
        if draft_src is not None:
            draft_layers = max(1, round(draft_full * layers / full))
            draft = models.build(draft_src, dtype, cfg.bits, draft_layers, seed=cfg.seed + 1)
        return target, draft, estimate(cfg, target, draft, context)

    def fits(layers: int) -> bool:
        return available_bytes is None or at(layers)[2]["peak_bytes"] <= available_bytes

    layers = zoo.largest_slice(full, unit, fits)
    if not fits(layers):
        assert available_bytes is not None  # fits() passes any slice without a limit
        raise MacMoesdError(
            f"SD of {target_src.name} needs about {human_bytes(at(layers)[2]['peak_bytes'])} even with "
            f"{'one layer' if layers == 1 else f'{layers} layers (its smallest slice)'}; "
            f"{human_bytes(available_bytes)} is usable here: try --bits 4, a "
            "smaller --batch or --context, or a larger --memory-limit")
    return at(layers)


def acceptance_fields(per_round: list[int], gamma: int, proposed: list[int] | None = None) -> dict:
    """The acceptance a timed run measured (mean accepted length, sigma, per-position rates and
    the alpha solved from the mean, never accepted/drafted), or Nones without a full round;
    ``proposed``: the draft tokens each round offered, where that varies (prompt lookup)."""
    if not per_round:
        return {"measured_alpha": None, "mean_accepted": None, "sigma": None,
                "acceptance_by_position": None, "rounds": 0}
    measured = acceptance.summarise_rounds(per_round, gamma, proposed)
    return {"measured_alpha": measured["alpha"], "mean_accepted": measured["mean_accepted"],
            "sigma": measured["sigma"], "acceptance_by_position": measured["acceptance_by_position"],
            "rounds": measured["rounds"]}


def rules_worth(entry: dict, row: Mapping[str, Any], predictor, batch: int, context: float) -> schema.Rules:
    """What exact rejection sampling would change against mlx-lm's rule for a timed run at
    temperature > 0: each rule's expected alpha and sigma on the prompt set, the predicted
    speedup under each, and the measured speedup scaled by their ratio of tokens per round
    (the cost per round is the same; rejection sampling's own step is not counted)."""
    def worth(stats: dict) -> schema.RuleStats:
        predicted = (predictor(batch, entry["gamma"], stats["alpha"], False, context)
                     if predictor else None)
        return {"alpha": stats["alpha"], "sigma": stats["sigma"],
                "mean_accepted": stats["mean_accepted"], "predicted_speedup": predicted}

    rules = entry["rules"]  # acceptance.RULES
    return {"ratio_tokens_per_round": entry["rejection_over_mlx_lm"],
            "projected_speedup_rejection": row["measured_speedup"] * entry["rejection_over_mlx_lm"],
            "mlx-lm": worth(rules["mlx-lm"]), "rejection": worth(rules["rejection"])}


def recommended_gamma(predictor, batch: int, alpha: float | None, context: float) -> int | None:
    """The draft length with the highest predicted speedup at ``alpha`` (None: no predictor or
    no acceptance), so that the stage times the configuration a verdict would recommend."""
    if predictor is None or alpha is None:
        return None
    best = theory.best_gamma(lambda g: predictor(batch, g, alpha, False, context))
    return None if best is None else best[0]


def predictions(run: Mapping[str, Any], parts: RoundParts, predictor, sweep_step, realised: float | None,
                decoding: float, self_draft: bool, timed_drafter: bool = False) -> schema.SpecRun:
    """A run's predicted speedup from this stage's own forwards (``measured``) and from the
    fitted model (``model``); ``predicted_speedup`` is the first that exists, ``predicted_from``
    says which. ``plain_vs_sweep``: the stage's plain step over the sweep's pipelined T_T(B,1).
    ``timed_drafter`` (an MTP head, which no sweep times): the model prices the drafter's steps
    and rejection sampling as this stage timed them (a fit without a drafter has none), the rest
    of the round as fitted."""
    medians, loop = (parts.medians() if parts.samples else {}), feeds_last_draft(run)
    measured = (round_prediction(medians, run["plain_step_s"], realised, run["gamma"], run["batch"],
                                 catch_up=bool(loop))
                if realised is not None and medians else None)
    step = ({"draft_step": medians["draft"] / run["gamma"], "reject": medians.get("reject")}
            if timed_drafter and medians else {})
    model = (predictor(run["batch"], run["gamma"], realised, self_draft, decoding, catch_up=loop, **step)
             if predictor and realised is not None and (step or not timed_drafter) else None)
    return _prediction_record(run, parts, measured, model, predictor, sweep_step)


def _prediction_record(run: Mapping[str, Any], parts: RoundParts, measured: dict | None, model: float | None,
                       predictor, sweep_step) -> schema.SpecRun:
    """``predictions``' fields from the timed parts' account of the round and the model's S,
    which names the fit it came from (``fit.FitPredictor.fitted_at``) so that a reader can tell
    it from a later fit's."""
    by: schema.PredictedBy = {"measured": measured["speedup"] if measured else None, "model": model,
                              "fit": getattr(predictor, "fitted_at", None) if model is not None else None}
    swept = sweep_step(run["batch"]) if sweep_step else None
    return {"predicted_speedup": by["measured"] if by["measured"] is not None else model,
            "predicted_from": "measured" if by["measured"] is not None else ("model" if model else None),
            "predicted_by": by,
            "round": {**parts.to_dict(), **measured, "measured_s": measured_round_s(run)} if measured else None,
            "plain_vs_sweep": run["plain_step_s"] / swept if swept else None}


def _lookup_rounds(d: Decoded) -> tuple[list[int], list[int]]:
    """A prompt-lookup decode's ``proposed`` and ``widths`` (which every such decode records)."""
    assert d.proposed is not None and d.widths is not None, "not a prompt-lookup decode"
    return d.proposed, d.widths


def lookup_record(rule: schema.LookupRule, decodes: list[Decoded]) -> schema.LookupRecord:
    """What prompt lookup proposed over a run's timed SD decodes: the n-gram lengths, the share of
    (sequence, round)s with a proposal, the mean proposal where there was one, the mean verify
    width (the batch's longest proposal) and the share of rounds that rolled back."""
    proposed = np.array([n for d in decodes for n in _lookup_rounds(d)[0]])
    widths = [w for d in decodes for w in _lookup_rounds(d)[1]]
    return {**rule, "proposal_rate": float((proposed > 0).mean()),
            "mean_proposal": float(proposed[proposed > 0].mean()) if (proposed > 0).any() else 0.0,
            "mean_width": float(np.mean(widths)),
            "rolled_back_share": sum(d.rounds_rolled_back for d in decodes) / len(widths)}


def lookup_predictions(run: Mapping[str, Any], parts: RoundParts, decodes: list[Decoded], predictor, sweep_step,
                       decoding: float) -> schema.SpecRun:
    """``predictions`` for prompt-lookup rounds (``round_parts.lookup_prediction``), at the
    tokens per round, verify widths and rollbacks the run measured; the fitted model's from
    its T_T at each width with the lookup's timed host cost (``fit.lookup_predictor``)."""
    widths = [w for d in decodes for w in _lookup_rounds(d)[1]]
    tokens_per_round = run["mean_accepted"] + 1
    parts.lookup_samples(decodes)
    rolled = run["lookup"]["rolled_back_share"]
    measured = lookup_prediction(parts, run["plain_step_s"], widths, tokens_per_round, rolled)
    model = (predictor(run["batch"], widths, tokens_per_round, measured["draft_s"], rolled, decoding)
             if predictor else None)
    return _prediction_record(run, parts, measured, model, predictor, sweep_step)


def measured_round_s(run: Mapping[str, Any]) -> float | None:
    """The round as measured end to end: the tokens a round gives every sequence (mean accepted
    + 1) over the SD tokens per second of one sequence; the figure the priced parts should sum to."""
    if run.get("mean_accepted") is None or not run.get("tokens_per_s_sd"):
        return None
    return (run["mean_accepted"] + 1) * run["batch"] / run["tokens_per_s_sd"]


def recommendations(cfg: SpecConfig, predictor, context: int, partial: dict) -> set[tuple]:
    """(batch, temperature, imposed alpha or None, gamma) of every configuration a verdict would
    recommend: the best gamma by ``predictor`` at each imposed alpha (emulated acceptance), or at
    each acceptance the pass measured on the prompt set as the verdict pools it (``partial``: the
    document's acceptance so far), at the document's context. Empty without a predictor."""
    if predictor is None or cfg.drafter_kind != "model":
        return set()
    if cfg.mode == "emulated-acceptance":
        targets: list[tuple[float, float | None, float | None]] = [
            (t, a, a) for t in cfg.temperatures for a in cfg.alphas]
    else:
        targets = [(row["temperature"], None, row["alpha"]) for row in measured_acceptance(partial)
                   if row["rule"] != "rejection"]
    out = set()
    for temperature, imposed, alpha in targets:
        for batch in cfg.batches:
            best = recommended_gamma(predictor, batch, alpha, context)
            if best is not None:
                out.add((batch, temperature, imposed, best))
    return out


class ConfigurationTimer:
    """Times one (batch, temperature, gamma, alpha) configuration of a spec run: its pairs to the
    configuration's precision, the round's parts beside them, and the run's record with both
    predictions."""

    def __init__(self, cfg: SpecConfig, target, draft, inputs: PromptIds, vocab: int, rng, predictor,
                 sweep_step, accepted_on_set: dict):
        self.cfg, self.target, self.draft, self.inputs, self.vocab, self.rng = cfg, target, draft, inputs, vocab, rng
        self.predictor, self.sweep_step, self.accepted_on_set = predictor, sweep_step, accepted_on_set

    def decoders(self, batch: int) -> Decoders:
        return Decoders(self.target, self.draft, batch, self.inputs, self.cfg.context, self.rng, self.vocab,
                        random_tokens=self.cfg.mode == "emulated-acceptance", rollback=self.cfg.rollback,
                        lookup=self.cfg.lookup_rule)

    def grid(self, configurations: list[tuple]) -> list[schema.SpecRun]:
        """Every (batch, temperature, alpha, gamma) in order, one batch's decoders alive at a time."""
        runs: list[schema.SpecRun] = []
        for batch in dict.fromkeys(c[0] for c in configurations):
            decoders = self.decoders(batch)
            runs += [self.run(decoders, g, t, a) for b, t, a, g in configurations if b == batch]
            del decoders
            memory.release()
        return runs

    def run(self, decoders: Decoders, gamma: int, temperature: float, alpha: float | None) -> schema.SpecRun:
        cfg, batch = self.cfg, decoders.batch
        mx.random.seed(cfg.seed)  # the same samples for every configuration
        mlx_lm = (batch == 1 and cfg.mode == "real" and cfg.rollback == "auto"
                  and decoders.mlx_lm_can_run(cfg.new_tokens, gamma))
        parts = RoundParts(batch, gamma, self.vocab, with_reject=cfg.mode == "emulated-acceptance",
                           rollback=cfg.rollback, mode=cfg.mode, mlx_lm=mlx_lm)
        if mlx_lm:
            row, plain_out, spec_out = mlx_lm_batch1(decoders, cfg.new_tokens, gamma, temperature,
                                                     Precision.of(cfg), parts)
        else:
            row, plain_out, spec_out = loop_run(decoders, cfg, gamma, alpha, temperature, self.rng, parts)
            if batch == 1 and cfg.mode == "real":
                row["engine"] = LOOP_FOR_LOOKUP if decoders.lookup else LOOP_FOR_MLX_LM
        lookup = decoders.lookup is not None
        measured = acceptance_fields([n for d in spec_out for n in d.per_round], gamma,
                                     [n for d in spec_out for n in _lookup_rounds(d)[0]] if lookup else None)
        effective = alpha if alpha is not None else measured["measured_alpha"]
        # The cache grows from the prompt by new_tokens over the decode: predict at its mean.
        decoding = decoding_context(row["context"], cfg.new_tokens)
        realised = run_alpha({"alpha": effective, **measured})
        run: schema.SpecRun = {"batch": batch, "gamma": gamma, "alpha": effective, "mode": cfg.mode,
               "drafter_kind": cfg.drafter_kind, "prompts": self.inputs.name, "temperature": temperature,
               **measured, "repeats": cfg.repeats,
               "asked": gamma in cfg.gammas,  # else timed because the fit recommends it
               **row}
        if lookup:
            run["lookup"] = lookup_record(cfg.lookup, spec_out)
            run.update(lookup_predictions(run, parts, spec_out, self.predictor, self.sweep_step, decoding))
        else:
            run.update(predictions(run, parts, self.predictor, self.sweep_step, realised, decoding,
                                   cfg.mode == "self-draft", timed_drafter=cfg.drafter_kind == "mtp-head"))
        if temperature == 0 and cfg.mode != "emulated-acceptance":
            run["greedy_check"] = greedy_check([(s.outputs, p.outputs) for s, p in zip(spec_out, plain_out)],
                                               decoders.greedy_margin(plain_out))
        decode = ((lambda d: mlx_lm_speculative(d, gamma, cfg.new_tokens, shared_sampler(temperature, self.vocab)))
                  if mlx_lm else
                  (lambda d: d.speculative(cfg.new_tokens, gamma, cfg.mode, alpha, temperature, rng=self.rng)))
        run["rollback"] = audit_configuration(decoders, decode, exact=not mlx_lm)
        run["valid"] = run["rollback"]["audit"]["ok"] and run.get("greedy_check", {}).get("valid", True)
        entry = self.accepted_on_set.get((gamma, temperature))
        if entry is not None and temperature > 0 and "rules" in entry:
            run["rules"] = rules_worth(entry, run, self.predictor, batch, decoding)
        return run


def run_spec(cfg: SpecConfig, predictor=None, available_bytes: int | None = None,
             sweep_step: Callable[[int], float | None] | None = None,
             sources: Sources | None = None, store: ResultsStore | None = None) -> schema.SpecDocument:
    """Measure every (batch, temperature, gamma, alpha), the document saved into ``store`` where
    one is given (invalid or not: ``require_valid`` refuses it after); ``predictor(batch, gamma, alpha,
    self_draft, context)`` gives the fitted model's speedup for the same configuration at this
    run's context, or None; ``sweep_step(batch)`` the sweep's pipelined T_T(B,1), or None. A
    target and drafter too big for ``available_bytes`` are measured on slices (``plan_models``),
    without a prediction: the fit predicts the full model.

    Beside the gammas asked for, each batch also times the gamma the fitted model recommends at
    the acceptance measured on the prompt set (or imposed), so a recommendation is never an
    untimed one.

    Every run records its acceptance as measured: mean accepted draft tokens per round, sigma,
    acceptance by position and the alpha solved from the mean; modes without an imposed alpha
    predict with the solved one.

    The document: ``target``, ``draft``, ``context`` (random ids: prompt tokens; real prompts:
    their mean over runs), ``new_tokens``, ``prompts`` (``name``, ``encoding``, ``count``,
    ``tokens`` [min, max]), ``temperatures``, ``runs``, ``acceptance``, ``layers``, ``memory``.
    A run: ``batch``, ``gamma``, ``temperature``, ``prompts`` (the set's name), ``mode``,
    ``engine``, ``context``, ``alpha`` (imposed, or solved from ``mean_accepted``),
    ``acceptance_by_position``, ``sigma``, ``rounds``, ``measured_speedup``,
    ``predicted_speedup``, tokens/s and CVs; ``greedy_check`` at temperature 0 (not emulated);
    ``rules`` at temperature > 0 with prompts (``rules_worth``). ``acceptance`` (``real`` mode
    with prompts): one ``acceptance_run.measure_acceptance`` entry per gamma and temperature."""
    rng = np.random.default_rng(cfg.seed)
    sources = sources or resolve_sources(cfg)
    if store is not None:
        sources.claim(store)
    target, draft, inputs, need, vocab = prepare_models(cfg, available_bytes, sources)
    if target.layers < target.layers_full:
        predictor = None  # the fit predicts the full model, not a slice
    # No drafter model: prompt lookup (None), or an MTP head built on the target.
    draft_model = draft.model if draft is not None else (
        _head(target.model) if cfg.drafter_kind == "mtp-head" else None)
    accepted_on_set = acceptance_pass(cfg, target.model, draft_model, inputs, vocab)
    timer = ConfigurationTimer(cfg, target.model, draft_model, inputs, vocab, rng, predictor, sweep_step,
                               accepted_on_set)
    alphas = cfg.alphas if cfg.mode == "emulated-acceptance" else (None,)
    runs = timer.grid([(b, t, a, g) for b in cfg.batches for t in cfg.temperatures for a in alphas
                       for g in cfg.gammas])
    context = cfg.context if inputs.ids is None else round(statistics.mean(r["context"] for r in runs))
    # The configurations the fit recommends, as the verdict will choose them, timed where not yet.
    wanted = recommendations(cfg, predictor, context, {"acceptance": list(accepted_on_set.values()),
                                                       "prompts": {"name": inputs.name}, "runs": []})
    runs += timer.grid(sorted((w for w in wanted if not any(_is(r, w) for r in runs)),
                              key=lambda w: (w[0], w[1], w[3])))
    for run in runs:
        run["recommended"] = any(_is(run, w) for w in wanted)
    document: schema.SpecDocument = {
        "target": target.source.name,
        # The resolved name (a folder's, not the path given), as keys use it; or the kind's name.
        "draft": draft.source.name if draft is not None else cfg.draft,
        "drafter_kind": cfg.drafter_kind,
        **({"lookup": cfg.lookup} if cfg.drafter_kind == "prompt-lookup" else {}),
        # With prompts, the prompt tokens prefilled, averaged over the runs (each run has its own).
        "context": context,
        "new_tokens": cfg.new_tokens, "verify_tokens": "gamma+1",
        "prompts": {"name": inputs.name, "encoding": inputs.encoding,
                    "count": len(inputs.ids) if inputs.ids else None,
                    "tokens": ([min(map(len, inputs.ids)), max(map(len, inputs.ids))]
                               if inputs.ids else None)},
        "temperatures": list(cfg.temperatures),
        "runs": runs,
        "acceptance": list(accepted_on_set.values()),
        "layers": {"target": target.layers, "target_full": target.layers_full,
                   "draft": draft.layers if draft is not None else (1 if draft_model is not None else None),
                   "draft_full": draft.layers_full if draft is not None else None,
                   "sliced": target.layers < target.layers_full},
        "memory": memory.record(need, available_bytes),
    }
    document["valid"] = (all(run["valid"] for run in runs) and all(
        entry["greedy_check"]["valid"] for entry in document["acceptance"] if "greedy_check" in entry))
    del target, draft
    memory.release()
    if store is not None:
        store.put("spec", keys.spec_document_key(document, cfg.mode), document)
    return document


def require_valid(document: schema.SpecDocument) -> None:
    """Refuse, once the document is stored, a spec run any configuration of which failed its
    audit: a run stage then fails with the reason, and its report marks the runs invalid."""
    if document.get("valid") is False:
        raise MacMoesdError("a configuration failed its SD audit (rollback or greedy check): its speedup "
                            "is not a measurement of speculative decoding; the report marks it INVALID")


def stored_and_valid(data: dict, key: str) -> bool:
    """Whether the results hold the spec document ``key``, not marked invalid (a run stage's
    ``done``: an invalid one is measured again)."""
    return key in data.get("spec", {}) and data["spec"][key].get("valid") is not False


def _is(run: Mapping[str, Any], configuration: tuple) -> bool:
    """Whether a run is the configuration (batch, temperature, imposed alpha or None, gamma)."""
    batch, temperature, alpha, gamma = configuration
    return ((run["batch"], run["temperature"], run["gamma"]) == (batch, temperature, gamma)
            and (alpha is None or run["alpha"] == alpha))


def _head(target) -> MTPHead:
    """An emulated MTP head on ``target``, its own weights materialised."""
    head = MTPHead(target)
    mx.eval(head.parameters())
    return head


def prepare_models(cfg: SpecConfig, available_bytes: int | None, sources: Sources):
    """(target, drafter, prompt ids, memory estimate, shared vocabulary) of a spec run, the models
    materialised at the depth that fits; refuses what cannot be measured meaningfully."""
    target_src, draft_src = sources.target, sources.draft
    inputs = prompt_ids(cfg, target_src, draft_src)
    if cfg.drafter_kind == "prompt-lookup" and inputs.ids is None:
        raise BadInput(f"--draft prompt-lookup needs real text: {target_src.name} decodes random token "
                       "ids here, whose repeats say nothing about a real context's")
    longest = max(map(len, inputs.ids)) if inputs.ids else None
    target, draft, need = plan_models(cfg, available_bytes, context=longest, sources=sources)
    if target.layers < target.layers_full and inputs.ids is not None and cfg.mode == "real":
        raise MacMoesdError(
            f"{target_src.name} and its drafter fit in memory only as slices of their layers, "
            "and a sliced trained model drafts and accepts nothing meaningful: use --mode "
            "emulated-acceptance, --bits 4, a smaller --batch, or a larger --memory-limit")
    memory.start_stage()
    target.materialise()
    if cfg.drafter_kind in keys.DRAFTER_KINDS:  # no drafter model (the head is built on the target)
        return target, None, inputs, need, target.config["vocab_size"]
    if cfg.mode == "self-draft":
        draft = target
    else:
        draft.materialise()
    vocab = min(target.config["vocab_size"], draft.config["vocab_size"])
    if inputs.ids is None and draft.config["vocab_size"] != target.config["vocab_size"]:
        raise BadInput("target and drafter must share a vocabulary size")
    # Embedding tables may be padded differently (one tokenizer); every prompt id must fit both.
    if inputs.ids is not None and max(max(ids) for ids in inputs.ids) >= vocab:
        raise BadInput(f"the prompts hold token ids past the drafter's or target's vocabulary ({vocab})")
    return target, draft, inputs, need, vocab


def acceptance_pass(cfg: SpecConfig, target, draft, inputs: PromptIds, vocab: int) -> dict:
    """The untimed pass over the prompt set (``real`` mode with prompts): one
    ``measure_acceptance`` entry per (gamma, temperature); empty otherwise."""
    if cfg.mode != "real" or inputs.ids is None:
        return {}
    prompts = inputs.ids[: cfg.max_prompts]
    return {(gamma, temperature): measure_acceptance(target, draft, prompts, gamma, temperature,
                                                     cfg.new_tokens, cfg.seed, cfg.rollback, vocab, cfg.lookup_rule)
            for temperature in cfg.temperatures for gamma in cfg.gammas}
