"""Measured speculative decoding on this machine, against plain decode of the same target.

- batch 1, ``real``: mlx-lm's own ``speculative_generate_step`` against ``generate_step``, greedy.
- any batch: our loop (mlx-lm offers none for batch > 1): gamma drafter steps, one verify forward
  of gamma+1 tokens (the pending token and the drafts), rejection sampling, KV rollback.
  Its modes: ``real`` (greedy acceptance of the drafter's tokens), ``self-draft`` (draft = target,
  everything accepted) and ``emulated-acceptance`` (each draft token accepted with probability
  alpha, drawn here, so the system cost of SD at any alpha is measured on random-weight models).
  Plain and speculative runs alternate, and the speedup is the median of per-pair ratios.
  Sequences of a batch accept different counts; the caches are rolled back to the batch's
  shortest accepted prefix (lengths then differ by at most gamma tokens from the ideal, which
  does not change the cost of a step), while each sequence is credited its own accepted tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import trim_prompt_cache

from mac_moesd.analysis import acceptance
from mac_moesd.machine import memory
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.measure.sampling import rejection_sample
from mac_moesd.measure.sweep import PREFILL_CHUNK, RolledBackCache

__all__ = ["SpecConfig", "run_spec"]

MODES = ("real", "self-draft", "emulated-acceptance")


@dataclass(frozen=True)
class SpecConfig:
    target: str
    draft: str
    batches: tuple[int, ...] = (1, 2, 4)
    gammas: tuple[int, ...] = (2, 4)
    alphas: tuple[float, ...] = (0.7,)
    mode: str = "emulated-acceptance"
    context: int = 64
    new_tokens: int = 32  # tokens each sequence generates per timed run
    repeats: int = 3
    bits: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise BadInput(f"--mode must be one of {', '.join(MODES)}")
        if any(not 0 < a < 1 for a in self.alphas):
            raise BadInput("--alpha values must be in (0, 1)")
        if min(self.batches) < 1 or min(self.gammas) < 1 or self.new_tokens < 1 or self.repeats < 1:
            raise BadInput("--batch, --gamma, --tokens and --repeats must be >= 1")


class Decoder:
    """A target and a drafter with caches prefilled to the same context, for one batch size."""

    def __init__(self, target, draft, batch: int, context: int, vocab: int, rng: np.random.Generator):
        self.target, self.draft, self.batch, self.rng = target, draft, batch, rng
        prompt = mx.array(rng.integers(0, vocab, (batch, context)))
        self.target_rolled = RolledBackCache(target, batch, context, vocab, prompt)
        self.draft_rolled = RolledBackCache(draft, batch, context, vocab, prompt)
        self.target_cache, self.draft_cache = self.target_rolled.cache, self.draft_rolled.cache
        self.pending = mx.array(rng.integers(0, vocab, (batch, 1)))

    def reset(self) -> None:
        """Back to the prefilled context (between timed runs)."""
        self.target_rolled.reset()
        self.draft_rolled.reset()

    def plain(self, steps: int) -> int:
        """Greedy one-token steps, each next step built while the current one runs, as
        mlx-lm's generate_step does; returns tokens produced (all sequences)."""
        current = mx.argmax(self.target(self.pending, cache=self.target_cache)[:, -1:], axis=-1)
        mx.async_eval(current)
        for _ in range(steps - 1):
            following = mx.argmax(self.target(current, cache=self.target_cache)[:, -1:], axis=-1)
            mx.async_eval(following)
            mx.eval(current)  # the loop reads each token as it arrives
            current = following
        mx.eval(current)
        return steps * self.batch

    def speculative(self, new_tokens: int, gamma: int, mode: str, alpha: float | None) -> tuple[int, list[int]]:
        """Rounds until every sequence has ``new_tokens``; returns (tokens, draft tokens accepted
        in each round by each sequence)."""
        produced = np.zeros(self.batch, dtype=int)
        per_round: list[int] = []
        y = self.pending
        while produced.min() < new_tokens:
            x, drafts, draft_logits = y, [], []
            for _ in range(gamma):  # each draft step queued as built, as mlx-lm's _draft_generate
                logits = self.draft(x, cache=self.draft_cache)[:, -1:]
                x = mx.argmax(logits, axis=-1)
                mx.async_eval(x)
                drafts.append(x)
                draft_logits.append(logits)
            drafts_arr = mx.concatenate(drafts, axis=1)
            verify = self.target(mx.concatenate([y, drafts_arr], axis=1), cache=self.target_cache)
            greedy = mx.argmax(verify, axis=-1)  # (B, gamma+1): the target's token at every position
            # One synchronisation per round: everything the acceptance decision needs.
            if mode == "emulated-acceptance":
                # Pay for rejection sampling, then accept with the chosen alpha.
                counts, _ = rejection_sample(verify, mx.concatenate(draft_logits, axis=1), drafts_arr)
                mx.eval(counts, greedy)
                draws = self.rng.random((self.batch, gamma)) < alpha
                accepted = np.cumprod(draws, axis=1).sum(axis=1)
            elif mode == "self-draft":
                # The target drafts for itself, so every draft is accepted by construction; an
                # argmax comparison could differ on float16 near-ties (GPU), not in what it means.
                mx.eval(greedy, drafts_arr)
                accepted = np.full(self.batch, gamma)
            else:
                mx.eval(greedy, drafts_arr)
                matches = np.array(greedy[:, :gamma]) == np.array(drafts_arr)
                accepted = np.cumprod(matches, axis=1).sum(axis=1)
            shared = int(accepted.min())
            trim_prompt_cache(self.target_cache, gamma - shared)
            if shared == gamma:  # the drafter never saw its last token: feed it, as mlx-lm does
                self.draft(drafts[-1], cache=self.draft_cache)
            else:
                trim_prompt_cache(self.draft_cache, gamma - 1 - shared)
            produced += accepted + 1
            per_round += [int(a) for a in accepted]
            y = greedy[:, shared : shared + 1]
        return int(produced.sum()), per_round


def paired(plain, speculative, repeats: int, reset) -> tuple[list[float], list[float], object]:
    """Alternate plain and speculative runs (after one warm-up of each, which compiles every
    shape), so drift and background load hit both alike. Returns both lists of times and the
    last speculative result."""
    plain()
    reset()
    speculative()
    reset()
    plain_times, spec_times, last = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        plain()
        plain_times.append(time.perf_counter() - start)
        reset()
        start = time.perf_counter()
        last = speculative()
        spec_times.append(time.perf_counter() - start)
        reset()
    return plain_times, spec_times, last


def summarise_pairs(plain_tokens: int, plain_times, spec_tokens: int, spec_times) -> dict:
    """Median tokens/s both ways, their CVs, and the median of the per-pair speedups."""
    plain_rates = [plain_tokens / t for t in plain_times]
    spec_rates = [spec_tokens / t for t in spec_times]

    def cv(rates):
        return statistics.stdev(rates) / statistics.mean(rates) if len(rates) > 1 else 0.0

    return {
        "tokens_per_s_plain": statistics.median(plain_rates),
        "tokens_per_s_sd": statistics.median(spec_rates),
        "cv_plain": cv(plain_rates),
        "cv_sd": cv(spec_rates),
        "measured_speedup": statistics.median(s / p for s, p in zip(spec_rates, plain_rates)),
    }


def mlx_lm_batch1(target, draft, context, new_tokens, gamma, repeats, vocab, rng) -> dict:
    """Batch 1 with mlx-lm's own speculative decoding against its own plain decode (greedy)."""
    prompt = mx.array(rng.integers(0, vocab, (context,)))

    def plain():
        return sum(1 for _ in generate_step(prompt, target, max_tokens=new_tokens))

    def spec():
        return [bool(d) for _, _, d in speculative_generate_step(
            prompt, target, draft, num_draft_tokens=gamma, max_tokens=new_tokens)]

    plain_times, spec_times, from_draft = paired(plain, spec, repeats, lambda: None)
    row = summarise_pairs(new_tokens, plain_times, new_tokens, spec_times)
    return {**row, "accepted_per_round": acceptance.mlx_lm_rounds(from_draft, gamma, new_tokens),
            "engine": "mlx-lm"}


def estimate(cfg: SpecConfig, target, draft) -> dict:
    """Peak memory of the run at its largest batch and gamma (``memory.spec_estimate``)."""
    return memory.spec_estimate(target, draft, max(cfg.batches), max(cfg.gammas), cfg.context,
                                cfg.new_tokens, PREFILL_CHUNK, cfg.mode == "real" and 1 in cfg.batches)


def plan_models(cfg: SpecConfig, available_bytes: int | None, dtype: str | None = None):
    """Target and drafter, built lazily, at full depth if they fit with two caches per batch;
    else both cut to the same fraction of their layers (halving the target's) so the cost of a
    draft step relative to a target step stays about the same; else refuse. Nothing allocated."""
    from mac_moesd.inputs import models

    target_src = models.resolve(cfg.target)
    draft_src = None if cfg.mode == "self-draft" else models.resolve(cfg.draft)
    full = int(target_src.config["num_hidden_layers"])
    draft_full = int(draft_src.config["num_hidden_layers"]) if draft_src else 0
    layers = full
    while True:
        target = models.build(target_src, dtype, cfg.bits, layers, seed=cfg.seed)
        draft = None
        if draft_src is not None:
            draft_layers = max(1, round(draft_full * layers / full))
            draft = models.build(draft_src, dtype, cfg.bits, draft_layers, seed=cfg.seed + 1)
        need = estimate(cfg, target, draft)
        if available_bytes is None or need["peak_bytes"] <= available_bytes:
            return target, draft, need
        if layers == 1:
            raise MacMoesdError(
                f"SD of {target_src.name} needs about {memory.human(need['peak_bytes'])} even with "
                f"one layer; {memory.human(available_bytes)} is usable here: try --bits 4, a "
                "smaller --batch or --context, or a larger --memory-limit")
        layers //= 2


def run_spec(cfg: SpecConfig, predictor=None, available_bytes: int | None = None) -> dict:
    """Measure every (batch, gamma, alpha); ``predictor(batch, gamma, alpha, self_draft, context)``
    gives the fitted model's speedup for the same configuration at this run's context, or None.
    A target and drafter too big for ``available_bytes`` are measured on slices (``plan_models``),
    without a prediction: the fit predicts the full model.

    Every run records its acceptance as measured: mean accepted draft tokens per round, sigma,
    acceptance by position and the alpha solved from the mean; modes without an imposed alpha
    predict with the solved one."""
    rng = np.random.default_rng(cfg.seed)
    target, draft, need = plan_models(cfg, available_bytes)
    sliced = target.layers < target.layers_full
    if sliced:
        predictor = None
    memory.start_stage()
    target.materialise()
    if cfg.mode == "self-draft":
        draft = target
    else:
        draft.materialise()
        if draft.config["vocab_size"] != target.config["vocab_size"]:
            raise BadInput("target and drafter must share a vocabulary size")
    vocab = target.config["vocab_size"]
    alphas = cfg.alphas if cfg.mode == "emulated-acceptance" else (None,)
    runs = []
    for batch in cfg.batches:
        decoder = Decoder(target.model, draft.model, batch, cfg.context, vocab, rng)
        for gamma in cfg.gammas:
            for alpha in alphas:
                if batch == 1 and cfg.mode == "real":
                    row = mlx_lm_batch1(target.model, draft.model, cfg.context, cfg.new_tokens, gamma,
                                        cfg.repeats, vocab, rng)
                    per_round = row.pop("accepted_per_round")
                else:
                    plain_times, spec_times, (tokens, per_round) = paired(
                        lambda decoder=decoder: decoder.plain(cfg.new_tokens),
                        lambda decoder=decoder: decoder.speculative(cfg.new_tokens, gamma, cfg.mode, alpha),
                        cfg.repeats, decoder.reset)
                    row = summarise_pairs(cfg.new_tokens * batch, plain_times, tokens, spec_times)
                    row["engine"] = "mac-moesd loop"
                # alpha solved from the mean accepted length per round, never accepted/drafted.
                measured = acceptance.summarise_rounds(per_round, gamma) if per_round else None
                effective = alpha if alpha is not None else (measured["alpha"] if measured else None)
                predicted = (predictor(batch, gamma, effective, cfg.mode == "self-draft", cfg.context)
                             if predictor and effective is not None else None)
                runs.append({
                    "batch": batch, "gamma": gamma, "alpha": effective, "mode": cfg.mode,
                    "measured_alpha": measured["alpha"] if measured else None,
                    "mean_accepted": measured["mean_accepted"] if measured else None,
                    "sigma": measured["sigma"] if measured else None,
                    "acceptance_by_position": measured["acceptance_by_position"] if measured else None,
                    "rounds": measured["rounds"] if measured else 0,
                    "predicted_speedup": predicted, "repeats": cfg.repeats, **row,
                })
        del decoder
        memory.release()
    document = {
        "target": target.source.name,
        "draft": target.source.name if cfg.mode == "self-draft" else cfg.draft,
        "context": cfg.context, "new_tokens": cfg.new_tokens, "verify_tokens": "gamma+1",
        "runs": runs,
        "layers": {"target": target.layers, "target_full": target.layers_full,
                   "draft": draft.layers, "draft_full": draft.layers_full, "sliced": sliced},
        "memory": memory.record(need, available_bytes),
    }
    del target, draft
    memory.release()
    return document
