"""`mac-moesd serving`: aggregate tokens/s of a local server at each concurrency, plain and with
a drafter, beside what the suite's fitted model predicts for the same pair.

Without URLs, mlx_lm.server is launched on loopback once plain and once with the drafter, and
stopped on every exit (``server_process``). With URLs, servers already running are measured as
they are configured. Every leg is saved in the results file as soon as it ends, so an
interrupted run keeps what it measured (``complete`` stays false).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import httpx

from mac_moesd.analysis import serving_prediction as prediction
from mac_moesd.analysis.digest import prices_drafter
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs.prompts import load_prompts, load_tokenizer
from mac_moesd.measure.server import sd_counters, server_process, serving
from mac_moesd.results import ResultsStore, keys, load_results

if TYPE_CHECKING:
    from mac_moesd.inputs.models import Sources

__all__ = ["DEFAULT_CONCURRENCY", "ServingConfig", "progress_steps", "run_serving", "validate"]

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)
PROBE_TIMEOUT_S = 10.0
MLX_LM_DECODE_CONCURRENCY = 32  # mlx_lm.server's default --decode-concurrency
MLX_LM_PROMPT_CONCURRENCY = 8  # and its default --prompt-concurrency, passed explicitly to be recorded


@dataclass(frozen=True)
class ServingConfig:
    target: str | None = None  # a model folder or cached HF id; with urls, only names the fit to use
    draft: str | None = None
    gamma: int = 3
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    tokens: int = 128
    prompts: tuple[str, ...] = ("chat", "code")
    window_s: float = 20.0
    warmup_s: float = 5.0
    shared_prefix: int = 0  # tokens every request's prompt shares (0: none)
    urls: tuple[tuple[str, str], ...] = ()  # (name, base URL) of servers already running
    served_model: str | None = None  # the "model" a --url server is asked for [default: as it says]
    fit: Path | None = None  # a results file (or its folder) holding the pair's fit
    request_timeout_s: float = 120.0
    command: tuple[str, ...] = ()  # the server's command; () = this Python's mlx_lm.server
    ready_timeout_s: float = server_process.READY_TIMEOUT_S


def validate(cfg: ServingConfig) -> None:
    """BadInput for a configuration that cannot run, before anything starts."""
    if not cfg.urls and not cfg.target:
        raise BadInput("name a TARGET model to launch mlx_lm.server with, or --url NAME=URL for running servers")
    names = [n for n, _ in cfg.urls]
    if len(set(names)) != len(names):
        raise BadInput("--url names must differ (e.g. plain=URL sd=URL)")
    for name, url in cfg.urls:
        if not name or not url.startswith(("http://", "https://")):
            raise BadInput(f"--url {name}={url}: expected NAME=http://HOST:PORT")
    for p in cfg.prompts:
        load_prompts(p)
    if cfg.fit is not None:
        _fit_source(cfg, {})  # a --fit that is not a results file is refused before any server starts


def _probe(name: str, url: str, served_model: str | None = None) -> dict:
    """A running server's description: the model it serves from its /v1/models where that lists
    one, else from a one-token chat completion's own ``model`` field (mlx_lm.server answers
    /v1/models by scanning the Hugging Face cache, an empty 200 where there is none), or
    ``served_model`` where given; a clear error when it does not answer or does not speak the
    OpenAI API."""
    base = url.rstrip("/")
    try:
        listed = httpx.get(base + "/v1/models", timeout=PROBE_TIMEOUT_S)
        models = _listed_models(listed)
        if not models or served_model:
            body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "temperature": 0.0,
                    **({"model": served_model} if served_model else {})}
            answered = httpx.post(base + "/v1/chat/completions", json=body, timeout=PROBE_TIMEOUT_S * 6)
            models = [served_model] if served_model and answered.status_code == 200 else models
            models = models or _completion_model(answered)
    except httpx.TimeoutException:
        raise MacMoesdError(f"--url {name}={url} did not answer within {PROBE_TIMEOUT_S:.0f} s") from None
    except httpx.TransportError as err:
        raise MacMoesdError(f"--url {name}={url} does not answer ({type(err).__name__})") from None
    if not models:
        raise MacMoesdError(f"--url {name}={url} does not speak the OpenAI API: neither GET /v1/models "
                            f"(HTTP {listed.status_code}) nor a one-token POST /v1/chat/completions "
                            f"(HTTP {answered.status_code}) named a model")
    return {"name": name, "kind": "openai-compatible", "version": None, "url": url, "launched": False,
            "args": None, "models": models}


def _listed_models(response: httpx.Response) -> list[str]:
    try:
        return [m["id"] for m in response.json()["data"]] if response.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        return []


def _completion_model(response: httpx.Response) -> list[str]:
    try:
        model = response.json().get("model") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        return []
    return [model] if isinstance(model, str) and model else []


def shared_prefix_text(tokens: int, target_folder: Path | None) -> tuple[str, str]:
    """About ``tokens`` tokens of the package's prose sample, and how they were counted (the
    target's tokenizer where there is one, else words)."""
    prose = resources.files("mac_moesd").joinpath("data/prose.txt").read_text()
    tokenizer = load_tokenizer(target_folder) if target_folder is not None else None
    if tokenizer is not None:
        ids = tokenizer.encode(prose)
        while len(ids) < tokens:
            ids = ids + ids
        return tokenizer.decode(ids[:tokens]), "target tokenizer"
    words = prose.split()
    while len(words) < tokens:
        words = words + words
    return " ".join(words[:tokens]), "words (no tokenizer here)"


def _key(cfg: ServingConfig, target: str | None, draft: str | None) -> str:
    return keys.serving_key([n for n, _ in cfg.urls], target, draft)


def _fit_source(cfg: ServingConfig, data: dict) -> tuple[dict, str]:
    """(results document, where it came from) holding the fit and acceptance passes."""
    if cfg.fit is None:
        return data, "this results file"
    path = cfg.fit / "results.json" if cfg.fit.is_dir() else cfg.fit
    return load_results(path), str(path)


def predictions(doc: dict, data: dict, source: str) -> tuple[list[dict], str | None]:
    """The predicted lines of a serving document from the fit and acceptance in ``data``."""
    target, draft = doc.get("target_name"), doc.get("draft_name")
    fit_doc = data.get("fits", {}).get(target) if target else None
    if not target or fit_doc is None:
        return [], (f"no fit of {target} in {source}: run `mac-moesd run --target ... --draft ...` (or sweep "
                    "--draft and fit) into the same --out, or give --fit" if target else
                    "no TARGET named, so no fit to predict with")
    if not prices_drafter(fit_doc, draft):
        return [], (f"the fit of {target} in {source} was made with {fit_doc['draft_model']}'s step, not {draft}'s: "
                    f"run `mac-moesd run --target {target} --draft {draft}` into the same --out, or give --fit")
    rows = []
    for prompts in doc["prompts"]:
        legs = [leg for leg in doc["legs"] if leg["prompts"] == prompts and leg["prompt_tokens_mean"] is not None]
        if not legs:
            continue
        prompt_tokens = legs[0]["prompt_tokens_mean"]
        counters = [leg["sd_counters"] for leg in legs if leg["sd_counters"].get("drafted")]
        alpha, where = None, None
        if counters and doc.get("gamma"):
            alpha = prediction.acceptance_from_counters(
                {"drafted": sum(c["drafted"] for c in counters), "accepted": sum(c["accepted"] for c in counters)},
                doc["gamma"])
            where = "the server's draft counters"
        if alpha is None and draft:
            key = keys.spec_key(target, draft, "real", prompts)
            alpha = prediction.acceptance_from_spec(data.get("spec", {}).get(key))
            where = (f"the suite's acceptance pass ({key}, temperature 0, in {source})" if alpha is not None else
                     f"no acceptance pass of {target} with {draft} on {prompts} in {source}: run `mac-moesd spec "
                     f"TARGET --draft DRAFT --mode real --prompts {prompts}`")
        elif alpha is None:
            where = "no DRAFT named, so no acceptance pass to look up"
        for row in prediction.predicted_rows(fit_doc, tuple(doc["concurrency"]), doc.get("gamma") or 3,
                                             prompt_tokens, doc["tokens"], alpha, where):
            rows.append({"prompts": prompts, **row})
    return rows, (None if rows else "no leg finished a request, so the prompts' length is unknown")


def crossover(doc: dict) -> tuple[int | None, str | None]:
    """The largest concurrency where SD as served beat plain on every prompt set (legs named
    ``plain`` and ``sd``, status ok), or None with why."""
    wins = None
    for prompts in doc["prompts"]:
        by = {name: {leg["concurrency"]: leg["aggregate_tok_s"] for leg in doc["legs"]
                     if leg["server"] == name and leg["prompts"] == prompts and leg["status"] == "ok"}
              for name in ("plain", "sd")}
        if not by["plain"] or not by["sd"]:
            continue
        won = {c for c in by["plain"] if c in by["sd"] and by["sd"][c] > by["plain"][c]}
        wins = won if wins is None else wins & won
    if wins is None:
        return None, "no concurrency has both a plain and an SD leg (servers named plain and sd)"
    return (max(wins), None) if wins else (None, "SD as served never beat plain")


def _leg(cfg: ServingConfig, url: str, model: str, concurrency: int, prompt_set, prefix: str, server: str,
         drafter: str | None, reported: Callable[[], sd_counters.Counts | None], why_none: str) -> dict:
    leg = serving.LegConfig(url=url, model=model, concurrency=concurrency, prompts=prompt_set.prompts,
                            max_tokens=cfg.tokens, warmup_s=cfg.warmup_s, window_s=cfg.window_s,
                            request_timeout_s=cfg.request_timeout_s, shared_prefix=prefix)
    before = reported()
    records, cpu = serving.run_leg(leg)
    after = reported()
    return serving.leg_document(leg, records, cpu, server, drafter, cfg.gamma if drafter else None,
                                prompt_set_label(prompt_set), sd_counters.leg_record(before, after, why_none), after)


def prompt_set_label(prompt_set) -> str:
    return prompt_set.name


def progress_steps(cfg: ServingConfig) -> int:
    """The steps ``run_serving`` reports: each leg of each server, and each server it starts."""
    servers = len(cfg.urls) or (2 if cfg.draft else 1)
    return servers * (len(cfg.concurrency) * len(cfg.prompts) + (0 if cfg.urls else 1))


def run_serving(cfg: ServingConfig, store: ResultsStore, backend: str,
                progress: Callable[[str], None] = lambda label: None,
                sources: Sources | None = None) -> dict[str, Any]:
    """Measure every leg into ``store`` (section ``serving``) and return the serving document.
    ``sources``: target and drafter as the command resolved them (None: resolved here)."""
    validate(cfg)
    folder = store.path.parent
    notes = []
    stale = server_process.reap_stale(folder)
    if stale:
        notes.append(stale)
    prompt_sets = [load_prompts(p) for p in cfg.prompts]
    target_folder = draft_folder = None
    target_name = draft_name = None
    if cfg.target:
        from mac_moesd.inputs import models

        sources = sources or models.Sources(models.resolve(cfg.target), models.resolve(cfg.draft) if cfg.draft else None)
        sources.claim(store)
        target_name = sources.target.name
        draft_name = sources.draft.name if sources.draft else None
    if not cfg.urls:
        assert cfg.target is not None  # launching servers needs a target (validate)
        target_folder = server_process.served_folder(cfg.target)
        draft_folder = server_process.served_folder(cfg.draft) if cfg.draft else None
    prefix, counted = shared_prefix_text(cfg.shared_prefix, target_folder) if cfg.shared_prefix else ("", None)
    # Running servers answer before anything is written: a wrong --url leaves the results as they were.
    probed = [_probe(name, url, cfg.served_model) for name, url in cfg.urls]
    doc: dict[str, Any]
    doc = {"target": cfg.target, "draft": cfg.draft, "target_name": target_name, "draft_name": draft_name,
           "gamma": cfg.gamma if cfg.draft or cfg.urls else None, "tokens": cfg.tokens,
           "prompts": [prompt_set_label(p) for p in prompt_sets], "concurrency": list(cfg.concurrency),
           "window_s": cfg.window_s, "warmup_s": cfg.warmup_s,
           "shared_prefix": {"tokens": cfg.shared_prefix, "counted_by": counted} if cfg.shared_prefix else None,
           "server": probed, "legs": [], "predicted": [], "predicted_reason": None,
           "crossover_concurrency": None, "crossover_reason": None, "complete": False, "notes": notes}
    key = _key(cfg, target_name, draft_name)
    doc["legs"], earlier_servers = _kept(store.data.get("serving", {}).get(key), doc)
    done = {_leg_id(leg) for leg in doc["legs"]}
    if done:
        doc["notes"].append(f"resumed: {len(done)} legs kept from an earlier run of the same configuration")
    store.put("serving", key, doc)

    def measure(server: str, url: str, model: str, drafter: str | None,
                reported: Callable[[], sd_counters.Counts | None], why_none: str, alive: Callable[[], None]) -> None:
        for prompt_set in prompt_sets:
            for c in cfg.concurrency:
                if (server, c, prompt_set_label(prompt_set)) in done:
                    continue
                progress(f"{server} x{c} on {prompt_set_label(prompt_set)}")
                doc["legs"].append(_leg(cfg, url, model, c, prompt_set, prefix, server, drafter, reported, why_none))
                try:
                    alive()
                except MacMoesdError:
                    # The server died during this leg or just after its window: its figures are not
                    # kept, so a resume measures the leg again.
                    doc["legs"].pop()
                    store.put("serving", key, doc)
                    raise
                store.put("serving", key, doc)

    with server_process.sigterm_as_interrupt():
        if cfg.urls:
            _url_legs(cfg, doc, measure)
        else:
            def needed(server: str) -> bool:
                return any((server, c, prompt_set_label(p)) not in done for p in prompt_sets for c in cfg.concurrency)

            _launched_legs(cfg, doc, folder, backend, target_folder, draft_folder, draft_name,
                           lambda: store.put("serving", key, doc), measure, progress, needed, earlier_servers)
        data, source = _fit_source(cfg, store.data)
        doc["predicted"], doc["predicted_reason"] = predictions(doc, data, source)
        doc["crossover_concurrency"], doc["crossover_reason"] = crossover(doc)
        doc["complete"] = True
        store.put("serving", key, doc)
    return doc


# What a serving document's legs were measured under: a rerun with the same keeps them. The
# models by their resolved names, as the document's key: not the arguments, which may spell them
# otherwise (a path with a trailing slash, an absolute path).
RESUMED_WITH = ("target_name", "draft_name", "gamma", "tokens", "prompts", "window_s", "warmup_s", "shared_prefix")


def _leg_id(leg: dict) -> tuple:
    return leg["server"], leg["concurrency"], leg["prompts"]


def _kept(earlier: dict | None, doc: dict) -> tuple[list[dict], dict[str, dict]]:
    """The legs of an earlier run of the same configuration (``RESUMED_WITH``, and for running
    servers the same URLs) that this one asks for, and that run's servers by name; nothing when
    there was none or it measured otherwise."""
    if not earlier or any(earlier.get(k) != doc.get(k) for k in RESUMED_WITH):
        return [], {}
    urls = {s["name"]: s["url"] for s in doc["server"]}  # probed running servers (none when launched)
    if urls and urls != {s["name"]: s["url"] for s in earlier.get("server", [])}:
        return [], {}
    legs = [leg for leg in earlier.get("legs", [])
            if leg.get("concurrency") in doc["concurrency"] and leg.get("prompts") in doc["prompts"]]
    return legs, {s["name"]: s for s in earlier.get("server", [])}


def _url_legs(cfg: ServingConfig, doc: dict, measure) -> None:
    """Every leg of the servers already running at ``cfg.urls`` (probed into ``doc["server"]``),
    as they are configured."""
    for server in doc["server"]:
        def alive(server=server) -> None:
            _probe(server["name"], server["url"], cfg.served_model)

        measure(server["name"], server["url"], server["models"][0], None,
                lambda url=server["url"]: sd_counters.scrape(url),
                "the server reported no draft counters (in its responses, a /metrics endpoint or /v1/status)",
                alive)


def _launched_legs(cfg: ServingConfig, doc: dict, folder: Path, backend: str, target_folder, draft_folder,
                   draft_name: str | None, save: Callable[[], None], measure, progress,
                   needed: Callable[[str], bool], earlier_servers: dict[str, dict]) -> None:
    """Every leg of mlx_lm.server launched here, plain and (with a drafter) with --draft-model;
    on the CPU backend each serves a float32 copy (``server_process.cpu_servable``). A server
    whose legs an earlier run measured (``needed``) is not launched again."""
    launches = [("plain", None)] + ([("sd", draft_folder)] if draft_folder else [])
    copies = folder / "served-models"
    served_target, target_note = (server_process.cpu_servable(target_folder, copies) if backend == "cpu"
                                  else (target_folder, {}))
    for name, drafter in launches:
        if not needed(name) and name in earlier_servers:
            doc["server"].append(earlier_servers[name])
            continue
        served_draft, draft_note = ((server_process.cpu_servable(drafter, copies) if backend == "cpu"
                                     else (drafter, {})) if drafter else (None, {}))
        server_cfg = server_process.ServerConfig(
            name=name, model=served_target, draft=served_draft, gamma=cfg.gamma,
            decode_concurrency=max(max(cfg.concurrency), MLX_LM_DECODE_CONCURRENCY),
            prompt_concurrency=MLX_LM_PROMPT_CONCURRENCY, command=cfg.command,
            ready_timeout_s=cfg.ready_timeout_s,
            notes={**target_note, **({"draft_copy": draft_note["served_copy"]} if draft_note else {})})
        progress(f"starting mlx_lm.server ({name})")
        with server_process.LaunchedServer(server_cfg, folder) as launched:
            doc["server"].append(launched.describe())
            save()
            why = ("mlx_lm.server reports no accepted or drafted counts (in its responses or metrics)"
                   if drafter else "no drafter")

            def alive(launched=launched) -> None:
                if launched.proc.poll() is not None:
                    raise launched.failure(f"exited (status {launched.proc.returncode}) during a leg")

            measure(name, launched.url, "default_model", draft_name if drafter else None, lambda: None, why, alive)


# ---- the stage of `mac-moesd run --serving` ----

QUICK = ServingConfig(concurrency=(1, 4, 16), tokens=64, window_s=10.0, warmup_s=3.0)
SERVER_START_S = 15.0  # launching a server and loading a small model, before weights are read


def stage_config(quick: bool) -> ServingConfig:
    """The serving stage of a pair run (target, drafter and prompt sets filled in by the run)."""
    return QUICK if quick else ServingConfig()


def random_weights_stage() -> NoReturn:
    """The serving stage of a run on the zoo's random-weight models: always skipped, with why."""
    raise MacMoesdError(RANDOM_WEIGHTS)


def pair_stage(template: ServingConfig, target: str, draft: str, prompt_sets: tuple[str, ...],
               store: ResultsStore, backend: str, advance: Callable[[str], None], sources: Sources) -> None:
    """The serving stage of a pair run: ``template`` on the pair (as given, and as the run
    resolved it) and its prompt sets (a complete one already in the results is kept by the run:
    ``pipeline.pair_stages``)."""
    from dataclasses import replace

    run_serving(replace(template, target=target, draft=draft, prompts=prompt_sets), store, backend, advance,
                sources)


def dry_run_stage(template: ServingConfig, target: str, draft: str, prompt_sets: tuple[str, ...],
                  backend: str, bandwidth_bytes_s: float | None, sources: Sources) -> dict:
    """The serving stage's peak memory and duration, allocating nothing: target and drafter
    weights (float32 on the CPU backend, as served there) and both models' KV caches for the
    largest concurrency at the prompts' length plus the generated tokens (in mlx-lm's 256-token
    steps); the legs' warm-ups and windows, and each server's start and weight load."""
    from mac_moesd.machine import memory

    weights, kv = 0, 0
    slots = -(-(prompt_tokens_estimate(prompt_sets) + template.tokens) // memory.KV_STEP) * memory.KV_STEP
    assert sources.draft is not None  # a served pair has a drafter model
    for name, source in ((target, sources.target), (draft, sources.draft)):
        folder = server_process.served_folder(name)
        widen = 2 if backend == "cpu" and server_process.stored_dtypes(folder) & {"F16", "BF16"} else 1
        weights += widen * sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
        config = source.config
        dtype_bytes = 4 if backend == "cpu" else 2
        kv += memory.kv_bytes_per_slot(config, dtype_bytes) * config["num_hidden_layers"] * slots
    peak = weights + kv * max(template.concurrency)
    legs = 2 * len(prompt_sets) * len(template.concurrency)
    load = 2 * weights / bandwidth_bytes_s if bandwidth_bytes_s else 0.0
    return {"stage": f"serving {sources.target.name}", "models": [target, draft], "peak_bytes": int(peak),
            "eta_s": legs * (template.warmup_s + template.window_s) + 2 * SERVER_START_S + load,
            "parts": {"weights": int(weights), "kv": int(kv * max(template.concurrency))}}


def prompt_tokens_estimate(prompt_sets: tuple[str, ...]) -> int:
    """A generous prompt length for the memory estimate: the longest prompt's characters (a token
    is rarely shorter than one character), plus the request's own first line."""
    return max(len(p) for s in prompt_sets for p in load_prompts(s).prompts) + 16


RANDOM_WEIGHTS = ("the default models have random weights, and a server measurement needs a trained pair: "
                  "run --target MODEL --draft MODEL --serving")
