"""The verdict for a measured pair: the best draft length per prompt set, or why SD does not pay.

From a fitted time model and the acceptance measured on each prompt set. One SD round costs
``gamma*T_D(B,1) + T_T(B,gamma+1) + T_rej(B)`` and yields ``Omega = sigma*(gamma+1)`` tokens, where
plain decode pays ``T_T(B,1)`` per token (MoESD's S(B, gamma), docs/design.md §3.8). When no gamma
gives S > 1, the deciding term is the one whose removal would raise S the most:
- drafter cost: the round without its gamma drafter steps;
- verify cost: the verify forward at the price of one plain step (what a memory-bound dense
  target pays; an MoE pays more as every extra token loads other experts);
- acceptance: every draft token accepted (Omega = gamma+1).
"""

from __future__ import annotations

from dataclasses import dataclass

from mac_moesd.analysis import acceptance, break_even, round_terms, spec_runs, theory
from mac_moesd.analysis.fit import DEFAULT_VERIFY, FittedModel

__all__ = ["RoundCost", "TERMS", "agreement", "best_gamma", "break_even_accepted", "break_even_alpha",
           "deciding_term", "differing_term", "fastest_run", "lookup_rows", "measured_answer", "round_cost",
           "timed_run", "verdict_rows"]

TERMS = ("drafter cost", "verify cost", "acceptance")


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one SD round at batch B, by part, beside a plain step."""

    plain: float  # T_T(B,1)
    verify: float  # T_T(B, gamma+1)
    draft: float  # gamma * T_D(B,1)
    reject: float  # T_rej(B)
    rollback: float = 0.0  # re-forwards after rejections, averaged over rounds (FittedModel.rollback_time)
    bookkeeping: float = 0.0  # the SD loop's own work a round (FittedModel.bookkeeping)

    @property
    def round(self) -> float:
        return self.draft + self.verify + self.reject + self.rollback + self.bookkeeping

    def speedup(self, tokens_per_round: float) -> float:
        return tokens_per_round * self.plain / self.round


def round_cost(model: FittedModel, batch: int, gamma: int, context: float, alpha: float,
               verify: str = DEFAULT_VERIFY, loop: bool | None = None) -> RoundCost:
    """The fitted model's prices of one round at acceptance ``alpha`` and one plain step at the
    run's context, each forward as the loops run it (``FittedModel.step_times`` and
    ``rollback_time``, the account ``FittedModel.speedup`` uses), so ``round_cost(...).speedup(Omega)``
    is the predicted S and the parts add up to it. ``loop``: whether the loop feeds the drafter
    its last draft after a fully accepted round (``FittedModel.catch_up``; None: by batch)."""
    plain, verify_s, draft_step, reject = model.step_times(batch, gamma, context, verify)
    rollback = model.rollback_time(batch, gamma, alpha, context)
    fed = float(model.catch_up(batch, gamma, alpha, loop))  # the drafter fed its last draft (FittedModel.speedup)
    draft = gamma * float(draft_step) + fed * float(draft_step - model.start_share(batch, gamma))
    return RoundCost(float(plain), float(verify_s), draft, float(reject),
                     float(rollback), float(round_terms.seconds(model.bookkeeping, batch)))


def best_gamma(model: FittedModel, batch: int, alpha: float, context: int,
               gammas: tuple[int, ...] = theory.CANDIDATE_GAMMAS) -> tuple[int, float]:
    """(gamma, predicted S) of the draft length with the highest predicted speedup."""
    best = theory.best_gamma(lambda g: float(model.speedup(batch, g, alpha, context)), gammas)
    if best is None:
        raise ValueError("no draft lengths to choose from")
    return best


def deciding_term(model: FittedModel, batch: int, gamma: int, alpha: float, context: int) -> dict:
    """Which term keeps S below 1 at (batch, gamma, alpha): the speedup with each term removed,
    the round's cost split, and the name of the term whose removal helps most."""
    cost = round_cost(model, batch, gamma, context, alpha)
    omega = float(theory.expected_tokens_per_round(alpha, gamma))
    fixed = cost.reject + cost.rollback + cost.bookkeeping
    without = {
        "drafter cost": omega * cost.plain / (cost.verify + fixed),
        "verify cost": omega * cost.plain / (cost.draft + cost.plain + fixed),
        # everything accepted: gamma+1 tokens a round, and no round rolls back
        "acceptance": RoundCost(cost.plain, cost.verify, cost.draft, cost.reject,
                                bookkeeping=cost.bookkeeping).speedup(gamma + 1),
    }
    return {
        "term": max(without, key=lambda k: without[k]),
        "speedup": cost.speedup(omega),
        "tokens_per_round": omega,
        "speedup_without": without,
        "round_share": {"drafter": cost.draft / cost.round, "verify": cost.verify / cost.round,
                        "rejection": cost.reject / cost.round, "rollback": cost.rollback / cost.round,
                        "bookkeeping": cost.bookkeeping / cost.round},
        "verify_over_plain": cost.verify / cost.plain,
        "draft_step_over_plain": cost.draft / gamma / cost.plain,
    }


def verdict_rows(fit_doc: dict, acceptance: list[dict], context: int,
                 batches: tuple[int, ...] = (1,), runs: list[dict] | None = None) -> list[dict]:
    """One row per measured acceptance (``{prompts, temperature, rule, alpha}``) and batch: the
    best gamma and its predicted speedup, the break-even acceptance and drafter cost at that gamma,
    and, where SD does not pay, the deciding term. Where ``runs`` (a spec document's timed runs)
    hold that configuration (batch, gamma, temperature; the rule as run), the row also carries its
    measurement and whether the prediction agrees with it (``agreement``)."""
    model = FittedModel.from_document(fit_doc)
    rows = []
    for a in acceptance:
        for batch in batches:
            gamma, speedup = best_gamma(model, batch, a["alpha"], context)
            cost = round_cost(model, batch, gamma, context, a["alpha"])
            # The rollback priced at the measured alpha (it happens less often nearer break-even).
            per_round = cost.reject + cost.rollback + cost.bookkeeping
            row = {**a, "drafter_kind": "model", "batch": batch, "gamma": gamma, "predicted_speedup": speedup,
                   "pays_off": speedup > 1.0,
                   "break_even_alpha": break_even.break_even_alpha(cost.plain, cost.verify, cost.draft / gamma,
                                                                    per_round, gamma),
                   "break_even_draft_ratio": break_even.break_even_draft_ratio(
                       cost.plain, cost.verify, per_round, gamma, a["alpha"])}
            if not row["pays_off"]:
                row["deciding"] = deciding_term(model, batch, gamma, a["alpha"], context)
            run = timed_run(runs or [], row)
            if run is not None:
                row.update(agreement(run, speedup, fit_doc.get("heldout_mape")))
                row["differs_most"] = differing_term(model, run, context, a["alpha"])
            rows.append(row)
    return rows


def timed_run(runs: list[dict], row: dict) -> dict | None:
    """The timed run of a verdict row's configuration: same batch, gamma and temperature, and an
    acceptance rule the timed runs use (not exact rejection sampling, which they do not run)."""
    if row.get("rule") == "rejection":
        return None
    return next((r for r in spec_runs.valid_runs(runs) if r["batch"] == row["batch"] and r["gamma"] == row["gamma"]
                 and r.get("temperature", 0) == row.get("temperature", 0)), None)


def agreement(run: dict, predicted: float, heldout_mape: float | None) -> dict:
    """Whether a prediction agrees with a timed run: inside the run's 95% CI of the median speedup
    (its range over pairs, for runs made before CIs), widened by the fit's held-out error."""
    low, high = run.get("measured_ci") or run.get("speedup_range") or [run["measured_speedup"]] * 2
    slack = heldout_mape or 0.0
    band = [low * (1 - slack), high * (1 + slack)]
    return {"measured_speedup": run["measured_speedup"], "measured_ci": run.get("measured_ci"),
            "agrees": band[0] <= predicted <= band[1], "agreement_band": band}


def differing_term(model: FittedModel, run: dict, context: float, alpha: float | None) -> dict | None:
    """Which part of the round the model's account moves the predicted speedup furthest by,
    against the timed run's own (``round``, timed in the SD stage): the plain step, the verify
    forward, the drafter's steps, the rollback (where the run timed one that costs something),
    the loop's bookkeeping (where both the sweep and the run timed it), or acceptance (the
    verdict's alpha against the one the run realised); None for runs made before their rounds
    were timed. Each part's ``ratios`` (model over measured) weighs by its share: the plain step
    and acceptance scale the speedup whole, a round's part by its share of the timed round
    (``effects``: the fraction each moves the speedup), so a small part priced at half its
    time does not outrank a large one priced 10% off."""
    measured = run.get("round")
    if not measured:
        return None
    gamma = run["gamma"]
    realised = run.get("measured_alpha", run.get("alpha"))
    # The run's draft part counts the catch-up step its loop fed the drafter (round_prediction), so
    # the model's does too, at the realised acceptance (none where the run did not record one).
    cost = round_cost(model, run["batch"], gamma, context, 0.0 if realised is None else realised,
                      loop=False if realised is None else spec_runs.feeds_last_draft(run))
    ratios = {
        "plain step": cost.plain / measured["plain_s"],
        "verify": cost.verify / measured["verify_s"] if measured["verify_s"] else None,
        "drafter steps": cost.draft / measured["draft_s"] if measured["draft_s"] else None,
        "acceptance": (float(theory.expected_tokens_per_round(alpha, gamma))
                       / float(theory.expected_tokens_per_round(realised, gamma)))
                       if realised is not None and alpha is not None else None,
    }
    if model.reforward and measured.get("rollback_s") and realised is not None:
        ratios["rollback"] = cost.rollback / measured["rollback_s"]
    if model.bookkeeping["points"] and measured.get("bookkeeping_s"):
        ratios["bookkeeping"] = cost.bookkeeping / measured["bookkeeping_s"]
    ratios = {k: v for k, v in ratios.items() if v is not None}
    parts = {"verify": "verify_s", "drafter steps": "draft_s", "rollback": "rollback_s", "bookkeeping": "bookkeeping_s"}
    timed_round = measured.get("round_s") or sum(measured.get(k) or 0.0 for k in (*parts.values(), "reject_s"))
    effects = {k: (v - 1) if k not in parts else -(v - 1) * measured[parts[k]] / timed_round
               for k, v in ratios.items()}
    term = max(effects, key=lambda k: abs(effects[k]))
    return {"term": term, "model_over_measured": ratios[term], "ratios": ratios, "effects": effects}


def fastest_run(runs: list[dict], batch: int, temperature: float) -> dict | None:
    """The valid timed run with the highest measured speedup at that batch and temperature."""
    timed = [r for r in spec_runs.valid_runs(runs)
             if r["batch"] == batch and r.get("temperature", 0) == temperature]
    return max(timed, key=lambda r: r["measured_speedup"], default=None)


def measured_answer(run: dict) -> str:
    """Whether a measured speedup pays off, by its 95% CI where it has one: ``pays off`` (the CI
    above 1), ``does not pay off`` (below 1) or ``breaks even`` (the CI spans 1)."""
    low, high = run.get("measured_ci") or [run["measured_speedup"]] * 2
    return "pays off" if low > 1.0 else "does not pay off" if high < 1.0 else "breaks even"


def break_even_accepted(run: dict) -> float | None:
    """The draft tokens a round of this timed run would have to accept for S = 1 at the round's
    measured cost: S = (accepted + 1) x plain step / round, so the round costs (accepted + 1) / S
    plain steps, and that many tokens, less the one every round gives, break even. None without
    a measured acceptance."""
    if run.get("mean_accepted") is None:
        return None
    return (run["mean_accepted"] + 1) / run["measured_speedup"] - 1


def break_even_alpha(run: dict) -> float | None:
    """The acceptance at which a timed run's round would give S = 1 at its measured cost: the
    alpha whose expected tokens per round (``theory.expected_tokens_per_round``) equal the round's
    cost in plain steps, (accepted + 1) / S; None where even every draft accepted would not pay."""
    needed = break_even_accepted(run)
    if needed is None or needed >= run["gamma"]:
        return None
    return float(acceptance.solve_alpha(max(needed, 0.0), run["gamma"]))


def lookup_rows(runs: list[dict], prompt_set: str, batches: tuple[int, ...]) -> list[dict]:
    """Prompt lookup's verdict per temperature and batch, from its timed runs alone (no draft
    length is chosen by a model: its drafts cost host time, and how often the context repeats is
    what it measured): the fastest timed gamma (the longest proposal), its measured S with CI and
    answer, its prediction, the accepted draft tokens per round it realised and the break-even
    number at which S = 1 at the round's measured cost (``break_even_accepted``)."""
    rows = []
    for temperature in sorted({r.get("temperature", 0) for r in runs}):
        for batch in batches:
            run = fastest_run(runs, batch, temperature)
            if run is None:
                continue
            rows.append({
                "prompts": prompt_set, "temperature": temperature, "drafter_kind": "prompt-lookup",
                "rule": "greedy" if temperature == 0 else "mlx-lm", "batch": batch, "gamma": run["gamma"],
                "measured_speedup": run["measured_speedup"], "measured_ci": run.get("measured_ci"),
                "answer": measured_answer(run), "predicted_speedup": run.get("predicted_speedup"),
                "mean_accepted": run.get("mean_accepted"),
                "proposal_rate": (run.get("lookup") or {}).get("proposal_rate"),
                "break_even_accepted": break_even_accepted(run),
                "run": run,  # the timed run itself, for its CI and pairs as the report shows them
            })
    return rows
