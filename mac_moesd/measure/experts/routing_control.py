"""Routing control for the sweep: which experts every MoE layer runs during the timed forwards.

`sweep --routing` takes one of
- ``model``: the model's own router (nothing replaced; the experts it chose are counted);
- ``uniform``: each token picks K of E experts uniformly without replacement, independently of
  every other token: MoESD's assumption, under which B*t tokens activate N(B*t) experts;
- ``correlated:C``: each sequence's consecutive tokens reuse experts so that t of them activate
  N(1 + C*(t-1)) in expectation (docs/design.md §2.3's anchored form), sequences independent;
- ``trace:FILE``: the choices a real model made on real text (``routing --save-trace``); a
  batch larger than the trace holds sequences takes earlier, disjoint spans of them
  (``trace_window``).

The router's gate still runs (its cost stays in T_T); only the indices the experts receive are
replaced, through ``routing.controlled_switches``. Indices are generated per grid point before
any timing, as MLX arrays, from a seed and the point alone, so a resumed sweep replays the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mac_moesd.errors import BadInput
from mac_moesd.measure.experts import routing
from mac_moesd.measure.experts.gather import GATHERS
from mac_moesd.measure.experts.routing_trace import Trace, load_trace

__all__ = ["RoutingMode", "SweepRouting", "correlated_indices", "parse_routing", "spans_per_sequence",
           "trace_capacity", "trace_window", "uniform_indices"]

KINDS = ("model", "uniform", "correlated", "trace")
HELP = "model, uniform, correlated:C (C in [0, 1]) or trace:FILE"


@dataclass(frozen=True)
class RoutingMode:
    kind: str
    correlation: float | None = None
    trace: Trace | None = None
    trace_path: Path | None = None

    @property
    def label(self) -> str:
        """As the sweep document records it: model, uniform, correlated:C or trace:FILE."""
        if self.kind == "correlated":
            return f"correlated:{self.correlation:g}"
        if self.kind == "trace":
            return f"trace:{self.trace_path}"
        return self.kind

    @property
    def key(self) -> str:
        """As a results key names it: a trace by file name and content digest."""
        if self.kind == "trace":
            assert self.trace is not None and self.trace_path is not None  # parse_routing sets both
            return f"trace:{self.trace_path.name}@{self.trace.digest}"
        return self.label

    @property
    def forced(self) -> bool:
        return self.kind != "model"


def parse_routing(spec: str) -> RoutingMode:
    """A --routing value as a mode; BadInput with the accepted forms otherwise."""
    kind, _, arg = spec.partition(":")
    if kind in ("model", "uniform") and not arg:
        return RoutingMode(kind)
    if kind == "correlated":
        try:
            c = float(arg)
        except ValueError:
            c = -1.0
        if not 0.0 <= c <= 1.0:
            raise BadInput(f"--routing correlated:C needs C in [0, 1], got {arg!r}")
        return RoutingMode(kind, correlation=c)
    if kind == "trace" and arg:
        path = Path(arg).expanduser().resolve()
        return RoutingMode(kind, trace=load_trace(path), trace_path=path)
    raise BadInput(f"--routing must be {HELP}, got {spec!r}")


def check_against_model(mode: RoutingMode, gather: str, shape: tuple[int, int] | None, name: str,
                        batches: tuple[int, ...], tokens: tuple[int, ...]) -> None:
    """Refuse, before anything is allocated, a routing or gather the model cannot run."""
    if gather not in GATHERS:
        raise BadInput(f"--gather must be one of {', '.join(GATHERS)}, got {gather!r}")
    if shape is None:
        asked = [f"--routing {mode.label}"] * mode.forced + [f"--gather {gather}"] * (gather != "mlx-lm")
        if asked:
            raise BadInput(f"{' and '.join(asked)} need an MoE model; {name} is dense")
        return
    trace, path = mode.trace, mode.trace_path
    if trace is None:
        return
    assert path is not None  # parse_routing sets both
    if (trace.experts, trace.top_k) != shape:
        raise BadInput(f"trace {path.name} has E={trace.experts}, K={trace.top_k} "
                       f"({trace.model}); {name} has E={shape[0]}, K={shape[1]}")
    batch, window = max(batches), max(tokens)  # the largest batch at the longest window needs most
    if batch > trace_capacity(trace, window):
        raise BadInput(f"trace {path.name} holds {trace.sequences} sequences of {trace.length} "
                       f"tokens ({trace_capacity(trace, window)} disjoint windows of {window}); this grid "
                       f"needs {batch} of {window}")


# ---- index generators: (B, t, K) arrays of distinct expert ids per token ----


def uniform_indices(rng: np.random.Generator, batch: int, tokens: int, experts: int,
                    top_k: int) -> np.ndarray:
    """Each token: K of E experts uniformly without replacement, all tokens independent."""
    keys = rng.random((batch * tokens, experts))
    return np.argsort(keys, axis=1)[:, :top_k].reshape(batch, tokens, top_k)


def correlated_indices(rng: np.random.Generator, batch: int, tokens: int, experts: int,
                       top_k: int, correlation: float) -> np.ndarray:
    """B independent sequences whose t consecutive tokens activate N(1 + c*(t-1)) in expectation.

    The first token is uniform. Each later token takes m experts its sequence has not used yet
    and reuses K - m of the previous token's. With U used so far, N_c's step is
    N_c(t) - N_c(t-1) = (E - N_c(t-1)) * (1 - (1-rho)^c), linear in what is unused, so drawing
    m ~ Binomial(M, mu/M) with mu = (E - U)(1 - (1-rho)^c) and M = min(K, E - U) (mu <= M for
    c <= 1) makes E[U_t] follow N_c(t) exactly. c = 1 gives uniform counts; c = 0 repeats
    the first token's experts.
    """
    out = np.empty((batch, tokens, top_k), dtype=np.int64)
    stay = (1.0 - top_k / experts) ** correlation
    for b in range(batch):
        used = np.zeros(experts, dtype=bool)
        previous = rng.choice(experts, top_k, replace=False)
        used[previous] = True
        out[b, 0] = previous
        for t in range(1, tokens):
            unused = np.flatnonzero(~used)
            most = min(top_k, unused.size)
            mean = unused.size * (1.0 - stay)
            fresh = rng.binomial(most, min(1.0, mean / most)) if most else 0
            chosen = np.concatenate([rng.choice(unused, fresh, replace=False),
                                     rng.choice(previous, top_k - fresh, replace=False)])
            used[chosen] = True
            out[b, t] = previous = chosen
    return out


def trace_capacity(trace: Trace, tokens: int) -> int:
    """How many sequences of ``tokens`` consecutive tokens a replay of ``trace`` can fill: each
    trace sequence gives its disjoint spans of that length."""
    return trace.sequences * (trace.length // tokens)


def spans_per_sequence(trace: Trace, batch: int) -> int:
    """The most spans of one trace sequence a batch of ``batch`` replays (1: every sequence of the
    batch is a different sequence of the trace)."""
    return -(-batch // trace.sequences)


def trace_window(trace: Trace, layer: int, batch: int, tokens: int) -> np.ndarray:
    """The replayed (B, t, K) window of MoE layer ``layer``. Sequence j of the batch replays t
    consecutive tokens of the trace's sequence j mod S: the last t (routed with the most context,
    as a verify window would be) while j < S, then, for a batch larger than the trace's S
    sequences, the t tokens before those, and so on (span j // S from the end). Each replayed
    sequence is routing the model chose on consecutive real tokens, and the first S are different
    texts; only a batch over S pairs a sequence with an earlier, disjoint span of the same text,
    which shares its topic and so overlaps it in experts more than another text would. Nothing
    is repeated or made up; a batch the trace cannot fill is refused (``check_against_model``).
    A model deeper than the trace cycles through the trace's layers."""
    if batch > trace_capacity(trace, tokens):
        raise BadInput(f"a trace of {trace.sequences} sequences of {trace.length} tokens cannot replay "
                       f"{batch} of {tokens}")
    slots = np.arange(batch)
    sequence, span = slots % trace.sequences, slots // trace.sequences
    positions = (trace.length - (span + 1) * tokens)[:, None] + np.arange(tokens)
    return trace.indices[layer % trace.layers][sequence[:, None], positions].astype(np.int64)


def unique_per_layer(per_layer: list[np.ndarray]) -> float:
    """Mean over MoE layers of the distinct experts one forward's indices hold."""
    return float(np.mean([np.unique(layer).size for layer in per_layer]))


# ---- during the sweep ----


class SweepRouting:
    """Routing and gather of one model's sweep: ``installed`` around the grid, ``prepare`` each
    point before it is timed (untimed), then ``run`` its forward with the prepared indices."""

    def __init__(self, model: nn.Module, mode: RoutingMode, gather: str, experts: int, top_k: int,
                 seed: int = 0):
        self.model, self.mode, self.gather = model, mode, gather
        self.experts, self.top_k, self.seed = experts, top_k, seed
        self.controls: list[routing.SwitchControl] | None = None
        self.prepared: dict[tuple[int, int], list[mx.array] | None] = {}
        self.stats: dict[tuple[int, int], dict] = {}  # (B, t): what prepare counted

    @contextlib.contextmanager
    def installed(self):
        """Control the switches while the grid runs; with the model's routing and mlx-lm's gather
        nothing is installed, so those timings carry no extra call per layer."""
        if not self.mode.forced and self.gather == "mlx-lm":
            yield self
            return
        with routing.controlled_switches(self.model, always_sort=self.gather == "sorted") as controls:
            self.controls = controls
            try:
                yield self
            finally:
                self.controls = None

    def generate(self, batch: int, tokens: int, layers: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, batch, tokens])
        if self.mode.kind == "uniform":
            return [uniform_indices(rng, batch, tokens, self.experts, self.top_k) for _ in range(layers)]
        if self.mode.kind == "correlated":
            correlation = self.mode.correlation
            assert correlation is not None  # parse_routing sets it
            return [correlated_indices(rng, batch, tokens, self.experts, self.top_k, correlation)
                    for _ in range(layers)]
        trace = self.mode.trace
        assert trace is not None  # the remaining forced kind
        return [trace_window(trace, layer, batch, tokens) for layer in range(layers)]

    def prepare(self, batch: int, tokens: int, forward: Callable[[], object],
                rollback: Callable[[], None]) -> dict:
        """One untimed forward records what the router chooses (shape and dtype of its indices);
        forced modes then generate theirs. Returns the point's ``unique_experts`` (mean per MoE
        layer) and ``pairs`` (B*t*K per layer), as the timed forwards will run them. A point
        prepared before (its synchronous and pipelined timings share it) is not prepared again."""
        if (batch, tokens) in self.stats:
            return self.stats[(batch, tokens)]
        with routing.capture_routing(self.model) as sinks:
            mx.eval(forward())
        rollback()
        chosen = [sink[0] for sink in sinks]
        if self.mode.forced:
            counted = self.generate(batch, tokens, len(chosen))
            forced = [mx.array(g.reshape(c.shape), dtype=c.dtype) for g, c in zip(counted, chosen)]
            mx.eval(forced)
        else:
            counted, forced = [np.array(c) for c in chosen], None
        self.prepared[(batch, tokens)] = forced
        self.stats[(batch, tokens)] = {"unique_experts": unique_per_layer(counted),
                                       "pairs": int(counted[0].size)}
        return self.stats[(batch, tokens)]

    def run(self, batch: int, tokens: int, forward: Callable[[], object]):
        """The point's forward with its prepared indices in every MoE layer (the graph is built
        inside, so the controls can be cleared before it is evaluated)."""
        forced = self.prepared[(batch, tokens)]
        if forced is None:
            return forward()
        controls = self.controls
        assert controls is not None  # a forced mode runs its points inside installed()
        for control, indices in zip(controls, forced):
            control.forced = indices
        try:
            return forward()
        finally:
            for control in controls:
                control.forced = None
