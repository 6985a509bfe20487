"""A fitted time model and what it predicts: T_T(B,t) at any context, the steps of an SD round,
S(B,gamma), the prediction grid with its peaks and break-even values, and the what-ifs (top-k
changed, MoESD's own expert-load curve and verify length)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from mac_moesd.analysis import break_even, cluster, expert_reads, one_row, pipelining, round_terms, theory
from mac_moesd.analysis.fit.inputs import DEFAULT_VERIFY, NO_DRAFT, FitInputs
from mac_moesd.errors import MacMoesdError
from mac_moesd.results import schema

__all__ = ["DEFAULT_ALPHAS", "DEFAULT_BATCHES", "DEFAULT_GAMMAS", "FitResult", "FittedModel", "VariantFit",
           "paper_comparison", "peaks", "predict", "sparsity_sweep", "verify_tokens"]

DEFAULT_ALPHAS = (0.5, 0.7, 0.9)
DEFAULT_GAMMAS = theory.CANDIDATE_GAMMAS
DEFAULT_BATCHES = tuple(range(1, 65))


def verify_tokens(gamma: int, verify: str) -> int:
    return gamma + 1 if verify == "gamma+1" else gamma


@dataclass(frozen=True)
class FittedModel:
    """One fitted variant, ready to predict T_T(B,t) at any context and S(B,gamma)."""

    params: theory.TimeModel
    k_kv: float
    experts: int
    top_k: int
    ridge_tokens: float
    loads: str
    sort_threshold: int
    drafted: bool
    pipelining: schema.Pipelining = field(default_factory=pipelining.not_measured)
    comm: cluster.CommTerm | None = None  # a sharded forward's measured communication
    routing: expert_reads.Routing = expert_reads.Routing()  # unique experts the routing activates
    one_row: schema.OneRow | None = None  # the sweep's timing of T_T(1,1), which the curve misses
    k_seq: float = 0.0  # seconds per sequence that do not grow with context (theory.kv_time)
    # Which models re-forward the kept tokens when a round rolls back (a recurrent state cannot
    # trim, docs/design.md §4.7): ``target`` and/or ``draft``; none for plain KV caches.
    reforward: tuple[str, ...] = ()
    bookkeeping: schema.RoundTerm = field(default_factory=round_terms.not_timed)  # the SD loop's own work a round (zero: not timed)
    # The recurrent layers' sequential state update: seconds per token per layer, whatever the
    # batch (``linear_layers`` of them; 0 on a model without one).
    k_rec: float = 0.0
    linear_layers: int = 0
    # The drafter's chain after the target's verify, beyond its fitted steps, a round (zero: not timed).
    draft_start: schema.RoundTerm = field(default_factory=round_terms.not_timed)

    def target(self, batch, tokens, context: float, pipelined: bool = False, comm: bool = True,
               active=None) -> np.ndarray:
        """T_T(B,t) at context L: Algorithm 1 for n = B*t tokens plus MagicDec's k_kv*B*L, plus the
        recurrent layers' k_rec * layers * t, plus a sharded forward's communication C(n)
        (``comm=False``: a free link); with ``pipelined``,
        less the graph-building time a pipelined loop hides. The one-row forward (n = 1) is the
        sweep's own timing where it has one, carried from its context to L by the KV term.
        ``active``: the unique experts at those points, where the caller has them already."""
        batch = np.asarray(batch, dtype=float)
        n = batch * np.asarray(tokens, dtype=float)
        link = self.comm.time(n) if comm and self.comm is not None else 0.0
        if active is None:
            active = self.routing.unique(batch, tokens, self.experts, self.top_k)
        kv = theory.kv_time(batch, context, self.k_kv, self.k_seq)
        recurrence = self.k_rec * self.linear_layers * np.asarray(tokens, dtype=float)
        sync = (self.params.target_time(n, self.experts, self.top_k, self.ridge_tokens, self.loads,
                                        self.sort_threshold, active) + kv + recurrence + link)
        curve = pipelining.pipelined(sync, self.pipelining["target_s"]) if pipelined else sync
        if self.one_row is None:
            return curve
        # The timing includes the sweep's own link; a free link takes the measured one off.
        free_link = self.comm.time(n) if not comm and self.comm is not None else 0.0
        here = (one_row.seconds(self.one_row, pipelined, self.pipelining["target_s"]) + kv
                - theory.kv_time(batch, self.one_row["context"], self.k_kv, self.k_seq) - free_link)
        return np.where((n == 1) & (here > 0), here, curve)

    def speedup(self, batch, gamma: int, alpha: float, context: float, verify: str = DEFAULT_VERIFY,
                self_draft: bool = False, comm: bool = True, draft_step: float | None = None,
                reject: float | None = None, catch_up: bool | None = None) -> np.ndarray:
        """S(B, gamma) at acceptance alpha and context L, each forward timed as the loops run it
        (``pipelining``); a self-draft's step is the target's; ``draft_step``: a drafter step
        timed elsewhere (an MTP head's, as the SD stage chained it), in place of the fitted T_D;
        ``reject``: rejection sampling timed elsewhere, where the fit has no T_rej (no drafter).
        ``catch_up``: whether the loop feeds the drafter its last draft after a round that
        accepted every draft (one more step, by how often that happens: the suite's loop; mlx-lm
        folds it into the next round's first step); None: the suite's loop at B > 1, mlx-lm's at 1."""
        sigma = theory.normalised_acceptance(alpha, gamma)
        plain, verify_t, draft, fitted_reject = self.step_times(batch, gamma, context, verify, self_draft, comm,
                                                                draft_step)
        reject_s = fitted_reject if reject is None or self.drafted else reject
        rollback = self.rollback_time(batch, gamma, alpha, context, self_draft, comm, draft_step is not None)
        fed = self.catch_up(batch, gamma, alpha, catch_up)
        fed_step = draft - (self.start_share(batch, gamma) if draft_step is None and not self_draft else 0.0)
        per_round = reject_s + rollback + round_terms.seconds(self.bookkeeping, batch) + fed * fed_step
        return theory.speedup(sigma, gamma, plain, verify_t, draft, per_round)

    def start_share(self, batch, gamma: int) -> np.ndarray:
        """The drafter's start's share of its mean step (``step_times``): T_start(B, gamma) /
        gamma. A catch-up step is queued into the next round's chain, which pays the start once,
        so that step is priced without it."""
        return round_terms.seconds(self.draft_start, batch, gamma) / gamma

    @staticmethod
    def catch_up(batch, gamma: int, alpha: float, loop: bool | None = None) -> np.ndarray:
        """Drafter steps a round adds by feeding the drafter its last draft after a round in which
        every sequence accepted every draft (the suite's loop: alpha^(gamma B) of rounds); none
        under mlx-lm, which feeds it with the next round's first step. ``loop`` None: the suite's
        loop at B > 1, mlx-lm's at batch 1, as the SD stage runs them."""
        batch = np.asarray(batch, dtype=float)
        fed = batch > 1 if loop is None else np.full(batch.shape, bool(loop))
        return np.where(fed, 1 - theory.rollback_probability(alpha, gamma, batch), 0.0)

    def lookup_speedup(self, batch: int, widths, tokens_per_round: float, lookup_s: float,
                       rolled_back_share: float, context: float) -> float:
        """S(B) of prompt-lookup rounds as a run measured them: ``widths`` the draft tokens each
        round verified (its batch's longest proposal; 0: a one-token step), ``tokens_per_round``
        each sequence's mean, ``lookup_s`` the lookup's host seconds a round, and the share of
        rounds that rolled back (a re-forward of about the tokens a round keeps, where the target
        re-forwards). The plain step pipelined as ``speedup`` prices it; the verify synchronous,
        since nothing overlaps its graph build."""
        plain = float(self.target(batch, 1, context, pipelined=True))
        # Synchronous: the lookup runs on the host between the round's sync and the verify.
        verify = float(np.mean(self.target(batch, np.asarray(widths) + 1, context)))
        rollback = (rolled_back_share * float(self.target(batch, tokens_per_round, context))
                    if "target" in self.reforward else 0.0)
        return tokens_per_round * plain / (lookup_s + verify + rollback + float(round_terms.seconds(self.bookkeeping, batch)))

    def rollback_time(self, batch, gamma: int, alpha: float, context: float, self_draft: bool = False,
                      comm: bool = True, drafter_trims: bool = False) -> np.ndarray:
        """A round's rollback, averaged over rounds: where a model re-forwards (``reforward``), the
        chance that it rolls back times a forward of the tokens it keeps
        (``theory.kept_on_rollback``). The target forwarded gamma + 1 tokens, so it rolls back
        whenever some draft is rejected and re-forwards T_T(B, kept). The drafter forwarded only
        the pending token and gamma - 1 drafts, so a rejection at the last draft leaves it holding
        exactly the kept tokens (``Rollback.undo`` does nothing): it rolls back with the chance for
        gamma - 1 drafts, and re-forwards about one step (a few tokens through a small drafter;
        the target's T_T of its kept tokens when it drafts for itself). Trims and window cuts
        cost nothing the fit can see, nor does ``drafter_trims``' drafter (an MTP head's one
        attention layer)."""
        zero = np.zeros_like(np.asarray(batch, dtype=float))
        target = drafter = zero
        if "target" in self.reforward:
            kept = theory.kept_on_rollback(alpha, gamma, batch)
            target = theory.rollback_probability(alpha, gamma, batch) * self.target(batch, kept, context, comm=comm)
        if not drafter_trims and ("draft" in self.reforward or (self_draft and "target" in self.reforward)):
            kept = theory.kept_on_rollback(alpha, gamma - 1, batch)
            step = (self.target(batch, kept, context, comm=comm) if self_draft
                    else self.params.draft_time(batch, self.ridge_tokens))
            drafter = theory.rollback_probability(alpha, gamma - 1, batch) * step
        return target + drafter

    def step_times(self, batch, gamma: int, context: float, verify: str = DEFAULT_VERIFY,
                   self_draft: bool = False, comm: bool = True,
                   draft_step: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | float, np.ndarray]:
        """(plain step, verify forward, mean draft step, rejection sampling) of a round, each as
        the loops run it; a round costs gamma draft steps + the verify + rejection sampling. A
        fitted drafter's mean step carries its share of the chain's start after the verify.
        ``draft_step``: the drafter's step as timed elsewhere, which needs no fitted drafter."""
        if not self.drafted and draft_step is None:
            raise MacMoesdError(NO_DRAFT)
        plain = self.target(batch, 1, context, pipelined=True, comm=comm)
        verify_t = self.target(batch, verify_tokens(gamma, verify), context, pipelined=True, comm=comm)
        draft: np.ndarray | float
        if draft_step is not None:
            draft = draft_step
        elif self_draft:
            draft = pipelining.draft_step(self.target(batch, 1, context, comm=comm),
                                          self.pipelining["target_s"], gamma)
        else:
            draft = (self.drafter_chain(batch, gamma) + round_terms.seconds(self.draft_start, batch, gamma)) / gamma
        return plain, verify_t, draft, self.params.reject_time(batch)

    def drafter_chain(self, batch, gamma: int) -> np.ndarray:
        """The fitted drafter's gamma steps of a round, the first synchronous and the rest
        pipelined, without the start the chain pays after a verify (``draft_start``)."""
        return gamma * pipelining.draft_step(self.params.draft_time(batch, self.ridge_tokens),
                                             self.pipelining["draft_s"], gamma)

    @classmethod
    def from_document(cls, doc: dict, variant: str | None = None) -> FittedModel:
        """The chosen (or the named) variant of a stored fit document (``fit_document``'s)."""
        name = variant or doc["chosen"]
        v = next(x for x in doc["variants"] if x["name"] == name)
        params = {k: (0.0 if val is None else val) for k, val in v["params"].items()}
        comm = doc.get("communication")
        return cls(theory.TimeModel(**params), v["k_kv"], doc["experts"], doc["top_k"],
                   doc["ridge_tokens"], name, doc["sort_threshold"], doc["drafted"],
                   pipelining.from_stored(doc.get("pipelining")),
                   cluster.CommTerm.from_dict(comm) if comm else None,
                   expert_reads.Routing.from_dict(doc.get("routing")),
                   doc.get("one_row") or None, v.get("k_seq", 0.0), tuple(doc.get("reforward", ())),
                   round_terms.from_stored(doc.get("bookkeeping")), v.get("k_rec", 0.0), doc.get("linear_layers", 0),
                   round_terms.from_stored(doc.get("draft_start")))


@dataclass(frozen=True)
class VariantFit:
    name: str
    params: theory.TimeModel
    k_kv: float  # MagicDec's KV-read term: seconds per cached token per sequence
    bounds: dict[str, tuple[float, float]]
    train: list[dict]
    heldout: list[dict]
    heldout_mape: float | None
    worst: dict | None
    cost: float
    k_seq: float = 0.0  # seconds per sequence that do not grow with context (0: not told apart)
    kv_rows: list[dict] = field(default_factory=list)  # the fit at the second context
    k_rec: float = 0.0  # seconds per token per recurrent layer (0: none)


@dataclass(frozen=True)
class FitResult:
    variants: list[VariantFit]
    chosen: str
    inputs: FitInputs = field(repr=False)
    pipelining: schema.Pipelining = field(default_factory=pipelining.not_measured)
    bookkeeping: schema.RoundTerm = field(default_factory=round_terms.not_timed)
    draft_start: schema.RoundTerm = field(default_factory=round_terms.not_timed)

    def variant(self, name: str) -> VariantFit:
        return next(v for v in self.variants if v.name == name)

    @property
    def best(self) -> VariantFit:
        return self.variant(self.chosen)

    @property
    def params(self) -> theory.TimeModel:
        return self.best.params

    @property
    def k_kv(self) -> float:
        return self.best.k_kv

    @property
    def bounds(self) -> dict[str, tuple[float, float]]:
        return self.best.bounds

    @property
    def heldout_mape(self) -> float | None:
        return self.best.heldout_mape

    def model(self, name: str | None = None, timed_one_row: bool = True) -> FittedModel:
        """A variant ready to predict; with ``timed_one_row``, its one-row forward is the sweep's
        timing of it (``one_row``), else the fitted curve's."""
        v = self.variant(name or self.chosen)
        i = self.inputs
        row = one_row.from_points(i.context, i.target, i.target_pipelined) if timed_one_row else None
        return FittedModel(v.params, v.k_kv, i.experts, i.top_k, i.ridge_tokens, v.name,
                           i.sort_threshold, i.drafted, self.pipelining, i.comm, i.routing, row, v.k_seq,
                           i.reforward, self.bookkeeping, v.k_rec, i.linear_layers, self.draft_start)


def predict(
    model: FittedModel,
    context: int,
    batches=DEFAULT_BATCHES,
    gammas=DEFAULT_GAMMAS,
    alphas=DEFAULT_ALPHAS,
    verify: str = DEFAULT_VERIFY,
) -> list[dict]:
    """S(B, gamma) and target efficiency for every batch, draft length and acceptance rate.

    ``speedup`` is None when the drafter was not measured.
    """
    b = np.asarray(batches, dtype=float)
    plain = model.target(b, 1, context)
    rows = []
    for gamma in gammas:
        efficiency = theory.target_efficiency(plain, model.target(b, verify_tokens(gamma, verify), context))
        steps = (np.broadcast_to(x, b.shape) for x in model.step_times(b, gamma, context, verify)) \
            if model.drafted else None
        parts = list(zip(*steps)) if steps is not None else [None] * len(batches)
        for alpha in alphas:
            s = (model.speedup(b, gamma, alpha, context, verify) if model.drafted
                 else [None] * len(batches))
            # The round's costs besides its forwards: the rollback and the loop's bookkeeping.
            rollback = np.broadcast_to(model.rollback_time(b, gamma, alpha, context) + round_terms.seconds(model.bookkeeping, b),
                                       b.shape)
            rows += [{"batch": int(bb), "gamma": gamma, "alpha": alpha,
                      "speedup": None if v is None else float(v), "target_efficiency": float(e),
                      **_break_even(p, gamma, alpha, float(r))}
                     for bb, v, e, p, r in zip(batches, s, efficiency, parts, rollback)]
    return rows


def _break_even(parts, gamma: int, alpha: float, rollback: float = 0.0) -> dict:
    """A prediction row's break-even acceptance and drafter cost (``break_even``) from its round's
    step times (plain, verify, draft step, reject) and its rollback, priced at the row's alpha
    (a model that re-forwards rolls back less often nearer the break-even alpha, so that one is a
    little high); None without a drafter."""
    if parts is None:
        return {"break_even_alpha": None, "break_even_draft_ratio": None}
    plain, verify_s, draft, reject = (float(x) for x in parts)
    reject += rollback
    return {"break_even_alpha": break_even.break_even_alpha(plain, verify_s, draft, reject, gamma),
            "break_even_draft_ratio": break_even.break_even_draft_ratio(plain, verify_s, reject, gamma, alpha)}


def peaks(predictions: list[dict]) -> list[dict]:
    """For each (gamma, alpha): the batch of peak speedup and the batches within peak/sqrt(2)."""
    out = []
    keys = sorted({(p["gamma"], p["alpha"]) for p in predictions if p["speedup"] is not None})
    for gamma, alpha in keys:
        rows = [p for p in predictions if p["gamma"] == gamma and p["alpha"] == alpha]
        top = max(rows, key=lambda p: p["speedup"])
        window = [p["batch"] for p in rows if p["speedup"] >= top["speedup"] / math.sqrt(2)]
        out.append({"gamma": gamma, "alpha": alpha, "peak_batch": top["batch"],
                    "peak_speedup": top["speedup"], "window": [min(window), max(window)]})
    return out


def sparsity_sweep(model: FittedModel, context: int, gamma=4, alpha=theory.DEFAULT_ALPHA, batches=DEFAULT_BATCHES,
                   verify=DEFAULT_VERIFY) -> list[dict]:
    """The same fitted model with K changed (as MoESD edits num_experts_per_tok).

    Acceptance is held at ``alpha`` for every K, which is what MoESD's rescaling of raw speedups
    by sigma_K0 / sigma_K achieves for measured runs.
    """
    if not model.drafted:
        return []
    E, K = model.experts, model.top_k
    ks = sorted({k for k in (1, 2, K // 2, K, 2 * K, 4 * K) if 1 <= k <= E})
    out = []
    for k in ks:
        # The counted experts and the timed one-row forward were for the model's own K; another
        # K takes the fitted routing form and the curve.
        changed = replace(model, top_k=k, routing=model.routing if k == K else model.routing.form_only(),
                          one_row=model.one_row if k == K else None)
        rows = predict(changed, context, batches, (gamma,), (alpha,), verify)
        top = max(rows, key=lambda p: p["speedup"])
        out.append({"top_k": k, "rho": k / E, "peak_batch": top["batch"], "peak_speedup": top["speedup"],
                    "speedup_batch1": rows[0]["speedup"]})
    return out


def paper_comparison(result: FitResult, alphas=DEFAULT_ALPHAS, gammas=DEFAULT_GAMMAS) -> list[dict]:
    """Batch-1 speedups: the prediction (the chosen variant with the timed one-row forward,
    gamma+1 verify tokens, as the loops run), MoESD's ``unique`` curve with the same verify, and
    ``unique`` with the paper's gamma verify tokens."""
    if not result.inputs.drafted:
        return []
    L = result.inputs.context
    chosen, unique = result.model(), result.model("unique", timed_one_row=False)
    return [{"gamma": g, "alpha": a,
             "chosen": float(chosen.speedup(1, g, a, L, "gamma+1")[()]),
             "unique": float(unique.speedup(1, g, a, L, "gamma+1")[()]),
             "unique_paper_verify": float(unique.speedup(1, g, a, L, "gamma")[()])}
            for g in gammas for a in alphas]
