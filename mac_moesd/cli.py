"""The `mac-moesd` command line: parse, call the library, print. Nothing else lives here."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import click

from mac_moesd import __version__
from mac_moesd.machine import blas
from mac_moesd.analysis import theory
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.finite_json import finite_document
from mac_moesd.reporting.formatting import render_compare, render_fit, render_info, render_plan, render_roofline, render_routing, render_selftest, render_spec, render_sweep, render_theory, render_zoo


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


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mac-moesd")
def cli() -> None:
    """Measure whether speculative decoding pays off for MoE models on this machine."""


@cli.command()
@json_option
def info(as_json: bool) -> None:
    """Chip, backend, memory, published specs and versions."""
    from mac_moesd.machine import hardware, memory, metadata

    machine = hardware.detect()
    document = machine.to_dict()
    document["usable_memory"] = memory.usable(memory.limit_bytes(None)).to_dict()
    document["blas"] = blas.describe(machine.backend)
    document["versions"] = metadata.versions()
    if document["blas"]["warning"]:
        warn(document["blas"]["warning"])
    for message in machine.warnings:
        warn(message)
    emit(document, as_json, render_info)


@cli.command(name="theory")
@click.option("--experts", "-E", type=click.IntRange(min=1), required=True, help="Experts per MoE layer.")
@click.option("--top-k", "-K", type=click.IntRange(min=1), required=True, help="Experts per token.")
@click.option("--tau", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.95,
              show_default=True, help="Saturation level: N(t) >= tau*E.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Largest t in the table [default: first power of two at or past saturation].")
@click.option("--correlation", "-c", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Routing correlation c within one sequence: t consecutive tokens act like "
                   "1 + c*(t-1) uniform ones.")
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


@cli.command(name="zoo")
@json_option
def zoo_command(as_json: bool) -> None:
    """The built-in models: architecture, E, K, rho, T_thres, parameters and bytes."""
    from mac_moesd.inputs import models

    emit({"models": models.describe_zoo()}, as_json, render_zoo)


budget_options = [
    click.option("--quick", is_flag=True, help="Small time budget per point (for a first look)."),
    click.option("--seconds-per-point", type=click.FloatRange(0, min_open=True), default=None,
                 help="Time budget per grid point [default: 2, or 0.5 with --quick]."),
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


def budget_from(quick: bool, seconds: float | None, decode_chain: int | None = None):
    from mac_moesd.measure import timing

    budget = timing.QUICK if quick else timing.Budget()
    if seconds is not None:
        budget = replace(budget, seconds_per_point=seconds)
    return budget if decode_chain is None else replace(budget, decode_chain=decode_chain)


memory_limit_option = click.option(
    "--memory-limit", type=click.FloatRange(0, min_open=True), default=None, metavar="GiB",
    help="Cap usable memory at this many GiB (or set MAC_MOESD_MEMORY_LIMIT); guards, slicing "
         "and skipping then plan within it.")


def usable_memory(limit_gib: float | None):
    """Usable memory now (the smaller of the ceiling and free memory, less a margin), capped."""
    from mac_moesd.machine import memory

    return memory.usable(memory.limit_bytes(limit_gib))


def out_option(default_help: str = "reports/<chip-slug>"):
    return click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help=f"Folder for results.json [default: {default_help}].")


class ProgressBar:
    """The sweep's progress on stderr (never stdout, which --json keeps for the document)."""

    def __init__(self, label: str):
        self.label = label
        self.bar = None

    def expect(self, points: int) -> None:
        self.close()  # a new stage of the same command starts a new bar
        self.bar = click.progressbar(length=points, label=self.label, file=sys.stderr,
                                     show_eta=True, item_show_func=lambda item: item)
        self.bar.__enter__()

    def advance(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(1, label)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def open_store(out: Path | None, per_chip: bool = False):
    """The machine, the run's metadata and the results store in ``out`` (default
    reports/<chip-slug>; with ``per_chip``, ``out``/<chip-slug>)."""
    from mac_moesd.machine import hardware, metadata
    from mac_moesd.results import ResultsStore

    machine = hardware.detect()
    meta = metadata.collect(machine)
    if meta["blas"]["warning"]:
        warn(meta["blas"]["warning"])
    for message in machine.warnings:
        warn(message)
    folder = (out or Path("reports")) / machine.slug if per_chip or out is None else out
    return machine, meta, ResultsStore(folder / "results.json", meta)


@cli.command(name="sweep")
@click.argument("model")
@click.option("--batch", "batches", type=NumberList(int, minimum=1), default="1,2,4,8,16,32",
              show_default=True, help="Batch sizes B.")
@click.option("--tokens", type=NumberList(int, minimum=1), default="1,2,3,4,5,6,8",
              show_default=True, help="New tokens t per sequence in one forward.")
@click.option("--context", type=click.IntRange(min=1), default=512, show_default=True,
              help="KV-cache length L every forward attends over.")
@click.option("--kv-context", type=click.IntRange(min=0), default=None, metavar="L2",
              help="Also time the one-token points at this shorter context, so the fit can tell "
                   "the KV cache's growth from costs per sequence; 0: not at all (saves a copy of "
                   "every batch's cache) [default: a quarter of --context].")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Measure N and 2N layers and extrapolate [default: all if they fit].")
@click.option("--bits", type=click.Choice(["4", "8"]), default=None, help="Quantize weights (group 64).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Weight dtype [default: float16 on a GPU, float32 on CPU].")
@click.option("--draft", default=None, help="Drafter model: also time its one-token step T_D(B,1).")
@click.option("--gamma", type=click.IntRange(min=1), default=4, show_default=True,
              help="Draft length for the rejection-sampling step T_rej(B).")
@click.option("--routing", default="model", show_default=True, metavar="MODE",
              help="Experts every MoE layer runs in the timed forwards: model (its own router), "
                   "uniform (K of E per token, i.i.d.: MoESD's assumption), correlated:C (t "
                   "consecutive tokens of a sequence activate N(1+C(t-1)) in expectation) or "
                   "trace:FILE (replay `mac-moesd routing --save-trace FILE`). The router still runs.")
@click.option("--gather", type=click.Choice(["mlx-lm", "sorted"]), default="mlx-lm", show_default=True,
              help="Expert gather: as mlx-lm runs it (pairs sorted by expert only from 64 indices), "
                   "or sorted at every size (the what-if of reading each unique expert once).")
@with_options(budget_options)
@memory_limit_option
@out_option()
@click.option("--parallel", type=click.Choice(["pipeline", "tensor", "expert"]), default=None,
              help="Under mlx.launch: shard the model over its ranks this way [default: one machine].")
@click.option("--rank-timeout", type=click.FloatRange(0, min_open=True), default=None, metavar="S",
              help="With --parallel: seconds a rank waits for the others at any step, loading "
                   "included, before all exit [default: 300].")
@json_option
def sweep_command(model, batches, tokens, context, kv_context, layers, bits, dtype, draft, gamma, routing, gather,
                  quick, seconds_per_point, decode_chain, memory_limit, out, parallel, rank_timeout,
                  as_json) -> None:
    """Time T_T(B,t): B sequences of t new tokens over a KV cache of --context tokens.

    MODEL is a zoo name (see `mac-moesd zoo`), a folder with config.json (and weights, if any),
    a config.json, or a Hugging Face repo id already in the local cache.
    """
    from mac_moesd.machine import hardware
    from mac_moesd.measure.sweep import SweepConfig, run_sweep, validate

    cfg = SweepConfig(model=model, batches=batches, tokens=tokens, context=context,
                      dtype=dtype, bits=int(bits) if bits else None, layers=layers, draft=draft,
                      gamma=gamma, budget=budget_from(quick, seconds_per_point, decode_chain),
                      routing=routing, gather=gather, kv_context=kv_context)
    validate(cfg)
    if rank_timeout is not None and not parallel:
        raise click.UsageError("--rank-timeout goes with --parallel")
    if parallel:
        cluster_sweep(cfg, parallel, out, memory_limit, rank_timeout, as_json)
        return
    usable = usable_memory(memory_limit)
    machine, meta, store = open_store(out)
    progress = ProgressBar(f"sweep {model}")
    try:
        with hardware.measuring_stage():
            document = run_sweep(cfg, store, usable.usable_bytes, progress)
    finally:
        progress.close()
    document["meta"] = meta
    document["results_file"] = str(store.path)
    for message in document["warnings"]:
        warn(message)
    emit(document, as_json, render_sweep)


def cluster_sweep(cfg, parallel, out, memory_limit, rank_timeout, as_json) -> None:
    """The sweep of a model sharded over the ranks of mlx.launch; only rank 0 prints."""
    from mac_moesd.machine import memory
    from mac_moesd.measure import distributed

    progress = ProgressBar(f"sweep {cfg.model} ({parallel} parallel)")
    try:
        document = distributed.run_cluster_sweep(cfg, parallel, out, memory.limit_bytes(memory_limit),
                                                 rank_timeout or distributed.DEFAULT_TIMEOUT_S, progress)
    finally:
        progress.close()
    if document is None:
        return
    meta = document["meta"]
    for message in [meta["blas"]["warning"], *meta["warnings"], *document["warnings"]]:
        if message:
            warn(message)
    emit(document, as_json, render_sweep)


@cli.command(name="roofline")
@click.option("--quick", is_flag=True, help="Smaller arrays and budgets (under a minute on a CPU box).")
@click.option("--sizes", type=NumberList(float, minimum=0, open_min=True), default=None,
              help="Array sizes in MiB for read/copy/triad [default: 1,4,16,64,256,1024].")
@click.option("--max-size", type=click.FloatRange(0, min_open=True), default=None,
              help="Drop sizes above this many MiB.")
@memory_limit_option
@out_option()
@json_option
def roofline_command(quick, sizes, max_size, memory_limit, out, as_json) -> None:
    """Measured bandwidth and FLOPS, the ridge point, and the chip's spec beside them."""
    from mac_moesd.measure import roofline

    cfg = roofline.QUICK if quick else roofline.RooflineConfig()
    if sizes:
        if min(sizes) < 1 / 64:
            raise BadInput("--sizes must be at least 1/64 MiB each")
        cfg = replace(cfg, sizes=roofline.sizes_from_mib(sizes))
    cap = None
    if max_size:
        cap = roofline.sizes_from_mib((max_size,))[0]
        cfg = replace(cfg, sizes=tuple(s for s in cfg.sizes if s <= cap) or (cap,))
    usable = usable_memory(memory_limit)
    machine, meta, store = open_store(out)
    roofline.validate(cfg, usable.usable_bytes, cap)
    spec = machine.to_dict()["spec"]
    steps = len(cfg.sizes) + 4 + len(cfg.dtypes) + 2
    progress = ProgressBar("roofline")
    progress.expect(steps)
    from mac_moesd.machine import memory

    memory.start_stage()
    try:
        document = roofline.run_roofline(cfg, spec, machine.backend, progress.advance,
                                         usable_bytes=usable.usable_bytes)
    finally:
        progress.close()
    store.data["roofline"] = document
    store.save()
    document["meta"] = meta
    document["results_file"] = str(store.path)
    if document["kernels"]["path"] != "metal":
        warn(document["kernels"]["note"])
    emit(document, as_json, render_roofline)


@cli.command(name="routing")
@click.argument("model")
@click.option("--text", default=None,
              help="A text file or folder, 'code' (Python's standard library) or 'prose' "
                   "(built-in sample) [default: random token ids].")
@click.option("--batch", "batches", type=NumberList(int, minimum=1), default="1,2,4,8,16,32",
              show_default=True, help="Independent sequences B per window.")
@click.option("--tokens", type=NumberList(int, minimum=1), default="1,2,4,8", show_default=True,
              help="Consecutive tokens t per sequence in a window.")
@click.option("--length", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens per routed sequence.")
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Route only the first N layers.")
@click.option("--tau", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.95,
              show_default=True, help="Saturation level.")
@click.option("--save-trace", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="FILE", help="Also write every MoE layer's top-k choices (a .npz, see "
                                   "mac_moesd/measure/routing_trace.py) for `sweep --routing trace:FILE`.")
@memory_limit_option
@out_option()
@json_option
def routing_command(model, text, batches, tokens, length, layers, tau, save_trace, memory_limit, out,
                    as_json) -> None:
    """Unique experts real routing activates, against the uniform N(t), with correlation."""
    from mac_moesd.machine import hardware
    from mac_moesd.measure.routing import RoutingConfig, run_routing

    cfg = RoutingConfig(model=model, text=text, batches=batches, tokens=tokens, length=length,
                        layers=layers, tau=tau, save_trace=save_trace)
    usable = usable_memory(memory_limit)
    machine, meta, store = open_store(out)
    with hardware.measuring_stage():
        document = run_routing(cfg, usable.usable_bytes)
    store.put("routing", f"{document['model']}|{document['text']}", document)
    document["meta"] = meta
    document["results_file"] = str(store.path)
    emit(document, as_json, render_routing)


@cli.command(name="fit")
@click.argument("results", type=click.Path(path_type=Path))
@click.option("--model", default=None, help="Which MoE sweep in the file [default: the first].")
@click.option("--alpha", type=NumberList(float, minimum=0, open_min=True), default=None,
              help="Acceptance rates to predict for, in (0, 1) [default: 0.5,0.7,0.9].")
@click.option("--verify-tokens", type=click.Choice(["gamma", "gamma+1"]), default="gamma+1",
              show_default=True, help="Tokens in the verify forward: gamma+1 as the SD loops and "
              "mlx-lm run it; gamma is MoESD's convention.")
@json_option
def fit_command(results, model, alpha, verify_tokens, as_json) -> None:
    """Fit the MoESD time model to a results file; held-out error and predicted speedups.

    RESULTS is a results.json or the folder holding it.
    """
    from mac_moesd.results import ResultsBusy, WriterLock

    if alpha and any(a >= 1 for a in alpha):
        raise click.BadParameter(f"{max(alpha)} is not in (0, 1)", param_hint="'--alpha'")
    path = results / "results.json" if results.is_dir() else results
    lock = busy = None
    if path.exists():
        try:  # before reading: the fit is written back into what was read
            lock = WriterLock.take(path)
        except ResultsBusy as err:
            busy = (f"another mac-moesd process ({err.holder or 'unknown'}) is writing {path}; rerun "
                    "`mac-moesd fit` when it has finished")
        except MacMoesdError as err:  # its folder is read-only
            busy = str(err)
    try:
        _fit_into(path, busy, model, alpha, verify_tokens, as_json)
    finally:
        if lock is not None:
            WriterLock.release(lock)


def _fit_into(path, busy, model, alpha, verify_tokens, as_json) -> None:
    from mac_moesd.analysis import fit
    from mac_moesd.results import load_results, write_atomic

    data = load_results(path)
    inputs = fit.inputs_from_results(data, model, verify_tokens)
    if inputs.ridge is not None and "no roofline" in inputs.ridge_source:
        warn(f"ridge and bandwidth from the {inputs.ridge_source}")
    for what in inputs.missing:
        warn(what)
    result = fit.fit(inputs)
    document = fit.fit_document(result, alphas=tuple(sorted(set(fit.DEFAULT_ALPHAS) | set(alpha or ()))))
    if busy is None:
        data.setdefault("fits", {})[document["model"]] = document
        write_atomic(path, data)
    else:
        warn(f"the fit was not saved: {busy}")
    emit(document, as_json, render_fit)


@cli.command(name="spec")
@click.argument("target")
@click.option("--draft", required=True, help="Drafter model (ignored with --mode self-draft).")
@click.option("--batch", "batches", type=NumberList(int, minimum=1), default="1,2,4", show_default=True)
@click.option("--gamma", "gammas", type=NumberList(int, minimum=1), default="2,4", show_default=True,
              help="Draft lengths.")
@click.option("--alpha", "alphas", type=NumberList(float, minimum=0, open_min=True), default="0.7",
              show_default=True, help="Acceptance rates for --mode emulated-acceptance, in (0, 1).")
@click.option("--mode", type=click.Choice(["real", "self-draft", "emulated-acceptance"]),
              default="emulated-acceptance", show_default=True,
              help="real: the drafter's own tokens; self-draft: draft = target (all accepted); "
                   "emulated-acceptance: each draft token accepted with probability alpha.")
@click.option("--context", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompt tokens of random ids (random-weight models; real prompts set their own).")
@click.option("--tokens", "new_tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens each sequence generates per timed run.")
@click.option("--repeats", type=click.IntRange(min=1), default=8, show_default=True,
              help="The fewest (plain, SD) pairs per configuration.")
@click.option("--precision", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.03,
              show_default=True, help="Add pairs until the 95% CI of the median speedup is within "
                                      "+-this fraction of it...")
@click.option("--budget", "budget_s", type=click.FloatRange(0, min_open=True), default=120.0,
              show_default=True, help="...or this many seconds of the configuration are spent.")
@click.option("--prompts", default=None,
              help="code, chat (built-in sets) or FILE (text: blank-line-separated prompts; "
                   ".jsonl: a 'prompt' field per line), through the model's tokenizer and chat "
                   "template [default: code for a model with weights; random ids for random weights].")
@click.option("--temperature", "temperatures", type=NumberList(float, minimum=0), default="0",
              show_default=True, help="Sampling temperatures, e.g. 0,1 (above 0: --mode real, seeded).")
@click.option("--max-prompts", type=click.IntRange(min=1), default=None,
              help="Prompts of the set the untimed acceptance pass decodes [default: all].")
@memory_limit_option
@out_option()
@json_option
def spec_command(target, draft, batches, gammas, alphas, mode, context, new_tokens, repeats, precision,
                 budget_s, prompts, temperatures, max_prompts, memory_limit, out, as_json) -> None:
    """Measured SD speedup against plain decode, beside the fitted model's prediction.

    With --mode real on a model with weights, also the drafter's acceptance on a prompt set
    (per draft position, mean accepted length, sigma, alpha; at temperature > 0 under mlx-lm's
    rule and exact rejection sampling) and, at temperature 0, whether SD output equals greedy.
    """
    from mac_moesd.analysis import fit
    from mac_moesd.machine import hardware
    from mac_moesd.measure.spec import SpecConfig, run_spec

    cfg = SpecConfig(target=target, draft=draft, batches=batches, gammas=gammas, alphas=alphas,
                     mode=mode, context=context, new_tokens=new_tokens, repeats=repeats,
                     precision=precision, budget_s=budget_s, prompts=prompts, temperatures=temperatures,
                     max_prompts=max_prompts)
    usable = usable_memory(memory_limit)
    machine, meta, store = open_store(out)
    from mac_moesd.inputs import models

    fitted = store.data.get("fits", {}).get(models.resolve(target).name)
    if fitted is None:
        warn(f"no fit of {target} in {store.path}: run `mac-moesd fit` for predicted speedups")
    predictor = fit.speedup_predictor(fitted) if fitted else None
    if fitted is not None and predictor is None:
        warn(f"the fit of {target} in {store.path} cannot predict speedups (no drafter, or made before "
             "the expert-load variants): rerun `mac-moesd sweep --draft` and `mac-moesd fit`")
    with hardware.measuring_stage():
        document = run_spec(cfg, predictor, usable.usable_bytes,
                            fit.sweep_plain_step(store.data, models.resolve(target).name))
    key = f"{document['target']}|{document['draft']}|{mode}"
    if document["prompts"]["count"]:
        key += f"|{document['prompts']['name']}"
    store.put("spec", key, document)
    document["meta"] = meta
    emit(document, as_json, render_spec)


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


@cli.command(name="serving")
@click.argument("target", required=False)
@click.option("--draft", default=None, help="Drafter: the second server runs with --draft-model DRAFT.")
@click.option("--gamma", type=click.IntRange(min=1), default=3, show_default=True,
              help="Draft tokens per round (mlx_lm.server's --num-draft-tokens).")
@click.option("--concurrency", type=NumberList(int, minimum=1), default="1,2,4,8,16,32", show_default=True,
              help="Requests kept in flight, one leg each.")
@click.option("--tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="max_tokens of every request.")
@click.option("--prompts", default="chat,code", show_default=True,
              help="Comma-separated prompt sets: code, chat or a FILE.")
@click.option("--window", type=click.FloatRange(0, min_open=True), default=20.0, show_default=True,
              metavar="S", help="Seconds of each measured window.")
@click.option("--warmup", type=click.FloatRange(0), default=5.0, show_default=True, metavar="S",
              help="Seconds of each leg before its window.")
@click.option("--shared-prefix", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="All requests share an N-token prefix (agents on one context).")
@click.option("--url", "urls", type=UrlPair(), multiple=True,
              help="Measure a running server instead of launching mlx_lm.server (repeatable).")
@click.option("--fit", type=click.Path(exists=True, path_type=Path), default=None,
              help="Results file (or folder) with the pair's fit [default: the one in --out].")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=120.0, show_default=True,
              metavar="S", help="A request that gets no byte for this long fails.")
@out_option()
@json_option
def serving_command(target, draft, gamma, concurrency, tokens, prompts, window, warmup, shared_prefix, urls,
                    fit, request_timeout, out, as_json) -> None:
    """Aggregate tok/s of a local server at each concurrency, plain and with a drafter, beside
    the suite's predictions for the same pair.

    TARGET is a model folder with a tokenizer, or a Hugging Face repo id in the local cache:
    mlx_lm.server is launched on 127.0.0.1 once plain and once with --draft, and stopped at the
    end. With --url NAME=URL (e.g. plain=... sd=...) running servers are measured as configured.
    """
    from mac_moesd.measure.serving_stage import ServingConfig, run_serving
    from mac_moesd.reporting.serving_section import render_serving

    if draft and not target:
        raise click.UsageError("--draft goes with TARGET")
    cfg = ServingConfig(target=target, draft=draft, gamma=gamma, concurrency=concurrency, tokens=tokens,
                        prompts=tuple(p.strip() for p in prompts.split(",") if p.strip()), window_s=window,
                        warmup_s=warmup, shared_prefix=shared_prefix, urls=tuple(urls), fit=fit,
                        request_timeout_s=request_timeout)
    machine, meta, store = open_store(out)
    progress = ProgressBar("serving")
    servers = len(urls) or (2 if draft else 1)
    progress.expect(servers * (len(concurrency) * len(cfg.prompts) + (0 if urls else 1)))
    try:
        document = run_serving(cfg, store, machine.backend, progress.advance)
    finally:
        progress.close()
    for message in document["notes"]:
        warn(message)
    document["meta"] = meta
    document["results_file"] = str(store.path)
    emit(document, as_json, render_serving)


@cli.command(name="run")
@click.option("--quick", is_flag=True, help="Small grids and budgets: minutes, not an hour.")
@click.option("--full", is_flag=True, help="More MoE models from the zoo (GPU backends).")
@click.option("--models", type=str, default=None,
              help="Comma-separated targets instead of the defaults (MoE first; a dense one is the control).")
@click.option("--target", default=None,
              help="Your own MoE model (a folder in mlx-lm's format, or a Hugging Face repo id already "
                   "in the local cache), measured with its weights as stored; needs --draft.")
@click.option("--draft", default=None, help="The drafter for --target (same tokenizer).")
@click.option("--prompts", "prompt_sets", default=None,
              help="With --target (or a cached pair): comma-separated prompt sets for SD and routing: "
                   "code, chat, or a FILE (blank-line-separated prompts, or JSONL with a 'prompt' "
                   "field) [default: code,chat].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="Reports folder; this machine's report goes in OUT/<chip-slug>.")
@memory_limit_option
@click.option("--dry-run", is_flag=True,
              help="Allocate nothing: print each stage's models, slices, grid, peak memory and ETA.")
@click.option("--chip", default=None,
              help="With --dry-run: plan for this chip of the table, e.g. 'Apple M1', 'Apple M3 Pro 18c'.")
@click.option("--memory", "memory_gib", type=click.FloatRange(0, min_open=True), default=None, metavar="GiB",
              help="With --dry-run: the machine's RAM in GiB (required with --chip).")
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --dry-run: plan each MoE sweep sharded over this many such machines.")
@click.option("--parallel", type=click.Choice(["pipeline", "tensor", "expert"]), default="tensor",
              show_default=True, help="With --ranks: how the model is split.")
@click.option("--link-gbps", type=click.FloatRange(0, min_open=True), default=None,
              help="With --ranks: link between machines in Gb/s [default: 80, Thunderbolt 5].")
@click.option("--serving", is_flag=True,
              help="Also measure mlx_lm.server on the pair at several concurrencies (see `mac-moesd serving`).")
@json_option
def run_command(quick, full, models, target, draft, prompt_sets, out, memory_limit, dry_run, chip,
                memory_gib, ranks, parallel, link_gbps, serving, as_json) -> None:
    """Everything for the default models: roofline, sweeps, routing, fit, SD runs, report.

    With --target and --draft, all of it for your own pair instead: the target's sweep with the
    drafter's step, routing on the prompt sets with the model's tokenizer, the fit, SD measured
    with real drafts per prompt set at temperatures 0 and 1, and a verdict for the pair. On a GPU
    without --target, the first known pair found in the Hugging Face cache that fits in memory.

    Exit status: 0 when every stage ran; 3 when some were skipped (the report is written and
    says why); 1 when nothing could be measured.
    """
    from mac_moesd.reporting import report
    from mac_moesd import pair
    from mac_moesd import run as runner

    if quick and full:
        raise click.UsageError("--quick and --full exclude each other")
    if (chip or memory_gib) and not dry_run:
        raise click.UsageError("--chip and --memory describe another machine: use them with --dry-run")
    if bool(target) != bool(draft):
        raise click.UsageError("--target and --draft go together")
    if target and (models or full):
        raise click.UsageError("--target/--draft measure your own pair; --models and --full choose zoo models")
    if prompt_sets is not None and (models or full):
        raise click.UsageError("--prompts goes with a pair (--target/--draft), not with --models or --full")
    sets = tuple(p.strip() for p in (prompt_sets or ",".join(pair.PROMPT_SETS)).split(",") if p.strip())
    if not sets:
        raise click.BadParameter("name at least one prompt set", param_hint="'--prompts'")
    if ranks > 1 and not dry_run:
        raise click.UsageError("--ranks plans a cluster with --dry-run; measure one with "
                               "`mlx.launch -n N -- mac-moesd sweep MODEL --parallel MODE`")
    if dry_run:
        cluster = (ranks, parallel, link_gbps) if ranks > 1 else None
        document = dry_run_document(quick, full, models, out, memory_limit, chip, memory_gib, target, draft,
                                    cluster, serving)
        emit(document, as_json, render_plan)
        return
    limit = memory_limit_bytes(memory_limit)
    machine, meta, store = open_store(out, per_chip=True)
    from mac_moesd.measure import serving_stage

    serving_cfg = serving_stage.stage_config(quick) if serving else None
    chosen = None
    if target:
        chosen = pair.pair_plan(machine.backend, quick, target, draft, sets)
    elif machine.backend == "cpu" and prompt_sets is not None:
        raise click.UsageError("--prompts needs --target and --draft here (the cached-pair search runs on "
                               "a GPU only)")
    elif machine.backend != "cpu" and not models and not full:
        chosen, search = pair.find_default_pair(machine.backend, quick,
                                                usable_memory(memory_limit).usable_bytes, sets)
        store.put("pair_search", "latest", search.to_dict())
        if chosen is None:
            warn("no known MoE/drafter pair in the Hugging Face cache fits here: measuring random-weight "
                 "models (the report says so)")
    if chosen is not None:
        stages = [*pair.stage_labels(chosen, serving), "report"]
        measure = lambda stage, advance: pair.run_pair(  # noqa: E731
            chosen, store, machine, machine.to_dict()["spec"], stage, advance, limit, serving_cfg)
    else:
        plan = runner.default_plan(machine.backend, quick, full)
        if models:
            plan = runner.with_models(plan, tuple(m.strip() for m in models.split(",") if m.strip()))
        stages = [*runner.stage_labels(plan, serving), "report"]
        measure = lambda stage, advance: runner.run_all(  # noqa: E731
            plan, store, machine, machine.to_dict()["spec"], stage, advance, limit, serving_cfg)
    bar = click.progressbar(length=len(stages), label="run", file=sys.stderr, show_eta=True,
                            item_show_func=lambda item: item)
    with bar:
        def stage(label):
            if stage.started:
                bar.update(1)
            stage.started = True
            bar.label = f"run [{stages.index(label) + 1}/{len(stages)}]"
            bar.render_progress()
            bar.current_item = label

        stage.started = False
        outcome = measure(stage, lambda label: setattr(bar, "current_item", label) or bar.render_progress())
        stage("report")
        paths = report.write_report(store.data, store.path.parent)
        bar.update(1)
    for label, reason in outcome.skipped.items():
        warn(f"skipped {label}: {reason}")
    for message in outcome.warnings:
        warn(message)
    if as_json:
        emit({"results": str(store.path.resolve()), "report": {k: str(v.resolve()) for k, v in paths.items()},
              "skipped": dict(outcome.skipped), "exit_status": outcome.exit_status}, True, str)
    else:
        click.echo(f"report: {paths['markdown']}")
        click.echo(f"        {paths['html']}")
    if outcome.exit_status:
        what = "nothing could be measured" if outcome.exit_status == 1 else \
            f"{len(outcome.skipped)} stage(s) skipped"
        click.echo(f"{what}; the report says what is missing and why", err=True)
        sys.exit(outcome.exit_status)


def memory_limit_bytes(limit_gib: float | None) -> int | None:
    from mac_moesd.machine import memory

    return memory.limit_bytes(limit_gib)


def dry_run_document(quick, full, models, out, memory_limit, chip, memory_gib, target=None,
                     draft=None, cluster=None, serving=False) -> dict:
    """The plan of ``run`` for this machine, or for --chip with --memory GiB; nothing allocated.
    ``cluster`` (ranks, parallel, link Gb/s): the sharded sweeps over that many such machines;
    ``serving``: with the serving stage."""
    from mac_moesd.machine import hardware, memory
    from mac_moesd import pair, plan
    from mac_moesd import run as runner

    limit = memory.limit_bytes(memory_limit)
    if chip:
        if memory_gib is None:
            raise click.UsageError("--chip needs --memory GiB (the Mac's RAM)")
        spec = plan.parse_chip(chip)
        backend, name = "metal", f"{spec.name} {spec.gpu_cores}c"
        total = int(memory_gib * memory.GiB)
        ceiling = memory.working_set_bytes(total)
        usable = memory.usable_from(ceiling, None, limit,
                                    "working set of a Mac with this RAM (2/3 of it up to 32 GiB, 3/4 above; "
                                    "docs/design.md §5); "
                                    "nothing else assumed running")
        rates = plan.chip_rates(spec)
    else:
        machine = hardware.detect()
        backend, name, total = machine.backend, machine.chip, machine.memory_bytes
        if memory_gib is not None:
            total = int(memory_gib * memory.GiB)
            ceiling = memory.working_set_bytes(total) if backend == "metal" else total
            usable = memory.usable_from(ceiling, None, limit, "--memory")
        else:
            usable = memory.usable(limit)
        rates = plan.measured_rates((out or Path("reports")) / machine.slug / "results.json")
        if rates is None and machine.spec is not None:
            rates = plan.chip_rates(machine.spec)
    found = None
    if target:
        found = pair.pair_plan(backend, quick, target, draft)
    elif not chip and backend != "cpu" and not models and not full:
        found, _ = pair.find_default_pair(backend, quick, usable.usable_bytes)  # as `run` would
    chosen = found.base if found else runner.default_plan(backend, quick, full)
    if models:
        chosen = runner.with_models(chosen, tuple(m.strip() for m in models.split(",") if m.strip()))
    if cluster:
        from mac_moesd import plan_cluster

        ranks, parallel, link = cluster
        return plan_cluster.dry_run_cluster(chosen, backend, name, total, usable, rates, ranks, parallel,
                                            link or plan_cluster.LINK_GBPS)
    document = plan.dry_run(chosen, backend, name, total, usable, rates, pair=None if models else found)
    if found is not None:
        document["pair"] = {"target": found.target, "draft": found.draft, "found": found.found}
    if serving:
        from mac_moesd.measure import serving_stage

        serving_stage.add_to_plan(document, found, quick, backend)
    return document


def hardware_slug() -> str:
    from mac_moesd.machine import hardware

    return hardware.detect().slug


@cli.command(name="report")
@click.argument("folder", type=click.Path(file_okay=False, exists=True, path_type=Path),
                default=None, required=False)
def report_command(folder) -> None:
    """Write report.md, report.html, figures/ and sweep.csv from FOLDER/results.json.

    FOLDER defaults to reports/<this chip's slug>.
    """
    from mac_moesd.reporting import report
    from mac_moesd.results import load_results

    folder = folder or Path("reports") / hardware_slug()
    data = load_results(folder / "results.json")
    paths = report.write_report(data, folder)
    click.echo(f"report: {paths['markdown']}")
    click.echo(f"        {paths['html']}")


@cli.command(name="compare")
@click.argument("folders", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--reference", is_flag=True,
              help="Add datacenter GPUs from their published specs (labelled as not measured).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("reports/compare"),
              show_default=True, help="Where the overlay figures go.")
@json_option
def compare_command(folders, reference, out, as_json) -> None:
    """Several chips' results side by side: bandwidth, FLOPS, ridge, batch-1 speedup."""
    from mac_moesd.reporting import compare

    document = compare.compare(list(folders), reference)
    figures = compare.draw(document, out)
    document["figures"] = {k: str(v) for k, v in figures.items()}
    for row in document["machines"]:
        row.pop("curves")
    emit(document, as_json, render_compare)


@cli.command(name="selftest")
@json_option
def selftest_command(as_json: bool) -> None:
    """Check this machine first (under a minute): each kernel against its reference, K-launch
    timing, the memory guard and results files. Attach the output to a bug report."""
    from mac_moesd.machine import hardware, metadata
    from mac_moesd.measure import selftest

    machine = hardware.detect()
    for message in machine.warnings:
        warn(message)
    outcomes = selftest.run()
    document = {"chip": machine.chip, "backend": machine.backend, "os": machine.os,
                "versions": metadata.versions(), "warnings": machine.warnings,
                "passed": all(o.status != "FAIL" for o in outcomes),
                "checks": [o.to_dict() for o in outcomes]}
    emit(document, as_json, render_selftest)
    if not document["passed"]:
        sys.exit(1)


def main() -> None:
    from mac_moesd.machine import hardware

    try:
        hardware.require_native_python()  # before any command imports MLX
    except MacMoesdError as err:
        click.echo(f"Error: {err}", err=True)
        sys.exit(1)
    cli()


if __name__ == "__main__":
    main()
