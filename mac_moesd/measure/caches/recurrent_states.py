"""Taking a recurrent layer back to the position an SD round kept, without forwarding the model.

A GatedDeltaNet layer or a Mamba2 block keeps, in one mlx-lm ``ArraysCache``, the last k-1 inputs
of each causal convolution (its first entries, in the order the layer convolves) and one running
state (its last entry). After a round that forwarded F tokens and kept n, every entry must be what
it was after n tokens. The engines that run SD on these models get there two ways, both here:

- ``per-position``: the forward keeps the state after every position and the rollback selects the
  n-th (vLLM's ``num_accepted_tokens`` state indices, llama.cpp's recurrent-state sequences,
  mlx-vlm's ``gated_delta_update_with_states``). Here mlx-lm's own recurrence function is called
  once per position (as Rapid-MLX does), so the extra cost lands in the forward, where it would.
- ``replay``: the state before the round is kept (a reference is enough: the layers rebind their
  state, never write into it) with the recurrence's inputs of the round (what the layer passed
  the function: q, k, v and gates, or Mamba2's x, B, C, dt), and the rollback runs the recurrence
  again over the first n of them (mlx-vlm's fallback). The projections are not run again.

Either way a convolution's state after n tokens is rows n .. n+k-2 of the input the layer convolved
(which starts with the k-1 rows it held), recorded as the layer passes it to its ``Conv1d``.

While a ``StateLog`` is open, the recurrence function in each module of the model
(``mlxlm_compat.recurrence_sites``) and ``nn.Conv1d.__call__`` go through this module. A call
belongs to the open log with a leaf holding the state passed in (each layer reads its state from
its cache just before the call), and the convolutions since the previous recurrence call belong
to it. With no log open, nothing is patched.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from mac_moesd import mlxlm_compat
from mac_moesd.errors import MacMoesdError

__all__ = ["StateLog", "per_position_forwards", "unsupported"]

_open: list[weakref.ref] = []  # the open logs (a log dropped while open closes itself)
_pending_convs: list[mx.array] = []
_patched: dict[tuple[str, str], tuple[object, Callable]] = {}  # (module, name) -> (module, original)
_conv_call: list[Callable] = []  # nn.Conv1d.__call__ while patched


def unsupported(model, recurrent_leaves: list, sites: list) -> str | None:
    """Why the recurrent leaves of ``model`` cannot be taken back per position or by replay (None:
    they can): its layers call no recurrence function mlx-lm shares (``sites``, from
    ``mlxlm_compat.recurrence_sites``), or a leaf is not a prefilled cache of convolution states
    before one state."""
    if not sites:
        return (f"its recurrent layers ({type(model).__module__.rsplit('.', 1)[-1]}) call neither of mlx-lm's "
                f"{' nor '.join(mlxlm_compat.RECURRENCES)}, whose states this suite can keep per position")
    for leaf in recurrent_leaves:
        entries = leaf.cache
        if any(e is None for e in entries) or any(e.ndim != 3 for e in entries[:-1]):
            return "a recurrent cache does not hold convolution states before one recurrent state"
    return None


@dataclass
class _Call:
    """One call of a recurrence function inside an open log."""

    original: Callable
    tokens: int
    arguments: dict  # as bound to the function's signature
    per_token: tuple[str, ...]  # the arguments with a (batch, tokens) leading shape
    states: list  # the state after each position (per-position), else after the last
    convs: list  # the convolution inputs the layer built for this call, in order


class StateLog:
    """What one model's recurrent leaves went through since ``open``: ``select(n)`` sets each to
    its entries after the first n tokens, then ``close``. ``per_position``: keep every position's
    state during the forwards (else replay at ``select``). ``keep=False``: only compute the
    per-position states, keeping nothing (a timed forward)."""

    def __init__(self, sites: list, leaves: list, per_position: bool, keep: bool = True):
        self.sites = sites  # mlxlm_compat.recurrence_sites of the model
        self.leaves, self.per_position, self.keep = leaves, per_position, keep
        self.calls: list[list[_Call]] = [[] for _ in leaves]
        self.start: list[list] = []

    def open(self) -> None:
        self.close()
        self.calls = [[] for _ in self.leaves]
        self.start = [list(leaf.cache) for leaf in self.leaves]  # references: the layers rebind
        _open.append(weakref.ref(self))
        _install(self.sites)

    def close(self) -> None:
        _open[:] = [ref for ref in _open if ref() is not None and ref() is not self]
        if not _open:
            _uninstall()
        self.calls, self.start = [[] for _ in self.leaves], []

    def owner(self, state) -> int | None:
        return next((i for i, leaf in enumerate(self.leaves) if state is not None and leaf.cache[-1] is state), None)

    def record(self, leaf: int, original: Callable, bound: inspect.BoundArguments, convs: list):
        arguments = dict(bound.arguments)
        if arguments.get("lengths") is not None:
            raise MacMoesdError("a recurrence over ragged lengths cannot be kept per position")
        first = next(iter(arguments.values()))
        batch, tokens = first.shape[:2]
        per_token = tuple(name for name, value in arguments.items() if name != "state"
                          and isinstance(value, mx.array) and value.ndim >= 2 and value.shape[:2] == (batch, tokens))
        if self.per_position and tokens > 1:
            outputs, states, state = [], [], arguments["state"]
            for t in range(tokens):
                y, state = original(**{**arguments, "state": state,
                                       **{name: arguments[name][:, t : t + 1] for name in per_token}})
                outputs.append(y)
                states.append(state)
            result = (mx.concatenate(outputs, axis=1), state)
        else:
            result = original(**arguments)
            states = [result[1]]
        if self.keep:  # the layer's own convolutions are the last it ran before its recurrence
            held = len(self.leaves[leaf].cache) - 1
            self.calls[leaf].append(_Call(original, tokens, arguments, per_token, states, convs[len(convs) - held:]))
        return result

    def select(self, kept: int) -> None:
        """Set every leaf to its entries after the first ``kept`` tokens since ``open``."""
        for leaf, calls, start in zip(self.leaves, self.calls, self.start):
            if not calls:
                raise MacMoesdError("a recurrent layer's state went through no recurrence the suite records, "
                                    "so it cannot be taken back per position")
            forwarded = sum(c.tokens for c in calls)
            for j, held in enumerate(start[:-1]):
                leaf.cache[j] = _conv_state(calls, j, held.shape[1], forwarded, kept)
            leaf.cache[-1] = start[-1] if kept == 0 else (
                [s for c in calls for s in c.states][kept - 1] if self.per_position else _replay(calls, start[-1], kept))


def _conv_state(calls: list[_Call], j: int, width: int, forwarded: int, kept: int) -> mx.array:
    """The j-th convolution's state after ``kept`` tokens: its input rows kept .. kept+width-1,
    the inputs of later calls joined without the rows they held."""
    if any(len(c.convs) <= j or c.convs[j].shape[1] != width + c.tokens for c in calls):
        raise MacMoesdError("a recurrent layer's convolution input is not its held rows and its tokens, "
                            "so its state cannot be taken back per position")
    joined = mx.concatenate([calls[0].convs[j]] + [c.convs[j][:, width:] for c in calls[1:]], axis=1)
    assert joined.shape[1] == width + forwarded
    return mx.contiguous(joined[:, kept : kept + width])


def _replay(calls: list[_Call], state: mx.array, kept: int) -> mx.array:
    """The recurrence run again from ``state`` over the first ``kept`` tokens' recorded inputs."""
    first = calls[0]
    arguments = {**first.arguments, "state": state,
                 **{name: mx.concatenate([c.arguments[name] for c in calls], axis=1)[:, :kept]
                    for name in first.per_token}}
    return first.original(**arguments)[1]


def _recording(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def recurrence(*args, **kwargs):
        convs = _pending_convs[:]
        _pending_convs.clear()
        bound = signature.bind(*args, **kwargs)
        for log in filter(None, (ref() for ref in _open)):
            leaf = log.owner(bound.arguments.get("state"))
            if leaf is not None:
                return log.record(leaf, original, bound, convs)
        return original(*args, **kwargs)

    setattr(recurrence, "__wrapped__", original)  # a function object takes it; its type does not say so
    return recurrence


def _recording_conv(self, x):
    _pending_convs.append(x)
    return _conv_call[0](self, x)


def _install(sites) -> None:
    if not _conv_call:
        _conv_call.append(nn.Conv1d.__call__)
        setattr(nn.Conv1d, "__call__", _recording_conv)
    for module, name in sites:
        key = (module.__name__, name)
        if key not in _patched:
            _patched[key] = (module, getattr(module, name))
            setattr(module, name, _recording(_patched[key][1]))


def _uninstall() -> None:
    for (_, name), (module, original) in _patched.items():
        setattr(module, name, original)
    _patched.clear()
    if _conv_call:
        setattr(nn.Conv1d, "__call__", _conv_call.pop())
    _pending_convs.clear()


@contextmanager
def per_position_forwards(model, caches_leaves: list) -> Iterator[None]:
    """Forwards of ``model`` inside keep every position's recurrent state, as a per-position
    rollback's verify does, keeping none of them (for timing that verify)."""
    log = StateLog(mlxlm_compat.recurrence_sites(model), caches_leaves, per_position=True, keep=False)
    log.open()
    try:
        yield
    finally:
        log.close()
