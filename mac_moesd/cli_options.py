"""The command line's option types and the options several commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

__all__ = ["NumberList", "UrlPair", "budget_options", "cluster_options", "dry_run_options", "json_option",
           "memory_limit_option", "out_option", "precision_options", "comma_names", "run_options",
           "with_options"]


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
        if self.minimum is not None:
            bad = [n for n in numbers if n < self.minimum or (self.open_min and n == self.minimum)]
            if bad:
                relation = ">" if self.open_min else ">="
                self.fail(f"{bad[0]} is not {relation} {self.minimum}", param, ctx)
        return numbers


class UrlPair(click.ParamType):
    """NAME=URL of a running OpenAI-compatible server."""

    name = "NAME=URL"

    def convert(self, value: Any, param, ctx) -> tuple:
        if isinstance(value, tuple):
            return value
        name, sep, url = str(value).partition("=")
        if not sep or not name.strip() or not url.strip():
            self.fail(f"{value!r} is not NAME=URL (e.g. plain=http://127.0.0.1:8080)", param, ctx)
        return name.strip(), url.strip().rstrip("/")


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


budget_options = [
    click.option("--quick", is_flag=True, help="Small time budget per point (for a first look)."),
    click.option("--seconds-per-point", type=click.FloatRange(0, min_open=True), default=None,
                 help="Time budget per grid point; the pipelined one-token points (the decode "
                      "step) get four times it, but not with --quick [default: 2, or 0.5 with --quick]."),
    click.option("--decode-chain", type=click.IntRange(min=2), default=None, metavar="N",
                 help="Forwards per pipelined sample of the one-token points, as a decode loop "
                      "chains them; longer chains spread the chain's fixed cost as a long "
                      "generation does [default: 32]."),
]


def with_options(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


memory_limit_option = click.option(
    "--memory-limit", "memory_limit_gib", type=click.FloatRange(0, min_open=True), default=None, metavar="GiB",
    help="Cap usable memory at this many GiB (or set MAC_MOESD_MEMORY_LIMIT); guards, slicing "
         "and skipping then plan within it.")


def out_option(default_help: str = "reports/<chip-slug>"):
    return click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help=f"Folder for results.json [default: {default_help}].")


# sweep: a model sharded over the ranks of mlx.launch
cluster_options = [
    click.option("--parallel", type=click.Choice(["pipeline", "tensor", "expert"]), default=None,
                 help="Under mlx.launch: shard the model over its ranks this way [default: one machine]."),
    click.option("--rank-timeout", type=click.FloatRange(0, min_open=True), default=None, metavar="S",
                 help="With --parallel: seconds a rank waits for the others at any step, loading "
                       "included, before all exit [default: 300]."),
]

# spec: SD measured to a precision
precision_options = [
    click.option("--repeats", type=click.IntRange(min=1), default=8, show_default=True,
                 help="The fewest (plain, SD) pairs per configuration."),
    click.option("--precision", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.03,
                 show_default=True, help="Add pairs until the 95% CI of the median speedup is within "
                                          "+-this fraction of it..."),
    click.option("--budget", "budget_s", type=click.FloatRange(0, min_open=True), default=120.0,
                 show_default=True, help="...or this many seconds of the configuration are spent."),
]

rollback_option = click.option(
    "--rollback", type=click.Choice(["auto", "per-position", "replay", "re-forward"]), default="auto",
    show_default=True,
    help="How SD takes back rejected drafts. auto: trim plain KV caches, cut a full sliding window, "
         "select a recurrent (linear-attention, Mamba2) state kept per position, and restore and "
         "re-forward the kept tokens where nothing cheaper is correct; per-position / replay: how a "
         "recurrent state goes back (kept after every verify position, or the recurrence run again over "
         "the kept tokens); re-forward: restore and re-forward on every model (the naive baseline).")

# run --dry-run: another machine, or several
dry_run_options = [
    click.option("--chip", default=None,
                 help="With --dry-run: plan for this chip of the table, e.g. 'Apple M1', 'Apple M3 Pro 18c'."),
    click.option("--memory", "memory_gib", type=click.FloatRange(0, min_open=True), default=None, metavar="GiB",
                 help="With --dry-run: the machine's RAM in GiB (required with --chip)."),
    click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
                 help="With --dry-run: plan each MoE sweep sharded over this many such machines."),
    click.option("--parallel", type=click.Choice(["pipeline", "tensor", "expert"]), default=None,
                 help="With --ranks: how the model is split [default: tensor]."),
    click.option("--link-gbps", type=click.FloatRange(0, min_open=True), default=None,
                 help="With --ranks: link between machines in Gb/s [default: 80, Thunderbolt 5]."),
]


def comma_names(value: str, option: str = "--prompts", what: str = "prompt set") -> tuple[str, ...]:
    """An option's comma-separated names (``--prompts``' prompt sets by default), at least one."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise click.BadParameter(f"name at least one {what}", param_hint=f"'{option}'")
    return names


def run_options(quick, full, models, target, draft, prompt_sets, dry_run, chip, memory_gib, ranks, serving,
                cluster_flags: bool = False):
    """`run`'s options checked against each other, as ``pipeline.commands.RunOptions``;
    ``cluster_flags``: whether --parallel or --link-gbps was given."""
    from mac_moesd.pipeline.commands import RunOptions

    if quick and full:
        raise click.UsageError("--quick and --full exclude each other")
    if (chip or memory_gib) and not dry_run:
        raise click.UsageError("--chip and --memory describe another machine: use them with --dry-run")
    if chip and memory_gib is None:
        raise click.UsageError("--chip needs --memory GiB (the Mac's RAM)")
    if bool(target) != bool(draft):
        raise click.UsageError("--target and --draft go together")
    if target and (models or full):
        raise click.UsageError("--target/--draft measure your own pair; --models and --full choose zoo models")
    if prompt_sets is not None and (models or full):
        raise click.UsageError("--prompts goes with a pair (--target/--draft), not with --models or --full")
    sets = comma_names(prompt_sets if prompt_sets is not None else "code,chat")
    if cluster_flags and ranks == 1:
        raise click.UsageError("--parallel and --link-gbps describe a cluster: use them with --dry-run --ranks N")
    if ranks > 1 and not dry_run:
        raise click.UsageError("--ranks plans a cluster with --dry-run; measure one with "
                               "`mlx.launch -n N -- mac-moesd sweep MODEL --parallel MODE`")
    names = comma_names(models, "--models", "model") if models is not None else ()
    drafts = comma_names(draft, "--draft", "drafter") if draft else ()
    return RunOptions(quick, full, names, target, drafts, sets, prompt_sets is not None, serving)
