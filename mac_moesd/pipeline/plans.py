"""Plans as data: what `run` measures on the zoo's models (``Plan``) and on a user's own
target/drafter pair (``PairPlan``): models, grids and budgets, nothing measured or allocated."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from mac_moesd.analysis import theory
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs import models, pairs, zoo
from mac_moesd.inputs.prompts import load_prompts
from mac_moesd.measure.clock import timing
from mac_moesd.measure.peaks import roofline
from mac_moesd.measure.sd import speedup
from mac_moesd.results.keys import DRAFTER_KINDS, PAIR_MODES, drafter_kind
from mac_moesd.units import human_bytes

__all__ = ["PROMPT_SETS", "PairPlan", "Plan", "default_plan", "find_default_pair", "pair_plan", "pair_plans",
           "with_models"]

PROMPT_SETS = ("code", "chat")
TEMPERATURES = (0.0, 1.0)
QUICK_PROMPTS = 10


@dataclass(frozen=True)
class Plan:
    moe: tuple[str, ...]  # sparse first
    dense: str | None  # the dense control; None in a pair run
    draft: str | None  # the drafter model; None in a pair run drafted by prompt lookup alone
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    context: int
    bits: int | None
    budget: timing.Budget
    roofline: roofline.RooflineConfig
    spec_batches: tuple[int, ...]
    spec_gammas: tuple[int, ...]
    spec_tokens: int
    spec_repeats: int  # the fewest (plain, SD) pairs per configuration
    routing_batches: tuple[int, ...]
    spec_budget_s: float = 120.0  # seconds per SD configuration to reach its precision
    spec_stop_when_decided: bool = False  # quick: an SD configuration stops once its answer is decided
    rollback: str = "auto"  # how SD takes back rejected drafts (measure.caches.rollback.STRATEGIES)
    # Models already resolved while the plan was made (``with_models``, ``pair_plans``), by argument
    resolved: Mapping[str, models.ModelSource] = field(default_factory=dict)

    @property
    def models(self) -> tuple[str, ...]:
        return (*self.moe, self.dense) if self.dense else self.moe


def resolve_plan(plan: Plan) -> dict[str, models.ModelSource]:
    """Every model the plan measures (targets, dense control, drafter) resolved once for the
    command, reusing what making the plan resolved already."""
    names = [*plan.models, *([plan.draft] if plan.draft else [])]
    return {name: plan.resolved.get(name) or models.resolve(name) for name in dict.fromkeys(names)}


def default_plan(backend: str, quick: bool, full: bool = False) -> Plan:
    """On a GPU the zoo's real dimensions at 4-bit (sliced to fit); on MLX's CPU backend the
    CI-sized models, since a real-dimension forward there takes seconds."""
    if backend == "cpu":
        return Plan(
            moe=("tiny-moe", "tiny-moe-8x2"), dense="tiny-dense", draft="tiny-draft",
            batches=(1, 2, 4, 8), tokens=(1, 2, 3, 4, 6, 8), context=64, bits=None,
            budget=timing.QUICK if quick else timing.Budget(seconds_per_point=1.0),
            roofline=roofline.QUICK if quick else roofline.RooflineConfig(sizes=roofline.QUICK.sizes + (512 * roofline.MiB,)),
            spec_batches=(1, 2, 4), spec_gammas=(2, 4), spec_tokens=speedup.RUN_TOKENS,
            spec_repeats=8, routing_batches=(1, 2, 4, 8, 16, 32), spec_budget_s=30.0 if quick else 120.0,
            spec_stop_when_decided=quick,
        )
    # --quick fits about 6 minutes on an 8 GB M1 by the dry run's estimate (pipeline/estimate.py):
    # the sparse MoE only, context 256, batches to 8 and two SD batch sizes; a hybrid
    # linear-attention MoE (the architecture most Mac SD reports of 2026 are about), the less
    # sparse MoE, context 512, batch 16-32 and the full SD grid are the default run's.
    moe: tuple[str, ...] = (("qwen1.5-moe-a2.7b",) if quick
                            else ("qwen1.5-moe-a2.7b", "qwen3.6-35b-a3b", "mixtral-8x7b"))
    if full:
        moe = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b", "deepseek-v2-lite", "mixtral-8x7b")
    return Plan(
        moe=moe, dense="qwen2.5-3b", draft="qwen2-0.5b",
        batches=(1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32),
        tokens=(1, 2, 3, 4, 6, 8), context=256 if quick else 512, bits=4,
        budget=timing.QUICK if quick else timing.Budget(),
        roofline=roofline.QUICK if quick else roofline.RooflineConfig(),
        spec_batches=(1, 4) if quick else (1, 2, 4, 8), spec_gammas=(2, 4),
        spec_tokens=speedup.RUN_TOKENS, spec_repeats=8,
        routing_batches=(1, 2, 4, 8, 16, 32), spec_budget_s=30.0 if quick else 120.0,
        spec_stop_when_decided=quick,
    )


def with_models(plan: Plan, names: tuple[str, ...]) -> Plan:
    """Replace the default targets: MoE models in the given order, the first dense one as control."""
    moe: list[str] = []
    dense: list[str] = []
    resolved = {name: models.resolve(name) for name in dict.fromkeys(names)}
    for name in names:
        (moe if zoo.expert_shape(resolved[name].config) else dense).append(name)
    if not moe:
        raise BadInput("--models needs at least one MoE model")
    return replace(plan, moe=tuple(moe), dense=dense[0] if dense else plan.dense,
                   resolved={**plan.resolved, **resolved})


@dataclass(frozen=True)
class PairPlan:
    """A run of one target/drafter pair: the grids of ``base`` (its ``moe`` is the target argument
    alone, no dense control; its ``draft`` the run's drafter model, whose step the sweep times),
    the prompt sets and temperatures SD and routing run on. ``target`` and ``draft`` are the
    names results and the report key them by: the models' resolved names, or ``prompt-lookup``."""

    base: Plan
    target: str
    draft: str
    prompt_sets: tuple[str, ...] = PROMPT_SETS
    temperatures: tuple[float, ...] = TEMPERATURES
    routing_length: int = 16  # tokens per routed sequence, one per prompt: prompts are short
    found: str = "given on the command line"
    max_prompts: int | None = None  # prompts per set the acceptance pass decodes (None: all)
    alpha: float = theory.DEFAULT_ALPHA  # the acceptance an MTP head's runs impose (run --alpha)

    @property
    def sources(self) -> models.Sources:
        """The target and the run's drafter model as ``pair_plans`` resolved them, once, into
        ``base.resolved``: the stages measure these, never the arguments again."""
        found = self.base.resolved
        return models.Sources(found[self.target_arg], found[self.base.draft] if self.base.draft else None)

    @property
    def spec_sources(self) -> models.Sources:
        """What SD drafts with: the run's drafter model, or none for prompt lookup and an MTP head."""
        return models.Sources(self.sources.target, self.sources.draft if self.drafter_kind == "model" else None)

    @property
    def target_arg(self) -> str:
        return self.base.moe[0]

    @property
    def draft_arg(self) -> str:
        """What SD is given as its drafter: the model as the command line named it, or the kind."""
        if self.draft in DRAFTER_KINDS:
            return self.draft
        assert self.base.draft is not None  # a drafter model's plan names it (pair_plans)
        return self.base.draft

    @property
    def drafter_kind(self) -> str:
        return drafter_kind(self.draft)

    def spec_config(self, prompt_set: str) -> speedup.SpecConfig:
        """The SD stage of this drafter on one prompt set: with its own drafts at the pair's
        temperatures, or an MTP head's with ``alpha`` imposed (``keys.PAIR_MODES``)."""
        base, mode = self.base, PAIR_MODES.get(self.drafter_kind, "real")
        return speedup.SpecConfig(target=self.target_arg, draft=self.draft_arg, batches=base.spec_batches,
                               gammas=base.spec_gammas, mode=mode, context=base.context,
                               new_tokens=base.spec_tokens, repeats=base.spec_repeats, budget_s=base.spec_budget_s,
                               prompts=prompt_set, alphas=(self.alpha,),
                               temperatures=self.temperatures if mode == "real" else (0.0,),
                               max_prompts=self.max_prompts, rollback=base.rollback,
                               stop_when_decided=base.spec_stop_when_decided)

    @property
    def draft_model(self) -> str | None:
        """The resolved name of the run's drafter model (the fit's T_D), or None without one."""
        draft = self.sources.draft
        return draft.name if draft is not None else None


def pair_plan(backend: str, quick: bool, target: str, draft: str,
              prompt_sets: tuple[str, ...] = PROMPT_SETS, found: str = "given on the command line") -> PairPlan:
    """``pair_plans`` of one drafter."""
    return pair_plans(backend, quick, target, (draft,), prompt_sets, found)[0]


def pair_plans(backend: str, quick: bool, target: str, drafts: tuple[str, ...],
               prompt_sets: tuple[str, ...] = PROMPT_SETS, found: str = "given on the command line",
               alpha: float = theory.DEFAULT_ALPHA) -> list[PairPlan]:
    """The default run's grids and budgets for this backend, on ``target`` with each of ``drafts``
    (a drafter model, at most one, ``prompt-lookup`` and ``mtp-head``, whose runs impose
    ``alpha``), one plan per drafter sharing the grids,
    weights as stored (no quantization of our own). Refuses, before anything is built, a model
    without weights, a target that is not an MoE model and a prompt set that cannot be read.
    (Embedding tables padded to different sizes under one tokenizer are fine; the SD stage checks
    that both models tokenise the prompts alike.)"""
    drafter_models = [d for d in dict.fromkeys(drafts) if d not in DRAFTER_KINDS]
    if len(drafter_models) > 1:
        raise BadInput(f"--draft names {len(drafter_models)} drafter models: a run fits one drafter's step "
                       "(name one model, and prompt-lookup or mtp-head beside it if you like)")
    draft = drafter_models[0] if drafter_models else None
    target_source = models.resolve(target)
    draft_source = models.resolve(draft) if draft else None
    for option, source in (("--target", target_source), ("--draft", draft_source)):
        if source is None:
            continue
        if not source.has_weights:
            raise BadInput(f"{option} {source.name} has no weights here (no *.safetensors): a pair run "
                           "measures trained weights; `run --models` measures random-weight models")
    if zoo.expert_shape(target_source.config) is None:
        raise BadInput(f"--target {target} is not an MoE model (its config names no experts)")
    # A missing or empty FILE is refused before anything runs; each set is named as it loads
    # (a FILE by its path, ~ expanded), the name SD's documents and their keys give it.
    prompt_sets = tuple(load_prompts(prompt_set).name for prompt_set in prompt_sets)
    base = default_plan(backend, quick)
    base = replace(base, moe=(target,), dense=None, draft=draft, bits=None,
                   routing_batches=tuple(b for b in base.routing_batches if b <= 16),
                   resolved={target: target_source, **({draft: draft_source} if draft and draft_source else {})})
    # --quick: the untimed acceptance pass decodes the first 10 prompts of each set (a third of
    # a built-in set); the timed runs still cycle through all of them.
    names = [draft_source.name if draft_source and d not in DRAFTER_KINDS else d for d in dict.fromkeys(drafts)]
    return [PairPlan(base, target_source.name, name, tuple(prompt_sets), found=found,
                     max_prompts=QUICK_PROMPTS if quick else None, alpha=alpha) for name in names]


def fits_in_memory(plan: Plan, usable_bytes: int) -> Callable[[str, str], str | None]:
    """A check for ``pairs.find_cached_pair``: None when target and drafter, built lazily at full
    depth, fit the SD stage's peak (``memory.spec_estimate``) in ``usable_bytes``, else why not."""
    def check(target: str, draft: str) -> str | None:
        try:
            cfg = speedup.SpecConfig(target=target, draft=draft, batches=plan.spec_batches,
                                  gammas=plan.spec_gammas, mode="real", context=plan.context,
                                  new_tokens=plan.spec_tokens, repeats=plan.spec_repeats)
            built_target = models.build(models.resolve(target))
            built_draft = models.build(models.resolve(draft))
        except (MacMoesdError, OSError, ValueError) as err:
            return f"cannot be opened: {err}"
        need = speedup.estimate(cfg, built_target, built_draft)["peak_bytes"]
        if need > usable_bytes:
            return (f"needs about {human_bytes(need)} for SD at full depth; "
                    f"{human_bytes(usable_bytes)} is usable here")
        return None

    return check


def find_default_pair(backend: str, quick: bool, usable_bytes: int,
                      prompt_sets: tuple[str, ...] = PROMPT_SETS) -> tuple[PairPlan | None, pairs.Search]:
    """On a GPU backend, the plan for the first known pair cached and fitting in memory."""
    base = default_plan(backend, quick)
    search = pairs.find_cached_pair(fits_in_memory(base, usable_bytes))
    if search.pair is None:
        return None, search
    plan = pair_plan(backend, quick, search.pair.target, search.pair.draft, prompt_sets,
                     found=f"found in the Hugging Face cache at {search.cache}")
    return plan, search
