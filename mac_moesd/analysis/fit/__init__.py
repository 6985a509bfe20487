"""Fit MoESD's Algorithm-1 time model to measured T_T(B,t), T_D(B,1), T_rej(B); predict S(B,gamma).

The 10 parameters, plus MagicDec's KV term k_kv*B*L, a cost per sequence k_seq*B and, on a hybrid,
its recurrent layers' sequential state update k_rec*layers*t, are fitted jointly with scipy's
trust-region-reflective least squares on relative residuals (every point weighs alike, as the
held-out MAPE does), once per expert-load variant (``theory.EXPERT_LOADS``); held-out error picks
the variant the predictions use, refitted on every point. Bounds follow MoESD: bias in
[V_dense*bytes/BW, 5x], k2 in [V_expert*bytes/BW, 5x] (both lower ends halved: BANDWIDTH_SLACK),
draft_bias likewise from the drafter's bytes, lam in [0.2, 1], s in
[1, 2], the rest >= 0. The knee of G is lam * ridge_in_tokens(RP, weight format), RP the measured
ridge for the model's compute dtype (or the chip's published one, said in the output); without
either the knee is fitted in tokens within the measured grid.

Without a drafter sweep only T_T is fitted: predictions carry target efficiency, and speedups
are None until T_D(B,1) is measured.

The expert-read term follows the unique experts the sweep counted at each point, and the
anchored correlation forms fitted to those counts between points (``expert_reads``).

The fit is to synchronous forwards; speedups are predicted with the timing each loop experiences
(``pipelining``): plain decode and drafter steps pipelined, as mlx-lm runs them. The one-row
forward T_T(1,1) is the sweep's own timing of it (``one_row``), not the curve's.

The KV term k_kv*B*L and a cost per sequence k_seq*B are told apart by the sweep's one-token
points timed at a second, shorter context (``kv_points``), fitted with the rest. A sweep without
them has one context only, where the two are the same function of B: k_seq is held at 0 and k_kv
carries both, which overstates the growth with context (on the CPU backend the ``mlx`` variant
fitted 5.5x the cache's bytes over the measured bandwidth) and the output says so.

The recurrent term grows with the tokens of a forward, not with the batch (each layer's state
update runs position after position; the batch's sequences side by side), so the grid's points of
one n = B*t at several t tell it from Algorithm 1's terms, which are functions of n. It is free
only where the sweep's footprint counts linear-attention or Mamba layers, and held at 0 elsewhere.

A sharded sweep (``sweep --parallel``) adds its measured communication term C(n)
(``analysis.cluster``) to T_T, fixed, not fitted; the document then has a ``cluster`` section.

Two terms a round come from lines through what the sweep timed beside the grid
(``analysis.round_terms``): the SD loop's bookkeeping (an empty round) and the drafter's start
(its chains timed right after a verify of the target, less the steps the fitted drafter prices
for them), each a + b*B seconds a round.

The package, split by what changes together: ``inputs`` reads a results file into ``FitInputs``;
``solve`` fits (bounds, least squares, variants, held-out error); ``model`` is the fitted model and
its predictions; ``document`` writes the fit into the results file and reads stored fits back.
Every public name is re-exported here, so ``fit.X`` works whichever module holds it.
"""

from mac_moesd.analysis.fit.document import (FitPredictor, RunPrediction, cluster_section, decoding_context,
                                             fit_document, kv_section, lookup_predictor, model_prediction,
                                             predictor_for, run_alpha, run_context, speedup_predictor, store_fit,
                                             sweep_plain_step)
from mac_moesd.analysis.fit.inputs import (DEFAULT_VERIFY, NO_CHAINS, NO_DRAFT, NO_PIPELINED, NO_REJECT, NO_SECOND_CONTEXT,
                                           ONE_CONTEXT_ONLY, FitInputs, inputs_from_results, mlx_sort_threshold)
from mac_moesd.analysis.fit.model import (DEFAULT_ALPHAS, DEFAULT_BATCHES, DEFAULT_GAMMAS, FitResult, FittedModel,
                                          VariantFit, paper_comparison, peaks, predict, sparsity_sweep,
                                          verify_tokens)
from mac_moesd.analysis.fit.solve import (BANDWIDTH_SLACK, REGIMES, bounds_for, draft_start, fit, fit_variant,
                                          measure_pipelining, regime, split)

__all__ = [
    "BANDWIDTH_SLACK", "DEFAULT_ALPHAS", "DEFAULT_BATCHES", "DEFAULT_GAMMAS", "DEFAULT_VERIFY", "NO_CHAINS", "NO_DRAFT",
    "NO_PIPELINED", "NO_REJECT", "NO_SECOND_CONTEXT", "ONE_CONTEXT_ONLY", "REGIMES", "FitInputs", "FitResult",
    "FittedModel", "VariantFit", "bounds_for", "cluster_section", "decoding_context", "draft_start", "fit", "fit_document",
    "fit_variant", "inputs_from_results", "kv_section", "lookup_predictor", "measure_pipelining",
    "mlx_sort_threshold", "paper_comparison", "peaks", "predict", "predictor_for", "regime", "run_alpha",
    "run_context", "model_prediction", "FitPredictor", "RunPrediction", "sparsity_sweep",
    "speedup_predictor", "split", "store_fit", "sweep_plain_step", "verify_tokens",
]
