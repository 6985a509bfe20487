"""The one stage runner: every run (`run`, `run --target/--draft`, their serving stage) is a
list of ``Stage`` handed to ``run_stages``.

For each stage, in order: progress names it; a stage whose results are already in the file is
kept and not run again (resume); otherwise the memory usable as it starts is read (capped by
``--memory-limit``), and it runs isolated: on Metal under the stage's device state, MLX's buffer
cache emptied after it, a failure recorded under ``skipped`` with its reason while the stages
after it still run, and the thermal pressure read before and after recorded in every document
it wrote.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, replace
from typing import Callable

from mac_moesd.errors import MacMoesdError
from mac_moesd.machine import hardware, memory, thermal
from mac_moesd.progress import Progress
from mac_moesd.results import ResultsStore, schema

__all__ = ["Context", "Outcome", "Stage", "isolated", "run_stages"]

# What a stage may fail with and still leave the others to run: our own errors (does not fit,
# bad model), MLX's RuntimeError (a Metal command buffer that failed, an allocation refused) and
# MemoryError. Anything else is a bug and goes up.
STAGE_FAILURES = (MacMoesdError, RuntimeError, MemoryError)


@dataclass
class Outcome:
    """Which stages ran and which were skipped (with why), for the exit status and the report, and
    the warnings the stages raised (thermal pressure), for the command to print."""

    ran: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str | None) -> None:
        if message and message not in self.warnings:
            self.warnings.append(message)

    @property
    def exit_status(self) -> int:
        """0: every stage ran; 3: some were skipped (report written); 1: nothing was measured."""
        if not self.skipped:
            return 0
        measuring = [s for s in self.ran if s != "fit"]
        return 3 if measuring else 1


@dataclass(frozen=True)
class Context:
    """What a stage works with: the results, this machine's backend and published spec, the
    memory usable as the stage starts, where its progress goes, and the run's outcome so far."""

    store: ResultsStore
    backend: str
    chip_spec: schema.ChipSpec | None  # its published figures
    outcome: Outcome
    progress: Progress = field(default_factory=Progress)
    usable_bytes: int | None = None


@dataclass(frozen=True)
class Stage:
    """One stage of a run. ``work`` measures into ``Context.store``; ``done`` says, from the results
    as they are, that it finished in an earlier run (None: it resumes itself, or always runs);
    ``estimate`` gives the dry run its memory and duration (None: not estimated); ``models``
    names what the dry run lists when the guards refuse it. ``device_state``: False where the
    stage's measuring code sets the device state itself (the roofline, which records it)."""

    label: str
    work: Callable[[Context], object]  # what it returns is ignored
    done: Callable[[dict], bool] | None = None
    estimate: Callable[..., dict] | None = None
    models: tuple[str, ...] = ()
    device_state: bool = True


class _Within(Progress):
    """A stage's own progress inside a run, whose steps are its stages: named, not counted."""

    def __init__(self, run: Progress):
        self._run = run

    def advance(self, label: str) -> None:
        self._run.note(label)


def run_stages(stages: list[Stage], ctx: Context, memory_limit_bytes: int | None = None) -> Outcome:
    """Run every stage into ``ctx.store`` (each saved as soon as it is done), one progress step
    each; a stage that fails is skipped with its reason and the stages after it still run. Each
    stage plans within the memory usable when it starts, capped by ``memory_limit_bytes``."""
    ctx.progress.expect(len(stages))
    for stage in stages:
        ctx.progress.note(stage.label)
        if stage.done is not None and stage.done(ctx.store.data):
            _ran(ctx.store, ctx.outcome, stage.label)
        else:
            isolated(ctx.store, ctx.outcome, stage.label, _measuring(stage, ctx, memory_limit_bytes),
                     stage.device_state)
        ctx.progress.advance(stage.label)
    return ctx.outcome


def _measuring(stage: Stage, ctx: Context, memory_limit_bytes: int | None) -> Callable[[], None]:
    """The stage's work with the memory usable as it starts, its progress named inside the run's."""
    def work() -> None:
        stage.work(replace(ctx, usable_bytes=memory.usable(memory_limit_bytes).usable_bytes,
                           progress=_Within(ctx.progress)))

    return work


def _ran(store: ResultsStore, outcome: Outcome, label: str) -> None:
    outcome.ran.append(label)
    if store.data.get("skipped", {}).pop(label, None) is not None:
        store.save()  # it ran this time: the earlier reason no longer applies


def isolated(store: ResultsStore, outcome: Outcome, label: str, work: Callable[[], None],
             device_state: bool = True) -> None:
    """Run one stage; a failure is recorded under ``skipped`` with its reason and the run goes on.

    On Metal the wired limit is set for the stage as mlx-lm sets it for generation (unless
    ``device_state`` is False: the stage sets it itself, once), and
    MLX's buffer cache is emptied after every stage, so a freed model does not stay resident
    while the next one is built (unified memory is shared with macOS and the user's apps).
    Thermal pressure is read before and after, and recorded in what the stage wrote.
    """
    import mlx.core as mx

    before, seen = thermal.read(), _fingerprints(store.data)
    try:
        with hardware.measuring_stage() if device_state else contextlib.nullcontext():
            work()
    except STAGE_FAILURES as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if isinstance(err, MacMoesdError):
            reason = message or type(err).__name__
        else:
            reason = f"{type(err).__name__}: {message}" if message else type(err).__name__
        outcome.skipped[label] = reason
        store.put("skipped", label, reason)
    else:
        _ran(store, outcome, label)
    finally:
        mx.clear_cache()
    record_thermal(store, outcome, label, seen, before, thermal.read())


# The sections whose entries stages write (results/schema.py), besides the roofline's own document.
DOCUMENT_SECTIONS = ("sweeps", "draft", "reject", "routing", "fits", "spec", "serving")


def _documents(data: dict) -> dict[tuple, dict]:
    """Every stage document in ``data``, by where it is."""
    found: dict[tuple, dict] = {("roofline",): data["roofline"]} if data.get("roofline") else {}
    for section in DOCUMENT_SECTIONS:
        found.update({(section, key): doc for key, doc in data.get(section, {}).items()})
    return found


def _fingerprints(data: dict) -> dict[tuple, str]:
    """Each stage document as JSON text: a stage wrote the documents whose text it changed (a
    sweep adds points to entries already there)."""
    return {where: json.dumps(doc, default=str) for where, doc in _documents(data).items()}


def record_thermal(store: ResultsStore, outcome: Outcome, label: str, seen: dict[tuple, str],
                   before: thermal.Reading, after: thermal.Reading) -> None:
    """``thermal_pressure`` {before, after} in every document the stage ``label`` wrote (those
    not in ``seen`` as they are now), and a warning when it ran throttled or when macOS did not
    tell its thermal pressure."""
    pressure = thermal.record(before, after)
    written = [doc for where, doc in _documents(store.data).items()
               if seen.get(where) != json.dumps(doc, default=str)]
    for doc in written:
        doc["thermal_pressure"] = pressure
    if written:
        store.save()
    outcome.warn(thermal.warning(label, pressure))
    for reading in (before, after):
        outcome.warn(thermal.unread_warning(reading))
