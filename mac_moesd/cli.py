"""The `mac-moesd` command line: parse, call the library, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click

from mac_moesd import __version__, blas, theory
from mac_moesd.errors import MacMoesdError
from mac_moesd.formatting import render_info, render_theory


class NumberList(click.ParamType):
    """A comma-separated list of numbers, e.g. ``1,2,4``, each checked against a lower bound."""

    def __init__(self, kind: type = int, minimum: float | None = None, open_min: bool = False):
        self.kind = kind
        self.minimum = minimum
        self.open_min = open_min
        self.name = f"{kind.__name__}-list"

    def convert(self, value: Any, param, ctx) -> tuple:
        if isinstance(value, tuple):
            return value
        items = [v.strip() for v in str(value).split(",")]
        try:
            numbers = tuple(self.kind(v) for v in items)
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.kind.__name__}s", param, ctx)
        if not numbers:
            self.fail("the list is empty", param, ctx)
        if self.minimum is not None:
            bad = [n for n in numbers if n < self.minimum or (self.open_min and n == self.minimum)]
            if bad:
                relation = ">" if self.open_min else ">="
                self.fail(f"{bad[0]} is not {relation} {self.minimum}", param, ctx)
        return numbers


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
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(130)
        except click.ClickException as err:
            click.echo(f"Error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except MacMoesdError as err:
            click.echo(f"Error: {err}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("Interrupted; results written so far are kept.", err=True)
            sys.exit(130)


def emit(document: dict, as_json: bool, render: Callable[[dict], str]) -> None:
    """Print ``document`` as one JSON document, or as the human rendering."""
    if as_json:
        click.echo(json.dumps(document, indent=2, allow_nan=False))
    else:
        click.echo(render(document))


def warn(message: str) -> None:
    click.secho(f"warning: {message}", fg="yellow", err=True)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mac-moesd")
def cli() -> None:
    """Measure whether speculative decoding pays off for MoE models on this machine."""


@cli.command()
@json_option
def info(as_json: bool) -> None:
    """Chip, backend, memory, published specs and versions."""
    from mac_moesd import hardware, metadata

    machine = hardware.detect()
    document = machine.to_dict()
    document["blas"] = blas.describe(machine.backend)
    document["versions"] = metadata.versions()
    if document["blas"]["warning"]:
        warn(document["blas"]["warning"])
    emit(document, as_json, render_info)


@cli.command(name="theory")
@click.option("--experts", "-E", type=click.IntRange(min=1), required=True, help="Experts per MoE layer.")
@click.option("--top-k", "-K", type=click.IntRange(min=1), required=True, help="Experts per token.")
@click.option("--tau", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.95,
              show_default=True, help="Saturation level: N(t) >= tau*E.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Largest t in the table [default: first power of two at or past saturation].")
@click.option("--correlation", "-c", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Routing correlation c: t correlated tokens act like c*t uniform ones.")
@click.option("--gamma", type=NumberList(int, minimum=1), default="1,2,4,8", show_default=True,
              help="Draft lengths for the acceptance table.")
@click.option("--alpha", type=NumberList(float, minimum=0), default="0.8", show_default=True,
              help="Per-token acceptance rates, in [0, 1].")
@json_option
def theory_command(experts, top_k, tau, max_tokens, correlation, gamma, alpha, as_json) -> None:
    """Saturation threshold, activated experts N(t) and acceptance, from the MoESD formulas."""
    if top_k > experts:
        raise click.BadParameter(f"{top_k} is larger than --experts {experts}", param_hint="'--top-k'")
    if any(a > 1 for a in alpha):
        raise click.BadParameter(f"{max(alpha)} is not in [0, 1]", param_hint="'--alpha'")
    document = theory.summarise(experts, top_k, tau, max_tokens, correlation, gamma, alpha)
    emit(document, as_json, render_theory)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
