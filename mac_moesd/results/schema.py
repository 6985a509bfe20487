"""The documents of a results file: the schema version and its history, and one
typed record per document, naming every key as the writers write it (docs/design.md §7 says what
each one means, in which units).

Every record is ``total=False``: a file from an earlier stage of the format lacks the keys added
after it, and its readers meet a missing key as "not measured then" (docs/design.md §8). A dict
whose figure could not be computed also holds ``null_reasons`` {key: reason} (``finite_json``).

Format history (``schema``):

- ``mac-moesd/1``: ``meta`` and the sections ``roofline``, ``sweeps`` (points keyed
  ``"<batch>x<tokens>"``), ``draft``, ``reject``, ``routing``, ``fits``, ``spec``, ``skipped``;
  grown under the same name by additions only (``pairs``, ``pair_search``, ``serving``, a sharded
  sweep's ``meta.cluster``, ``cluster`` and ``communication``, and keys inside every document: the
  eleven stages of docs/design.md §8).
- ``mac-moesd/2``: the format as the last ``mac-moesd/1`` files had it, its documents declared
  here. No key was renamed or removed, so ``upgrade`` reads a ``mac-moesd/1`` file as
  ``mac-moesd/2`` with what it never measured missing.
- ``mac-moesd/3``: SD runs audited. A spec run gains ``rollback`` (how its caches were rolled
  back, and the audit of them against plain decoding) and ``valid``, a greedy check ``margin``,
  ``near_tie`` and ``valid``, a round ``rollback_s``, a spec document ``valid``, a footprint
  ``layer_kinds``, a fit ``reforward``; later a spec run ``stopped``. Additions only again: a ``mac-moesd/2`` file reads as ``/3`` whose SD runs were
  never audited (the report says "-" where the audit goes); a file written now says ``/3``.

What ``upgrade`` migrates on load (the one place an older form is turned into today's, so no
reader keeps a fallback for it): an SD run recorded before ``predicted_by`` held its one
prediction in ``predicted_speedup`` (``predicted_from`` saying which, the fitted model's where
absent); it gains the ``predicted_by`` that prediction belongs in, with no fit named.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = [
    "READS", "SCHEMA", "upgrade",
    "Meta", "Measurement", "Memory", "Footprint", "ThermalPressure",
    "Roofline", "SweepEntry", "RejectEntry", "RoutingDocument", "FitDocument", "SpecDocument", "SpecRun",
    "AcceptanceEntry", "PairRecord", "PairSearch", "ServingDocument", "ServingLeg", "ClusterShape",
    "CommunicationEntry", "ResultsFile",
]

SCHEMA = "mac-moesd/3"
READS = ("mac-moesd/1", "mac-moesd/2", SCHEMA)  # what ``upgrade`` brings to today's form; others are refused


def upgrade(data: dict) -> dict:
    """A results document of any schema in ``READS``, in today's form (in place): the keys an
    earlier version lacks stay missing, and what the format history above lists is migrated.
    Malformed documents are left for ``validate`` to name."""
    spec = data.get("spec")
    for doc in spec.values() if isinstance(spec, dict) else ():
        for run in doc.get("runs", ()) if isinstance(doc, dict) and isinstance(doc.get("runs"), list) else ():
            if isinstance(run, dict) and "predicted_by" not in run and "predicted_speedup" in run:
                run["predicted_by"] = _predicted_by(run["predicted_speedup"], run.get("predicted_from"))
    data["schema"] = SCHEMA
    return data


def _predicted_by(predicted: float | None, source: str | None) -> PredictedBy:
    """An early run's one prediction, under what made it: the SD stage's timed forwards
    (``predicted_from == "measured"``) or the fitted model."""
    if source == "measured":
        return {"measured": predicted, "model": None, "fit": None}
    return {"measured": None, "model": predicted, "fit": None}


# ---- records shared by several documents (§7.2, §7.3) ----


class Blas(TypedDict, total=False):
    name: str
    path: str | None
    note: str
    warning: str | None
    threads: int | None  # OpenBLAS's thread count; None for any other BLAS


class Versions(TypedDict, total=False):
    mac_moesd: str
    python: str
    mlx: str
    mlx_lm: str
    numpy: str
    scipy: str


class LastRun(TypedDict, total=False):
    time: str
    command: str


class ClusterShape(TypedDict, total=False):
    """A sharded sweep's cluster (``meta.cluster`` and the ``cluster`` section, §7.13)."""
    ranks: int
    backend: str
    hosts: list[str]
    parallel: str


class Meta(TypedDict, total=False):
    chip: str
    chip_slug: str
    gpu_cores: int | None
    memory_bytes: int
    backend: str  # metal, cpu or cuda
    blas: Blas
    os: str
    power_source: str | None
    low_power_mode: bool | None
    thermal: dict | None  # pmset's thermal report on a Mac
    warnings: list[str]
    versions: Versions
    time: str  # UTC, ISO 8601
    command: str
    last_run: LastRun
    cluster: ClusterShape


class Measurement(TypedDict, total=False):
    """A timed point (seconds)."""
    median_s: float
    iqr_s: float
    cv: float
    min_s: float
    mean_s: float
    repeats: int
    ci_rel: float  # half-width of the median's 95% CI over the median
    converged: bool
    warmups: int
    samples_s: list[float]


class SweepPoint(Measurement, total=False):
    unique_experts: float  # mean distinct experts per MoE layer
    pairs: int  # B*t*K per layer


class PipelinedPoint(Measurement, total=False):
    steps: int  # the chain's length; the timing fields are per forward


class Memory(TypedDict, total=False):
    estimate_bytes: int
    peak_bytes: int  # mx.get_peak_memory()
    usable_bytes: int | None
    phase: str  # the estimate's largest phase
    parts: dict[str, int]
    wired_limit_bytes: int | None  # the roofline's
    wired_limit_note: str


class LayerKinds(TypedDict, total=False):
    """Decoder layers by how they mix the sequence (their cache) and by their FFN."""
    attention: int  # a KV cache of every past token
    sliding: int  # a KV cache of a window
    linear: int  # a recurrent state: GatedDeltaNet, Mamba2
    per_position: int  # linear layers an SD rollback takes back per position (the rest re-forward)
    moe: int
    mlp: int


class Footprint(TypedDict, total=False):
    params_total: int
    params_expert: int
    params_embedding: int
    params_head: int  # 0 when tied
    bytes_total: int
    bytes_expert: int
    bytes_embedding: int
    bytes_head: int
    experts: int | None
    top_k: int | None
    layers: int
    moe_layers: int
    layer_kinds: LayerKinds
    params_dense: int
    params_active: int
    bytes_dense_streamed: float  # read once per forward
    bytes_per_expert: float  # one expert over all MoE layers


class ThermalPressure(TypedDict, total=False):
    before: str | None  # nominal, moderate, heavy, trapping, sleeping
    after: str | None


# ---- roofline (§7.4) ----


class KernelPath(TypedDict, total=False):
    path: str
    reason: str


class KernelPaths(TypedDict, total=False):
    """Which path the roofline's kernels took (metal, mlx or mixed), and why."""
    path: str
    note: str
    per_kernel: dict[str, KernelPath]


class RooflineShape(TypedDict, total=False):
    sizes_bytes: list[int]
    gemv_bytes: int
    min_launch_bytes: int
    peak_bytes: int


Shrunk = TypedDict("Shrunk", {"usable_bytes": int, "from": RooflineShape, "to": RooflineShape,
                              "plateau_reached": bool}, total=False)


class LaunchTiming(TypedDict, total=False):
    """Per-launch timing fields: seconds per launch; ``eval_median_s`` the whole evaluation."""
    median_s: float
    cv: float
    repeats: int
    launches: int
    eval_median_s: float


class SizeRow(LaunchTiming, total=False):
    op: str  # read, copy, triad
    bytes: int
    moved_bytes: int
    live_output_bytes: int
    gbs: float


class GemvRow(LaunchTiming, total=False):
    bytes: int
    copies: int
    distinct_bytes: int
    dtype: str
    gbs: float


class MatmulRow(LaunchTiming, total=False):
    n: int
    tflops: float


class FmaRow(LaunchTiming, total=False):
    tflops: float


class QmmRow(LaunchTiming, total=False):
    bits: int
    tokens: int
    dtype: str
    tflops: float
    weight_bytes: int
    copies: int
    distinct_bytes: int


class ChipSpec(TypedDict, total=False):
    """A chip's published figures."""
    name: str
    gpu_cores: int
    bandwidth_bytes_s: float
    fp32_flops: float | None
    source: str
    derived: str
    ridge_flop_per_byte: float | None


class FractionOfSpec(TypedDict, total=False):
    bandwidth: float
    fp32_flops: float


class Roofline(TypedDict, total=False):
    backend: str
    kernels: KernelPaths
    compute_dtype: str
    memory: Memory
    shrunk: Shrunk | None
    distinct_bytes: int
    bandwidth_gbs: dict[str, float]  # read, copy, triad, gemv_<label>
    bandwidth_ceiling_gbs: float
    bandwidth_ceiling_source: str
    flops_tflops: dict[str, float]  # float32, float16, bfloat16, fma_float32 on Metal
    ridge_dtype: str
    ridge_flop_per_byte: float
    ridge_by_dtype: dict[str, float]
    ridge_tokens: dict[str, float]  # fp16, 8bit, 4bit
    qmm_knee_tokens: dict[str, float | None]  # "4", "8"
    size_sweep: list[SizeRow]
    gemv: dict[str, GemvRow]
    matmul: dict[str, MatmulRow]
    fma: FmaRow | None
    qmm_curve: list[QmmRow]
    spec: ChipSpec | None
    fraction_of_spec: FractionOfSpec | None
    thermal_pressure: ThermalPressure


# ---- sweeps, draft, reject (§7.5-7.7) ----


class Drift(TypedDict, total=False):
    point: str  # a point_key
    before_s: float
    after_s: float
    threshold: float
    change: float
    flagged: bool


class DraftChains(TypedDict, total=False):
    """A drafter's chains timed after a verify of the target whose sweep entry holds them."""
    points: dict[str, Measurement]  # point_key(batch, gamma): a chain of gamma one-token steps
    skipped: str  # why none were timed (the two models did not fit together; a sharded sweep)


class SweepEntry(TypedDict, total=False):
    """An entry of ``sweeps`` (and of ``draft``, with ``role``), keyed
    ``<model>|<format>|L<context>|layers<N>[|routing=<mode>][|gather=sorted]``."""
    model: str
    role: str  # "draft" in the draft section
    dtype: str
    bits: int | None
    context: int
    layers: int
    layers_full: int
    vocab: int
    footprint: Footprint
    routing: str  # model, uniform, correlated:C, trace:FILE
    gather: str  # mlx-lm or sorted
    points: dict[str, SweepPoint]  # by point_key
    pipelined_points: dict[str, PipelinedPoint]
    kv_context: int | None
    kv_points: dict[str, dict[str, Measurement]]  # second context -> point_key -> point
    kv_twins: dict[str, dict[str, Measurement]]
    kv_untrimmable: bool
    draft_chains: dict[str, DraftChains]  # by drafter: its chains after this entry's verify (§7.5)
    drift: Drift | None
    memory: Memory
    thermal_pressure: ThermalPressure


class RejectEntry(TypedDict, total=False):
    """An entry of ``reject``, keyed ``V<vocab>|gamma<g>``."""
    vocab: int
    gamma: int
    points: dict[str, Measurement]  # point_key(B, gamma + 1)
    bookkeeping_points: dict[str, Measurement]  # the SD loop's empty round at the same shapes
    memory: Memory
    thermal_pressure: ThermalPressure


# ---- routing (§7.8) ----


class RoutingWindow(TypedDict, total=False):
    batch: int
    tokens: int
    measured_unique: float
    std_unique: float
    windows: int
    uniform_unique: float


class Saturation(TypedDict, total=False):
    batch: int
    gamma: int
    verify_tokens: int
    unique: float
    source: str  # measured or predicted
    saturated: bool


class RoutingDocument(TypedDict, total=False):
    """A ``routing`` document, keyed ``<model>|<text>``."""
    experts: int
    top_k: int
    rho: float
    tau: float
    windows: list[RoutingWindow]
    correlation: float | None
    batch_correlation: float | None
    threshold_uniform: float
    threshold_corrected: float | None
    saturation: list[Saturation]
    model: str
    text: str
    token_ids: str
    sequences: int
    length: int
    layers_measured: int
    layers_full: int
    moe_layers_measured: int
    memory: Memory
    trace: str
    thermal_pressure: ThermalPressure


# ---- fits (§7.9) ----


class FitPoint(TypedDict, total=False):
    batch: int
    tokens: int
    measured_s: float
    predicted_s: float
    error: float
    context: int  # at the second context


class Variant(TypedDict, total=False):
    name: str
    heldout_mape: float
    params: dict[str, float | None]
    k_kv: float
    k_seq: float
    k_rec: float  # seconds per token per recurrent layer (0: none)
    knee_tokens: float | None
    worst_point: FitPoint


class Pipelining(TypedDict, total=False):
    """Seconds per forward that pipelining hides, for the target and for the drafter."""
    target_s: float
    draft_s: float
    target_points: int  # points timed both ways that the figure comes from
    draft_points: int
    target_mape: float | None  # the fitted T_T minus target_s against the pipelined points
    weighted: bool  # the figures 1/T_sync^2-weighted means of the differences (absent: medians, older fits)


class FitRouting(TypedDict, total=False):
    correlation: float | None
    batch_correlation: float | None
    counts: list[list[float]]  # [B, t, unique]


class OneRow(TypedDict, total=False):
    """T_T(1,1) as the sweep timed it at ``context``: synchronous and, where timed, pipelined."""
    context: int
    sync_s: float
    pipelined_s: float | None


class KvTerm(TypedDict, total=False):
    context: int
    second_context: int | None
    separated: bool
    k_kv: float
    k_seq: float
    mape: float | None
    points: list[FitPoint]


class Prediction(TypedDict, total=False):
    batch: int
    gamma: int
    alpha: float
    speedup: float | None  # null when the fit had no drafter
    target_efficiency: float
    break_even_alpha: float | None
    break_even_draft_ratio: float | None


class Peak(TypedDict, total=False):
    gamma: int
    alpha: float
    peak_batch: int
    peak_speedup: float
    window: list[int]  # [low, high]


class SparsityRow(TypedDict, total=False):
    top_k: int
    rho: float
    peak_batch: int
    peak_speedup: float
    speedup_batch1: float


class PaperComparison(TypedDict, total=False):
    gamma: int
    alpha: float
    chosen: float
    unique: float
    unique_paper_verify: float


class CommunicationKind(TypedDict, total=False):
    op: str
    count: float
    bytes_per_token: float
    latency_s: float
    seconds_per_byte: float
    points: int
    bandwidth_bytes_s: float | None


class FitCommunication(TypedDict, total=False):
    kinds: list[CommunicationKind]


class ClusterRow(TypedDict, total=False):
    batch: int
    gamma: int
    alpha: float
    speedup: float | None
    speedup_free_link: float | None
    comm_share_plain: float
    verify_tokens: int
    comm_share_verify: float
    comm_per_token_verify_s: float
    comm_per_token_plain_s: float


class FitCluster(ClusterShape, total=False):
    verify_tokens: str
    rows: list[ClusterRow]


class RoundTerm(TypedDict, total=False):
    """A term of the fit a round, T(B, gamma) = a_s + b_s * B + c_s * (gamma - 1): the SD loop's
    bookkeeping (c_s 0), the drafter's start."""
    a_s: float
    b_s: float
    c_s: float  # per draft step beyond the first (absent in fits made before it: 0)
    points: int  # the sweep's timings it was fitted to (0: none timed, the term is zero)
    mape: float | None


class FitDocument(TypedDict, total=False):
    """A ``fits`` document, keyed by model name; one without ``chosen`` predates the variants."""
    model: str
    fitted_at: str  # UTC, ISO 8601 to the microsecond: names this fit
    draft_model: str | None
    drafted: bool
    reforward: list[str]  # target and/or draft: models whose rollback re-forwards the kept tokens
    experts: int
    top_k: int
    context: int
    weight_format: str
    ridge_flop_per_byte: float | None  # null when the knee was fitted in the grid
    ridge_source: str
    ridge_tokens: float
    knee_tokens: float | None
    bandwidth_bytes_s: float | None
    bandwidth_source: str
    verify_tokens: str  # "gamma+1" or "gamma"
    extrapolated: bool
    sort_threshold: int
    sort_threshold_source: str
    sorted_from_tokens: float | None
    chosen: str
    regime: str
    variants: list[Variant]
    missing: list[str]
    pipelining: Pipelining
    bookkeeping: RoundTerm
    draft_start: RoundTerm  # the drafter's chain after the verify, beyond its fitted steps
    routing: FitRouting
    one_row: OneRow | None
    params: dict[str, float | None]
    k_kv: float  # seconds per cached token per sequence
    k_seq: float  # seconds per sequence
    k_rec: float  # seconds per token per recurrent layer, whatever the batch (0: none)
    linear_layers: int  # the target's recurrent layers, k_rec's multiplier
    kv: KvTerm
    bounds: dict[str, list[float | None]]  # [low, high or null for unbounded]
    train_points: list[FitPoint]
    heldout_points: list[FitPoint]
    heldout_mape: float
    worst_point: FitPoint
    predictions: list[Prediction]
    peaks: list[Peak]
    sparsity: list[SparsityRow]
    paper_comparison: list[PaperComparison]
    communication: FitCommunication | None
    cluster: FitCluster | None
    thermal_pressure: ThermalPressure | None  # around the fit stage of a run


# ---- spec (§7.10) ----


class PromptsUsed(TypedDict, total=False):
    name: str
    encoding: str  # chat template, plain or random
    count: int | None  # None where the run used random ids
    tokens: list[int] | None  # [min, max]


class SpecLayers(TypedDict, total=False):
    target: int
    target_full: int
    draft: int | None  # null: prompt lookup, no drafter model; 1: an MTP head
    draft_full: int | None
    sliced: bool


class RoundMedians(TypedDict, total=False):
    verify: float
    target_step: float
    draft: float
    reject: float
    rollback: float  # one rejected round's rollback, both models
    bookkeeping: float  # the loop's empty round: token choice, synchronisation, acceptance decision
    draft_caught_up: float  # the suite's loop: drafting after a round that accepted every draft


class LookupRule(TypedDict, total=False):
    max_ngram: int
    min_ngram: int


class LookupRecord(LookupRule, total=False):
    """What prompt lookup proposed over a run's timed SD decodes."""
    proposal_rate: float  # share of (sequence, round)s with a proposal
    mean_proposal: float  # draft tokens of a proposal, where there was one
    mean_width: float  # draft tokens a round verified (the batch's longest proposal)
    rolled_back_share: float  # share of rounds that rolled back


class RoundAccount(TypedDict, total=False):
    """The round as priced from the SD stage's own timings of its parts."""
    samples: int
    median_s: RoundMedians
    speedup: float
    plain_s: float
    verify_s: float
    draft_s: float
    reject_s: float
    rollback_s: float  # the rollback's cost times how often a round rejects; counted in round_s
    bookkeeping_s: float  # the loop's own work a round; counted in round_s
    round_s: float
    measured_s: float | None  # mean tokens per round over one sequence's SD tokens/s: what round_s prices
    hidden_s: float
    tokens_per_round: float
    verify_by_tokens: dict[str, float]  # prompt lookup: the verify at each width timed, by tokens


class PredictedBy(TypedDict, total=False):
    measured: float | None
    model: float | None
    fit: str | None  # the ``fitted_at`` of the fit that priced ``model``


class GreedyCheck(TypedDict, total=False):
    sequences: int
    tokens_compared: int
    mismatched: int
    mismatch_rate: float | None  # None when no sequence was compared
    first_mismatch_at: list[int] | int | None  # per mismatched sequence (a single int in early files)
    margin: list[float | None]  # per sequence: the target's top-1 minus top-2 logit at its first mismatch
    near_tie: list[bool]  # per sequence: that margin is under the dtype's near-tie threshold
    valid: bool  # no mismatch, or only near-ties


class RollbackAudit(TypedDict, total=False):
    ok: bool
    max_abs_diff: float | None  # over both models' caches, each array's relative to its max |value|
    tolerance: float | None
    reason: str  # where structure or offsets differ


class RollbackRecord(TypedDict, total=False):
    """How a run's caches were rolled back after rejected drafts, and the audit of them."""
    strategy: str  # the costliest that ran: none, trim, window, per-position, replay, re-forward
    requested: str  # --rollback: auto, per-position, replay, re-forward
    cache_kinds: list[str]  # mlx-lm cache classes of target and drafter
    rounds: dict[str, dict[str, int]]  # target/draft: rounds per strategy
    audit: RollbackAudit


class RuleStats(TypedDict, total=False):
    """A timed run's tokens per round under one acceptance rule, and what it would predict."""
    alpha: float | None
    sigma: float | None
    mean_accepted: float
    predicted_speedup: float | None


Rules = TypedDict("Rules", {"ratio_tokens_per_round": float, "projected_speedup_rejection": float | None,
                            "mlx-lm": RuleStats, "rejection": RuleStats}, total=False)


class SpecRun(TypedDict, total=False):
    """One timed configuration of a spec document."""
    batch: int
    gamma: int
    alpha: float | None  # imposed, or solved
    mode: str
    drafter_kind: str  # model, self, prompt-lookup, mtp-head
    lookup: LookupRecord
    prompts: str
    temperature: float
    measured_acceptance: float  # files of docs/design.md §8 stage 1, before measured_alpha
    measured_alpha: float | None
    mean_accepted: float
    sigma: float | None
    acceptance_by_position: list[float | None]  # null: no round offered that position (prompt lookup)
    rounds: int
    predicted_speedup: float | None
    predicted_from: str | None  # measured, model
    predicted_by: PredictedBy
    round: RoundAccount | None
    plain_vs_sweep: float | None
    plain_step_s: float
    repeats: int  # the fewest pairs
    pairs: int
    tokens_per_s_plain: float
    tokens_per_s_sd: float
    cv_plain: float
    cv_sd: float
    cv_pairs: float  # the per-pair speedups' coefficient of variation: what sets the pairs needed
    measured_speedup: float
    speedup_range: list[float]  # [min, max]
    measured_ci: list[float]  # [low, high]
    measured_ci_method: str  # order statistics (timing.median_ci); absent in older records: percentile bootstrap
    pooled_tokens_per_round: float | None  # each pair's SD rate is its rounds/s times this (all sequences); absent in older records: the run's own tokens/s
    precision: float
    precision_met: bool
    stopped: str  # what ended its pairs: precision | decided | budget | repeats (fewer than timing.MEDIAN_CI_MIN)
    budget_s: float
    asked: bool
    recommended: bool
    engine: str  # mlx-lm or mac-moesd loop
    context: float  # mean prompt tokens of its pairs
    greedy_check: GreedyCheck
    rules: Rules
    rollback: RollbackRecord
    valid: bool  # rollback audit ok and greedy check valid


class MeasuredAcceptance(TypedDict, total=False):
    rounds: int
    mean_accepted: float
    sigma: float | None
    acceptance_by_position: list[float | None]
    alpha: float | None


class AcceptanceEntry(TypedDict, total=False):
    """The untimed acceptance pass of a real-mode spec run, one per gamma and temperature."""
    gamma: int
    temperature: float
    prompts_measured: int
    new_tokens: int
    rule_run: str  # greedy or mlx-lm
    measured: MeasuredAcceptance
    proposal_rate: float  # prompt lookup: share of rounds with a proposal
    greedy_check: GreedyCheck
    rules: dict[str, MeasuredAcceptance]  # mlx-lm, rejection
    rejection_over_mlx_lm: float | None


class SpecDocument(TypedDict, total=False):
    """A ``spec`` document, keyed ``<target>|<draft>|<mode>[|<prompt set>]``."""
    target: str
    draft: str  # the drafter's resolved name, or prompt-lookup / mtp-head
    drafter_kind: str  # model, self, prompt-lookup, mtp-head
    lookup: LookupRule
    context: float
    new_tokens: int
    verify_tokens: str  # gamma+1
    prompts: PromptsUsed
    temperatures: list[float]
    runs: list[SpecRun]
    acceptance: list[AcceptanceEntry]
    layers: SpecLayers
    memory: Memory
    thermal_pressure: ThermalPressure
    valid: bool  # every run valid


# ---- pairs and pair_search (§7.11) ----


class PairRecord(TypedDict, total=False):
    """A ``pairs`` entry, keyed ``<target>|<draft>``, written when a pair run starts (one per
    drafter of the run: a drafter model's resolved name, or prompt-lookup)."""
    target: str
    draft: str
    drafter_kind: str  # model, prompt-lookup, mtp-head
    target_arg: str
    draft_arg: str
    found: str
    prompt_sets: list[str]
    temperatures: list[float]
    acceptance_prompts: int | None  # null: all
    stored: dict[str, str]  # target, draft (a drafter model's): weight formats as stored
    context: int
    spec_batches: list[int]
    spec_gammas: list[int]
    sweep_routing: PairSweepRouting  # how the pair's sweep routed its experts


class PairSweepRouting(TypedDict, total=False):
    """A pair sweep's routing: its prompt sets' recorded traces replayed, or the model's own
    router where the traces hold too few sequences (then ``why``)."""
    routing: str  # as `sweep --routing` takes it
    key: str  # as the sweep's results key names it
    why: str
    trace: str  # traces/<file>, beside results.json
    prompt_sets: list[str]
    sequences: int
    length: int
    spans_per_sequence: int


class PairSearch(TypedDict, total=False):
    """``pair_search["latest"]``: what ``run`` on a GPU without ``--target`` found."""
    target: str | None
    draft: str | None
    cache: str
    passed_over: dict[str, str]


# ---- serving (§7.12) ----


class Percentiles(TypedDict, total=False):
    p50: float | None
    p95: float | None
    n: int
    why: str


class InFlight(TypedDict, total=False):
    mean: float | None  # None over an empty window
    max: int | None


class SdCounters(TypedDict, total=False):
    """A leg's draft counters as the server reported them (``measure.server.sd_counters``)."""
    source: str
    drafts: int | None  # verify rounds; None where the server does not report it
    drafted: int | None  # draft tokens
    accepted: int | None  # accepted draft tokens
    accepted_by_position: list[int] | None
    acceptance_rate: float | None
    note: str
    reported: bool
    why: str


class DrafterReported(TypedDict, total=False):
    kind: str | None  # e.g. "mtp", where the server names it
    num_draft: int | None


class ClientCpu(TypedDict, total=False):
    cpu_s: float
    wall_s: float
    share_of_one_core: float | None  # None when no wall time passed
    request_cap_reached: bool


class ServingLeg(TypedDict, total=False):
    server: str
    drafter: str | None
    gamma: int | None
    concurrency: int
    prompts: str
    window_s: float
    warmup_s: float
    max_tokens: int
    requests: int
    failed: int
    errors: dict[str, int]
    cut: int
    status: str  # ok or failed
    status_reason: str | None
    tokens: float  # tokens generated inside the window (weighted by usage per chunk)
    early_stops: int
    aggregate_tok_s: float | None
    per_request_tok_s: Percentiles
    ttft_s: Percentiles
    itl_s: Percentiles
    in_flight: InFlight
    prompt_tokens_mean: float | None
    sd_counters: SdCounters
    drafter_reported: DrafterReported
    client_cpu: ClientCpu


class ServingPrediction(TypedDict, total=False):
    prompts: str
    concurrency: int
    context: float
    plain_tok_s: float | None
    sd_batched_tok_s: float | None
    sd_all_or_nothing_tok_s: float | None
    acceptance: float | None
    acceptance_source: str | None
    why: str


class SharedPrefix(TypedDict, total=False):
    tokens: int
    counted_by: str | None


class ServingDocument(TypedDict, total=False):
    """A ``serving`` document, keyed ``<target>|<draft>`` or ``url:<name,...>``; saved after
    every leg, ``complete`` once all ran. A ``server`` entry records how it was started
    (launched: ``pid``, ``log``, ``draft``, ``gamma``, its concurrency and notes on the copies
    served; probed: ``models``)."""
    target: str | None
    draft: str | None
    target_name: str | None
    draft_name: str | None
    gamma: int | None
    tokens: int
    prompts: list[str]
    concurrency: list[int]
    window_s: float
    warmup_s: float
    shared_prefix: SharedPrefix | None
    server: list[dict]
    legs: list[ServingLeg]
    predicted: list[ServingPrediction]
    predicted_reason: str | None
    crossover_concurrency: int | None
    crossover_reason: str | None
    complete: bool
    notes: list[str]
    thermal_pressure: ThermalPressure


# ---- a sharded sweep's communication (§7.13) ----


class CollectiveOp(TypedDict, total=False):
    op: str  # all_sum, all_gather, sendrecv
    shape: list[int]
    dtype: str
    count: int  # per forward
    bytes: int  # per call
    launches: int
    median_s: float  # per call
    iqr_s: float
    cv: float
    repeats: int


class CommunicationPoint(TypedDict, total=False):
    ops: list[CollectiveOp]
    total_s: float  # sum of count x median


class CommunicationEntry(TypedDict, total=False):
    """A ``communication`` entry, keyed like ``sweeps``."""
    model: str
    context: int
    parallel: str
    ranks: int
    points: dict[str, CommunicationPoint]  # by point_key


# ---- the file (§7.1) ----


class ModelIdentity(TypedDict):
    """A model as the results name it (``ModelSource.identity``)."""
    config_sha256: str  # the first 16 hex digits of its config's digest
    weights: str  # "stored" or "random"


class ResultsFile(TypedDict, total=False):
    schema: str
    meta: Meta
    models: dict[str, ModelIdentity]  # by the name its results are keyed by
    roofline: Roofline
    sweeps: dict[str, SweepEntry]
    draft: dict[str, SweepEntry]
    reject: dict[str, RejectEntry]
    routing: dict[str, RoutingDocument]
    fits: dict[str, FitDocument]
    spec: dict[str, SpecDocument]
    pairs: dict[str, PairRecord]
    pair_search: dict[str, PairSearch]  # key "latest"
    serving: dict[str, ServingDocument]
    cluster: ClusterShape
    communication: dict[str, CommunicationEntry]
    skipped: dict[str, str]  # stage label -> why it did not run
