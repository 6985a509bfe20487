"""How a long command says what it is doing: one interface for every stage, sweep and leg.

A command expects some steps, then each step advances it; ``note`` names what is under way without
counting a step (a sweep's points inside a run whose steps are its stages). This base says
nothing: the library never prints, and the command line draws these calls as one bar on stderr
(``cli.ProgressBar``), so ``--json`` keeps stdout for its document.
"""

from __future__ import annotations

__all__ = ["Progress"]


class Progress:
    """Silent: the library's default, and what a test passes when it does not listen."""

    def expect(self, steps: int) -> None:
        """The work starting now has ``steps`` steps."""

    def advance(self, label: str) -> None:
        """One step is done; ``label`` names it (or what follows it)."""

    def note(self, label: str) -> None:
        """``label`` is under way; no step is counted."""
