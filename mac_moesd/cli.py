"""The `mac-moesd` command line: each command parses its options, calls one function of
``pipeline.commands`` and prints what it returns (stdout: the document; stderr: warnings and
progress). Nothing else lives here."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import click

from mac_moesd import __version__
from mac_moesd.analysis import theory
from mac_moesd.cli_options import (NumberList, UrlPair, budget_options, cluster_options, dry_run_options, json_option,
                                   memory_limit_option, out_option, precision_options, comma_names, rollback_option,
                                   run_options, with_options)
from mac_moesd.console import Cli, ProgressBar, emit, finish_run, warn
from mac_moesd.errors import MacMoesdError
from mac_moesd.reporting.formatting import render_compare, render_fit, render_info, render_plan, render_roofline, render_routing, render_selftest, render_spec, render_sweep, render_theory, render_zoo


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mac-moesd")
def cli() -> None:
    """Measure whether speculative decoding pays off for MoE models on this machine."""


@cli.command()
@json_option
def info(as_json: bool) -> None:
    """Chip, backend, memory, published specs and versions."""
    from mac_moesd.pipeline import commands

    emit(commands.info(warn), as_json, render_info)


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
@with_options(cluster_options)
@json_option
def sweep_command(model, batches, tokens, context, kv_context, layers, bits, dtype, draft, gamma, routing, gather,
                  quick, seconds_per_point, decode_chain, memory_limit_gib, out, parallel, rank_timeout,
                  as_json) -> None:
    """Time T_T(B,t): B sequences of t new tokens over a KV cache of --context tokens.

    MODEL is a zoo name (see `mac-moesd zoo`), a folder with config.json (and weights, if any),
    a config.json, or a Hugging Face repo id already in the local cache.
    """
    from mac_moesd.measure.forward.sweep import SweepConfig, validate
    from mac_moesd.pipeline import commands

    cfg = SweepConfig(model=model, batches=batches, tokens=tokens, context=context,
                      dtype=dtype, bits=int(bits) if bits else None, layers=layers, draft=draft,
                      gamma=gamma, budget=commands.budget_from(quick, seconds_per_point, decode_chain),
                      routing=routing, gather=gather, kv_context=kv_context)
    validate(cfg)
    if rank_timeout is not None and not parallel:
        raise click.UsageError("--rank-timeout goes with --parallel")
    if parallel:
        with ProgressBar(f"sweep {cfg.model} ({parallel} parallel)") as progress:
            document = commands.cluster_sweep(cfg, parallel, out, memory_limit_gib, rank_timeout, progress, warn)
        if document is not None:  # only rank 0 prints
            emit(document, as_json, render_sweep)
        return
    with ProgressBar(f"sweep {model}") as progress:
        document = commands.run_sweep(cfg, out, memory_limit_gib, progress, warn)
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
def roofline_command(quick, sizes, max_size, memory_limit_gib, out, as_json) -> None:
    """Measured bandwidth and FLOPS, the ridge point, and the chip's spec beside them."""
    from mac_moesd.pipeline import commands

    with ProgressBar("roofline") as progress:
        document = commands.run_roofline(quick, sizes, max_size, memory_limit_gib, out, progress, warn)
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
                                   "mac_moesd/measure/experts/routing_trace.py) for `sweep --routing trace:FILE`.")
@memory_limit_option
@out_option()
@json_option
def routing_command(model, text, batches, tokens, length, layers, tau, save_trace, memory_limit_gib, out,
                    as_json) -> None:
    """Unique experts real routing activates, against the uniform N(t), with correlation."""
    from mac_moesd.measure.experts.routing import RoutingConfig
    from mac_moesd.pipeline import commands

    cfg = RoutingConfig(model=model, text=text, batches=batches, tokens=tokens, length=length,
                        layers=layers, tau=tau, save_trace=save_trace)
    emit(commands.run_routing(cfg, memory_limit_gib, out, warn), as_json, render_routing)


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
    from mac_moesd.pipeline import commands

    if alpha and any(a >= 1 for a in alpha):
        raise click.BadParameter(f"{max(alpha)} is not in (0, 1)", param_hint="'--alpha'")
    emit(commands.fit_results(results, model, alpha, verify_tokens, warn), as_json, render_fit)


@cli.command(name="spec")
@click.argument("target")
@click.option("--draft", required=True,
              help="Drafter: a model; prompt-lookup (n-gram drafting from the context, no model; "
                   "--mode real); or mtp-head (an emulated MTP head on the target, acceptance imposed "
                   "by --alpha). Ignored with --mode self-draft.")
@click.option("--batch", "batches", type=NumberList(int, minimum=1), default="1,2,4", show_default=True)
@click.option("--gamma", "gammas", type=NumberList(int, minimum=1), default="2,4", show_default=True,
              help="Draft lengths.")
@click.option("--alpha", "alphas", type=NumberList(float, minimum=0, open_min=True), default=str(theory.DEFAULT_ALPHA),
              show_default=True, help="Acceptance rates for --mode emulated-acceptance, in (0, 1).")
@click.option("--mode", type=click.Choice(["real", "self-draft", "emulated-acceptance"]), default=None,
              help="real: the drafter's own tokens; self-draft: draft = target (all accepted); "
                   "emulated-acceptance: each draft token accepted with probability alpha "
                   "[default: real with --draft prompt-lookup, else emulated-acceptance].")
@click.option("--lookup-max-ngram", type=click.IntRange(min=1), default=3, show_default=True,
              help="Prompt lookup: the longest n-gram of the context's end searched for.")
@click.option("--lookup-min-ngram", type=click.IntRange(min=1), default=1, show_default=True,
              help="Prompt lookup: the shortest n-gram tried before a round proposes nothing.")
@click.option("--context", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompt tokens of random ids (random-weight models; real prompts set their own).")
@click.option("--tokens", "new_tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens each sequence generates per timed run.")
@with_options(precision_options)
@click.option("--prompts", default=None,
              help="code, chat, edit, quote (built-in sets) or FILE (text: blank-line-separated prompts; "
                   ".jsonl: a 'prompt' field per line), through the model's tokenizer and chat "
                   "template [default: code for a model with weights; random ids for random weights].")
@click.option("--temperature", "temperatures", type=NumberList(float, minimum=0), default="0",
              show_default=True, help="Sampling temperatures, e.g. 0,1 (above 0: --mode real, seeded).")
@click.option("--max-prompts", type=click.IntRange(min=1), default=None,
              help="Prompts of the set the untimed acceptance pass decodes [default: all].")
@rollback_option
@memory_limit_option
@out_option()
@json_option
def spec_command(target, draft, batches, gammas, alphas, mode, lookup_max_ngram, lookup_min_ngram, context,
                 new_tokens, repeats, precision, budget_s, prompts, temperatures, max_prompts, rollback,
                 memory_limit_gib, out, as_json) -> None:
    """Measured SD speedup against plain decode, beside the fitted model's prediction.

    With --mode real on a model with weights, also the drafter's acceptance on a prompt set
    (per draft position, mean accepted length, sigma, alpha; at temperature > 0 under mlx-lm's
    rule and exact rejection sampling) and, at temperature 0, whether SD output equals greedy.

    Every configuration is audited: its caches after a decode must equal plain decoding's, and
    at temperature 0 its output greedy's but for float near-ties. Exits 1 when one fails (the
    results are written, marked invalid).
    """
    from mac_moesd.measure.decoding.prompt_lookup import lookup_rule
    from mac_moesd.results.keys import PROMPT_LOOKUP
    from mac_moesd.measure.sd.speedup import SpecConfig
    from mac_moesd.pipeline import commands

    if lookup_min_ngram > lookup_max_ngram:
        raise click.BadParameter(f"{lookup_min_ngram} is above --lookup-max-ngram {lookup_max_ngram}",
                                 param_hint="'--lookup-min-ngram'")
    if mode is None:
        mode = "real" if draft == PROMPT_LOOKUP else "emulated-acceptance"
    cfg = SpecConfig(target=target, draft=draft, batches=batches, gammas=gammas, alphas=alphas,
                     mode=mode, context=context, new_tokens=new_tokens, repeats=repeats,
                     precision=precision, budget_s=budget_s, prompts=prompts, temperatures=temperatures,
                     max_prompts=max_prompts, rollback=rollback,
                     lookup=lookup_rule(lookup_max_ngram, lookup_min_ngram))
    document = commands.run_spec(cfg, memory_limit_gib, out, warn)
    emit(document, as_json, render_spec)
    if document.get("valid") is False:
        raise MacMoesdError("a configuration failed its SD audit (see INVALID above): its speedup is not "
                            "a measurement of speculative decoding")


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
              help="Comma-separated prompt sets: code, chat, edit, quote or a FILE.")
@click.option("--window", type=click.FloatRange(0, min_open=True), default=20.0, show_default=True,
              metavar="S", help="Seconds of each measured window.")
@click.option("--warmup", type=click.FloatRange(0), default=5.0, show_default=True, metavar="S",
              help="Seconds of each leg before its window.")
@click.option("--shared-prefix", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="All requests share an N-token prefix (agents on one context).")
@click.option("--url", "urls", type=UrlPair(), multiple=True,
              help="Measure a running server instead of launching mlx_lm.server (repeatable).")
@click.option("--served-model", default=None, metavar="NAME",
              help="With --url: the model name to request [default: the one the server lists or answers with].")
@click.option("--fit", type=click.Path(exists=True, path_type=Path), default=None,
              help="Results file (or folder) with the pair's fit [default: the one in --out].")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=120.0, show_default=True,
              metavar="S", help="A request that gets no byte for this long fails.")
@out_option()
@json_option
def serving_command(target, draft, gamma, concurrency, tokens, prompts, window, warmup, shared_prefix, urls,
                    served_model, fit, request_timeout, out, as_json) -> None:
    """Aggregate tok/s of a local server at each concurrency, plain and with a drafter, beside
    the suite's predictions for the same pair.

    TARGET is a model folder with a tokenizer, or a Hugging Face repo id in the local cache:
    mlx_lm.server is launched on 127.0.0.1 once plain and once with --draft, and stopped at the
    end. With --url NAME=URL (e.g. plain=... sd=...) running servers are measured as configured.
    """
    from mac_moesd.pipeline.serving_stage import ServingConfig
    from mac_moesd.pipeline import commands
    from mac_moesd.reporting.serving_section import render_serving
    from mac_moesd.results import keys

    if draft and not target:
        raise click.UsageError("--draft goes with TARGET")
    if draft in keys.DRAFTER_KINDS:
        raise click.UsageError(f"--draft {draft}: mlx_lm.server drafts with a model only (measure {draft} "
                               "with `mac-moesd spec` or `run --draft`, or a server that has it with --url)")
    if served_model and not urls:
        raise click.UsageError("--served-model goes with --url")
    cfg = ServingConfig(target=target, draft=draft, gamma=gamma, concurrency=concurrency, tokens=tokens,
                        prompts=comma_names(prompts), window_s=window,
                        warmup_s=warmup, shared_prefix=shared_prefix, urls=tuple(urls), served_model=served_model, fit=fit,
                        request_timeout_s=request_timeout)
    with ProgressBar("serving") as progress:
        document = commands.run_serving(cfg, out, progress, warn)
    emit(document, as_json, render_serving)


@cli.command(name="run")
@click.option("--quick", is_flag=True, help="Small grids and budgets: minutes, not an hour.")
@click.option("--full", is_flag=True, help="More MoE models from the zoo (GPU backends).")
@click.option("--models", type=str, default=None,
              help="Comma-separated targets instead of the defaults (MoE first; a dense one is the control).")
@click.option("--target", default=None,
              help="Your own MoE model (a folder in mlx-lm's format, or a Hugging Face repo id already "
                   "in the local cache), measured with its weights as stored; needs --draft.")
@click.option("--draft", default=None,
              help="The drafter for --target: a model (same tokenizer), prompt-lookup (n-gram drafting, "
                   "no model), mtp-head (an emulated MTP head at the target's dimensions, acceptance "
                   "imposed by --alpha), or several comma-separated, each measured on the same prompts.")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              help=f"With --draft mtp-head: the acceptance its runs impose [default: {theory.DEFAULT_ALPHA}].")
@click.option("--prompts", "prompt_sets", default=None,
              help="With --target (or a cached pair): comma-separated prompt sets for SD and routing: "
                   "code, chat, edit, quote, or a FILE (blank-line-separated prompts, or JSONL with a 'prompt' "
                   "field) [default: code,chat].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="Reports folder; this machine's report goes in OUT/<chip-slug>.")
@memory_limit_option
@click.option("--dry-run", is_flag=True,
              help="Allocate nothing: print each stage's models, slices, grid, peak memory and ETA.")
@with_options(dry_run_options)
@click.option("--serving", is_flag=True,
              help="Also measure mlx_lm.server on the pair at several concurrencies (see `mac-moesd serving`).")
@rollback_option
@json_option
def run_command(quick, full, models, target, draft, alpha, prompt_sets, out, memory_limit_gib, dry_run, chip,
                memory_gib, ranks, parallel, link_gbps, serving, rollback, as_json) -> None:
    """Everything for the default models: roofline, sweeps, routing, fit, SD runs, report.

    With --target and --draft, all of it for your own pair instead: the target's sweep with the
    drafter's step, routing on the prompt sets with the model's tokenizer, the fit, SD measured
    with real drafts per prompt set at temperatures 0 and 1, and a verdict for the pair. --draft
    may also name prompt-lookup and mtp-head beside (or instead of) a drafter model: each is
    measured on the same prompts and the report ranks them. On a GPU without --target, the first
    known pair found in the Hugging Face cache that fits in memory.

    Exit status: 0 when every stage ran; 3 when some were skipped (the report is written and
    says why); 1 when nothing could be measured.
    """
    from mac_moesd.pipeline import commands

    options = replace(run_options(quick, full, models, target, draft, prompt_sets, dry_run, chip, memory_gib, ranks,
                                  serving, parallel is not None or link_gbps is not None), rollback=rollback)
    if alpha is not None:
        if "mtp-head" not in options.drafts:
            raise click.UsageError("--alpha sets the acceptance an MTP head's runs impose: use it with --draft "
                                   "...,mtp-head (other drafters' acceptance is measured)")
        options = replace(options, alpha=alpha)
    if dry_run:
        cluster = (ranks, parallel or "tensor", link_gbps) if ranks > 1 else None
        emit(commands.dry_run(options, out, memory_limit_gib, chip, memory_gib, cluster), as_json, render_plan)
        return
    with ProgressBar("run") as progress:
        done = commands.run(options, out, memory_limit_gib, progress, warn)
    status = finish_run(done, as_json)
    if status:
        sys.exit(status)


@cli.command(name="report")
@click.argument("folder", type=click.Path(file_okay=False, exists=True, path_type=Path),
                default=None, required=False)
def report_command(folder) -> None:
    """Write report.md, report.html, figures/ and sweep.csv from FOLDER/results.json.

    FOLDER defaults to reports/<this chip's slug>.
    """
    from mac_moesd.pipeline import commands

    paths = commands.report(folder)
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
    from mac_moesd.pipeline import commands

    emit(commands.compare(list(folders), reference, out), as_json, render_compare)


@cli.command(name="selftest")
@json_option
def selftest_command(as_json: bool) -> None:
    """Check this machine first (under a minute): each kernel against its reference, K-launch
    timing, the memory guard and results files. Attach the output to a bug report."""
    from mac_moesd.pipeline import commands

    document = commands.check_machine(warn)
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
