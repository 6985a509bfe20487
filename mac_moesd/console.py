"""What the command line prints with: a document on stdout (one JSON document with ``--json``),
warnings and progress on stderr, and every error as one line with its exit status."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Callable

import click

from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.finite_json import finite_document
from mac_moesd.progress import Progress

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar as ClickProgressBar

__all__ = ["Cli", "ProgressBar", "emit", "finish_run", "warn"]


class Cli(click.Group):
    """A group whose errors are one line on stderr: usage errors exit 2, runtime errors exit 1."""

    def main(self, args=None, prog_name=None, **extra):
        extra.pop("standalone_mode", None)
        try:
            return super().main(args, prog_name or "mac-moesd", standalone_mode=False, **extra)
        except click.UsageError as err:
            where = f" (see '{err.ctx.command_path} --help')" if err.ctx else ""
            click.echo(f"Error: {err.format_message()}{where}", err=True)
            sys.exit(2)
        except click.exceptions.Exit as err:
            sys.exit(err.exit_code)
        except click.Abort:  # Ctrl-C, as click reports it
            click.echo("Interrupted; results written so far are kept: rerun the same command to resume.",
                       err=True)
            sys.exit(130)
        except click.ClickException as err:
            click.echo(f"Error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except MacMoesdError as err:
            click.echo(f"Error: {err}", err=True)
            sys.exit(2 if isinstance(err, BadInput) else 1)
        except KeyboardInterrupt:
            click.echo("Interrupted; results written so far are kept: rerun the same command to resume.",
                       err=True)
            sys.exit(130)


def emit(document: dict, as_json: bool, render: Callable[[dict], str]) -> None:
    """Print ``document`` as one JSON document, or as the human rendering."""
    if as_json:
        click.echo(json.dumps(finite_document(document), indent=2, allow_nan=False))
    else:
        click.echo(render(document))


def warn(message: str) -> None:
    click.secho(f"warning: {message}", fg="yellow", err=True)


class ProgressBar(Progress):
    """Progress on stderr (never stdout, which --json keeps for the document), as one bar."""

    def __init__(self, label: str):
        self.label = label
        self.bar: ClickProgressBar[str] | None = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def expect(self, steps: int) -> None:
        self.close()  # a new stage of the same command starts a new bar
        self.bar = click.progressbar(length=steps, label=self.label, file=sys.stderr, show_eta=True,
                                     show_pos=True, item_show_func=lambda item: item)
        self.bar.__enter__()

    def advance(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(1, label)

    def note(self, label: str) -> None:
        if self.bar is not None:
            self.bar.current_item = label
            self.bar.render_progress()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def finish_run(done, as_json: bool) -> int:
    """What `run` prints when its stages and report are done (``done``: ``commands.RunResult``):
    the skipped stages and the stages' warnings, then where the report is; its exit status."""
    for label, reason in done.outcome.skipped.items():
        warn(f"skipped {label}: {reason}")
    for message in done.outcome.warnings:
        warn(message)
    status = done.outcome.exit_status
    if as_json:
        emit({"results": str(done.store.path.resolve()),
              "report": {k: str(v.resolve()) for k, v in done.paths.items()},
              "skipped": dict(done.outcome.skipped), "exit_status": status}, True, str)
    else:
        click.echo(f"report: {done.paths['markdown']}")
        click.echo(f"        {done.paths['html']}")
    if status:
        what = "nothing could be measured" if status == 1 else f"{len(done.outcome.skipped)} stage(s) skipped"
        click.echo(f"{what}; the report says what is missing and why", err=True)
    return status
