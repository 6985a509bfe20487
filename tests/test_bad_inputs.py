"""Every bad input a user can give, through the command line: a one-line error, the exit status
click gives usage errors (2) or the suite gives problems found at run time (1), and the earlier
results left byte for byte as they were. One table, one row per case: the command line (with
{placeholders} for the folders and files the fixture makes), the status, a phrase of the message.
"""

import json
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from mac_moesd.cli import cli
from mac_moesd.machine import hardware
from mac_moesd.pipeline import commands

RECORDED = Path(__file__).parent / "data" / "results_quick_cpu.json"
TINY_PAIR = Path(__file__).parent / "data" / "tiny-pair"
NO_MEMORY = {"MAC_MOESD_MEMORY_LIMIT": "lots"}

CASES = [
    # the command line itself
    (["nope"], {}, 2, "No such command 'nope'"),
    (["info", "extra"], {}, 2, "unexpected extra argument"),
    (["zoo", "--bogus"], {}, 2, "No such option '--bogus'"),
    (["selftest", "--bogus"], {}, 2, "No such option '--bogus'"),
    # run
    (["run", "--quick", "--full", "--out", "{out}"], {}, 2, "--quick and --full exclude each other"),
    (["run", "--chip", "Apple M2", "--memory", "16", "--out", "{out}"], {}, 2, "use them with --dry-run"),
    (["run", "--memory", "16", "--out", "{out}"], {}, 2, "use them with --dry-run"),
    (["run", "--dry-run", "--chip", "Apple M2"], {}, 2, "--chip needs --memory GiB"),
    (["run", "--dry-run", "--chip", "Apple M99", "--memory", "16"], {}, 2, "unknown chip 'Apple M99'"),
    (["run", "--dry-run", "--chip", "Apple M2\nPro", "--memory", "16"], {}, 2, "unknown chip 'Apple M2\\nPro'"),
    (["run", "--dry-run", "--chip", "Apple M2", "--memory", "0"], {}, 2, "0.0 is not in the range x>0"),
    (["run", "--models", "nope", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["run", "--models", "tiny-dense", "--out", "{out}"], {}, 2, "--models needs at least one MoE model"),
    (["run", "--models", ",", "--out", "{out}"], {}, 2, "name at least one model"),
    (["run", "--dry-run", "--ranks", "2", "--link-gbps", "0"], {}, 2, "'--link-gbps': 0.0 is not in the range"),
    (["run", "--dry-run", "--ranks", "0"], {}, 2, "'--ranks': 0 is not in the range x>=1"),
    (["run", "--parallel", "tensor", "--out", "{out}"], {}, 2, "use them with --dry-run --ranks N"),
    (["run", "--dry-run", "--link-gbps", "10"], {}, 2, "use them with --dry-run --ranks N"),
    (["run", "--ranks", "2", "--out", "{out}"], {}, 2, "--ranks plans a cluster with --dry-run"),
    (["run", "--target", "nope", "--out", "{out}"], {}, 2, "--target and --draft go together"),
    (["run", "--draft", "tiny-draft", "--out", "{out}"], {}, 2, "--target and --draft go together"),
    (["run", "--target", "tiny-moe", "--draft", "tiny-draft", "--models", "tiny-moe", "--out", "{out}"], {}, 2,
     "--models and --full choose zoo models"),
    (["run", "--models", "tiny-moe", "--prompts", "code", "--out", "{out}"], {}, 2, "--prompts goes with a pair"),
    (["run", "--target", "tiny-moe", "--draft", "tiny-draft", "--prompts", ",", "--out", "{out}"], {}, 2,
     "name at least one prompt set"),
    (["run", "--prompts", "code", "--out", "{out}"], {}, 2, "--prompts needs --target and --draft here"),
    (["run", "--memory-limit", "0", "--out", "{out}"], {}, 2, "'--memory-limit': 0.0 is not in the range"),
    (["run", "--memory-limit", "-2", "--out", "{out}"], {}, 2, "'--memory-limit': -2.0 is not in the range"),
    (["run", "--rollback", "trim", "--out", "{out}"], {}, 2,
     "'trim' is not one of 'auto', 'per-position', 'replay', 're-forward'"),
    (["run", "--out", "{file}"], {}, 2, "is a file"),
    (["run", "--models", "tiny-moe", "--out", "{runs}"], {}, 1, "is corrupt"),
    (["run", "--models", "tiny-moe", "--out", "{out}"], NO_MEMORY, 2, "MAC_MOESD_MEMORY_LIMIT=lots is not a number"),
    (["run", "--target", "nope", "--draft", "tiny-draft", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["run", "--target", "tiny-moe", "--draft", "tiny-draft", "--out", "{out}"], {}, 2,
     "has no weights here (no *.safetensors)"),
    (["run", "--target", "{pair_target}", "--draft", "{pair_draft},{pair_target}", "--out", "{out}"], {}, 2,
     "--draft names 2 drafter models: a run fits one drafter's step"),
    (["run", "--target", "{pair_target}", "--draft", "{pair_draft}", "--alpha", "0.5", "--out", "{out}"], {}, 2,
     "--alpha sets the acceptance an MTP head's runs impose"),
    (["run", "--target", "{pair_target}", "--draft", "mtp-head", "--alpha", "1", "--out", "{out}"], {}, 2,
     "'--alpha': 1.0 is not in the range 0<x<1"),
    (["run", "--target", "{pair_target}", "--draft", "prompt-lookup", "--serving", "--out", "{out}"], {}, 2,
     "--serving measures mlx_lm.server with a drafter model"),
    (["run", "--target", "{pair_target}", "--draft", ",", "--out", "{out}"], {}, 2, "name at least one drafter"),
    # sweep
    (["sweep", "tiny-mo", "--out", "{out}"], {}, 1, "did you mean tiny-moe"),
    (["sweep", "/no/such/config.json", "--out", "{out}"], {}, 1, "config file not found"),
    (["sweep", "tiny-moe", "--batch", "0", "--out", "{out}"], {}, 2, "0 is not >= 1"),
    (["sweep", "tiny-moe", "--batch", "", "--out", "{out}"], {}, 2, "'' is not a comma-separated list of ints"),
    (["sweep", "tiny-moe", "--batch", "1,x", "--out", "{out}"], {}, 2, "not a comma-separated list of ints"),
    (["sweep", "tiny-moe", "--tokens", "-1", "--out", "{out}"], {}, 2, "-1 is not >= 1"),
    (["sweep", "tiny-moe", "--tokens", "1,,2", "--out", "{out}"], {}, 2, "not a comma-separated list"),
    (["sweep", "tiny-moe", "--context", "5000", "--out", "{out}"], {}, 2, "maximum of 4096 positions"),
    (["sweep", "tiny-moe", "--context", "0", "--out", "{out}"], {}, 2, "'--context': 0 is not in the range"),
    (["sweep", "tiny-moe", "--layers", "9", "--out", "{out}"], {}, 2, "--layers must be in 1..4"),
    (["sweep", "tiny-moe", "--layers", "0", "--out", "{out}"], {}, 2, "'--layers': 0 is not in the range"),
    (["sweep", "tiny-moe", "--decode-chain", "1", "--out", "{out}"], {}, 2, "1 is not in the range x>=2"),
    (["sweep", "tiny-moe", "--context", "16", "--kv-context", "16", "--out", "{out}"], {}, 2,
     "--kv-context must be in 0..15"),
    (["sweep", "tiny-moe", "--routing", "bogus", "--out", "{out}"], {}, 2, "--routing must be model, uniform"),
    (["sweep", "tiny-moe", "--routing", "correlated:2", "--out", "{out}"], {}, 2, "needs C in [0, 1], got '2'"),
    (["sweep", "tiny-moe", "--routing", "trace:/no/such.npz", "--out", "{out}"], {}, 2, "routing trace not found"),
    (["sweep", "tiny-moe", "--bits", "3", "--out", "{out}"], {}, 2, "'3' is not one of '4', '8'"),
    (["sweep", "tiny-moe", "--dtype", "float8", "--out", "{out}"], {}, 2, "'float8' is not one of"),
    (["sweep", "tiny-moe", "--gamma", "0", "--out", "{out}"], {}, 2, "'--gamma': 0 is not in the range"),
    (["sweep", "tiny-moe", "--draft", "nope", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["sweep", "tiny-moe", "--gather", "fast", "--out", "{out}"], {}, 2, "'fast' is not one of 'mlx-lm', 'sorted'"),
    (["sweep", "tiny-moe", "--seconds-per-point", "0", "--out", "{out}"], {}, 2, "0.0 is not in the range x>0"),
    (["sweep", "tiny-moe", "--memory-limit", "lots", "--out", "{out}"], {}, 2, "'lots' is not a valid float"),
    (["sweep", "tiny-moe", "--out", "{out}"], NO_MEMORY, 2, "MAC_MOESD_MEMORY_LIMIT=lots is not a number"),
    (["sweep", "tiny-moe", "--out", "{out}"], {"MAC_MOESD_MEMORY_LIMIT": "-1"}, 2, "must be > 0 GiB"),
    (["sweep", "tiny-moe", "--out", "{file}"], {}, 2, "is a file"),
    (["sweep", "no-org/no-model", "--out", "{out}"], {}, 1, "not in the local Hugging Face cache"),
    (["sweep", "tiny-moe", "--out", "{corrupt}"], {}, 1, "is corrupt"),
    (["sweep", "tiny-moe", "--out", "{foreign}"], {}, 1, "was measured elsewhere"),
    (["sweep", "tiny-moe", "--out", "{newer}"], {}, 1, "has schema 'mac-moesd/99'"),
    (["sweep", "tiny-moe", "--out", "{mistyped}"], {}, 1, "sweeps is a string, not an object"),
    (["sweep", "tiny-moe", "--rank-timeout", "5", "--out", "{out}"], {}, 2, "--rank-timeout goes with --parallel"),
    (["sweep", "tiny-moe", "--parallel", "tensor", "--rank-timeout", "0", "--out", "{out}"], {}, 2,
     "'--rank-timeout': 0.0 is not in the range"),
    (["sweep", "{too_many_experts}", "--out", "{out}"], {}, 1, "routed to 8 experts but the model has only 4"),
    (["sweep", "{not_json}", "--out", "{out}"], {}, 1, "is not valid JSON"),
    (["sweep", "{no_model_type}", "--out", "{out}"], {}, 1, "has no 'model_type'"),
    (["sweep", "{incomplete}", "--out", "{out}"], {}, 1, "lacks 'num_hidden_layers'"),
    (["sweep", "{unbuildable}", "--out", "{out}"], {}, 1, "cannot build unbuildable from its config"),
    (["sweep", "{bad_vocab}", "--out", "{out}"], {}, 1, "vocab_size 'many' is not a positive integer"),
    (["sweep", "{huge}", "--batch", "1", "--tokens", "1", "--out", "{out}"], {}, 1, "GiB is usable here"),
    # roofline
    (["roofline", "--sizes", "0", "--out", "{out}"], {}, 2, "0.0 is not > 0"),
    (["roofline", "--sizes", "x", "--out", "{out}"], {}, 2, "not a comma-separated list of floats"),
    (["roofline", "--max-size", "0", "--out", "{out}"], {}, 2, "0.0 is not in the range x>0"),
    (["roofline", "--out", "{file}"], {}, 2, "is a file"),
    (["roofline", "--out", "{corrupt}"], {}, 1, "is corrupt"),
    (["roofline", "--out", "{foreign}"], {}, 1, "was measured elsewhere"),
    # routing
    (["routing", "tiny-moe", "--layers", "99", "--out", "{out}"], {}, 1, "--layers must be in 1..4"),
    (["routing", "tiny-moe", "--layers", "0", "--out", "{out}"], {}, 2, "'--layers': 0 is not in the range"),
    (["routing", "tiny-moe", "--save-trace", "/no/such/folder/trace.npz", "--out", "{out}"], {}, 2,
     "folder /no/such/folder does not exist"),
    (["routing", "tiny-moe", "--save-trace", "{file}/trace.npz", "--out", "{out}"], {}, 2, "does not exist"),
    (["routing", "tiny-moe", "--text", "/no/such/text", "--out", "{out}"], {}, 2, "text file not found"),
    (["routing", "tiny-moe", "--tau", "1", "--out", "{out}"], {}, 2, "1.0 is not in the range 0<x<1"),
    (["routing", "tiny-moe", "--batch", "0", "--out", "{out}"], {}, 2, "0 is not >= 1"),
    (["routing", "tiny-moe", "--length", "0", "--out", "{out}"], {}, 2, "'--length': 0 is not in the range"),
    (["routing", "tiny-dense", "--out", "{out}"], {}, 1, "has no MoE layers"),
    (["routing", "nope", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["routing", "tiny-moe", "--out", "{corrupt}"], {}, 1, "is corrupt"),
    # fit
    (["fit", "/no/such/path"], {}, 1, "results file not found"),
    (["fit", "{empty}"], {}, 1, "results file not found"),
    (["fit", "{corrupt}"], {}, 1, "is corrupt"),
    (["fit", "{newer}"], {}, 1, "has schema 'mac-moesd/99'"),
    (["fit", "{mistyped}"], {}, 1, "sweeps is a string, not an object"),
    (["fit", "{not_results}"], {}, 1, "is not a mac-moesd results file"),
    (["fit", "{out}", "--model", "nope"], {}, 1, "no MoE sweep of nope in the results"),
    (["fit", "{dense}"], {}, 1, "no MoE sweep in the results"),
    (["fit", "{out}", "--alpha", "1.5"], {}, 2, "1.5 is not in (0, 1)"),
    (["fit", "{out}", "--alpha", "0"], {}, 2, "0.0 is not > 0"),
    (["fit", "{out}", "--verify-tokens", "gamma+2"], {}, 2, "'gamma+2' is not one of 'gamma', 'gamma+1'"),
    # report and compare
    (["report", "/no/such/path"], {}, 2, "does not exist"),
    (["report", "{empty}"], {}, 1, "results file not found"),
    (["report", "{corrupt}"], {}, 1, "is corrupt"),
    (["report", "{newer}"], {}, 1, "has schema 'mac-moesd/99'"),
    (["report", "{mistyped}"], {}, 1, "sweeps is a string, not an object"),
    (["report", "{nan}"], {}, 1, "is nan, not a finite number"),
    (["report", "{file}"], {}, 2, "is a file"),
    (["compare"], {}, 2, "Missing argument 'FOLDERS...'"),
    (["compare", "/no/such/path"], {}, 2, "does not exist"),
    (["compare", "{empty}"], {}, 1, "results file not found"),
    (["compare", "{corrupt}"], {}, 1, "is corrupt"),
    (["compare", "{mistyped}"], {}, 1, "sweeps is a string, not an object"),
    (["compare", "{out}", "--out", "{file}"], {}, 2, "is a file"),
    # theory
    (["theory", "--experts", "0", "--top-k", "1"], {}, 2, "'--experts'"),
    (["theory", "--experts", "8", "--top-k", "9"], {}, 2, "larger than --experts 8"),
    (["theory", "-E", "8", "-K", "2", "--tau", "1.5"], {}, 2, "'--tau'"),
    (["theory", "-E", "8", "-K", "2", "--gamma", "1,x"], {}, 2, "not a comma-separated list of ints"),
    (["theory", "-E", "8", "-K", "2", "--alpha", "1.5"], {}, 2, "'--alpha'"),
    (["theory", "-E", "eight", "-K", "2"], {}, 2, "'eight' is not a valid integer"),
    (["theory", "-E", "8", "-K", "2", "--correlation", "1.5"], {}, 2, "1.5 is not in the range 0<x<=1"),
    (["theory", "-E", "8", "-K", "2", "--correlation", "-0.1"], {}, 2, "-0.1 is not in the range 0<x<=1"),
    (["theory", "-E", "8", "-K", "2", "--max-tokens", "0"], {}, 2, "'--max-tokens': 0 is not in the range"),
    (["theory", "-E", "8"], {}, 2, "Missing option '--top-k'"),
    # spec
    (["spec", "tiny-moe", "--out", "{out}"], {}, 2, "Missing option '--draft'"),
    (["spec", "nope", "--draft", "tiny-draft", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["spec", "tiny-moe", "--draft", "nope", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--precision", "0", "--out", "{out}"], {}, 2,
     "0.0 is not in the range 0<x<1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--precision", "1", "--out", "{out}"], {}, 2,
     "1.0 is not in the range 0<x<1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--budget", "0", "--out", "{out}"], {}, 2,
     "'--budget': 0.0 is not in the range x>0"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--repeats", "0", "--out", "{out}"], {}, 2,
     "'--repeats': 0 is not in the range x>=1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--max-prompts", "0", "--out", "{out}"], {}, 2,
     "'--max-prompts': 0 is not in the range x>=1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--temperature", "1", "--out", "{out}"], {}, 2,
     "--temperature above 0 needs --mode real"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--temperature", "-1", "--out", "{out}"], {}, 2, "-1.0 is not >= 0"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--alpha", "1", "--out", "{out}"], {}, 2,
     "--alpha values must be in (0, 1)"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--alpha", "0", "--out", "{out}"], {}, 2, "0.0 is not > 0"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--gamma", "0", "--out", "{out}"], {}, 2, "0 is not >= 1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--batch", "0", "--out", "{out}"], {}, 2, "0 is not >= 1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--tokens", "-1", "--out", "{out}"], {}, 2,
     "-1 is not in the range x>=1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--context", "0", "--out", "{out}"], {}, 2,
     "0 is not in the range x>=1"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--mode", "bogus", "--out", "{out}"], {}, 2,
     "'bogus' is not one of 'real'"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--mode", "real", "--prompts", "code", "--out", "{out}"], {}, 2,
     "--prompts needs a model with weights"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--rollback", "trim", "--out", "{out}"], {}, 2,
     "'trim' is not one of 'auto', 'per-position', 'replay', 're-forward'"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--out", "{corrupt}"], {}, 1, "is corrupt"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--out", "{file}"], {}, 2, "is a file"),
    (["spec", "tiny-moe", "--draft", "tiny-draft", "--memory-limit", "0.000001", "--out", "{out}"], {}, 1,
     "needs about 136 MiB even with one layer"),
    (["spec", "tiny-moe", "--draft", "prompt-lookup", "--mode", "emulated-acceptance", "--out", "{out}"], {}, 2,
     "--draft prompt-lookup proposes real tokens from the context: it runs with --mode real only"),
    (["spec", "tiny-moe", "--draft", "prompt-lookup", "--out", "{out}"], {}, 2,
     "--draft prompt-lookup needs real text: tiny-moe decodes random token ids"),
    (["spec", "tiny-moe", "--draft", "prompt-lookup", "--lookup-min-ngram", "4", "--out", "{out}"], {}, 2,
     "'--lookup-min-ngram': 4 is above --lookup-max-ngram 3"),
    (["spec", "tiny-moe", "--draft", "prompt-lookup", "--lookup-max-ngram", "0", "--out", "{out}"], {}, 2,
     "'--lookup-max-ngram': 0 is not in the range x>=1"),
    (["spec", "tiny-moe", "--draft", "mtp-head", "--mode", "self-draft", "--out", "{out}"], {}, 2,
     "runs with --mode emulated-acceptance (--alpha) only"),
    (["spec", "tiny-mamba-moe", "--draft", "mtp-head", "--out", "{out}"], {}, 1,
     "keeps caches for some layers only"),
    # serving (more in test_serving*.py)
    (["serving", "tiny-moe", "--concurrency", "0", "--out", "{out}"], {}, 2, "0 is not >= 1"),
    (["serving", "tiny-moe", "--window", "0", "--out", "{out}"], {}, 2, "'--window': 0.0 is not in the range"),
    (["serving", "tiny-moe", "--tokens", "0", "--out", "{out}"], {}, 2, "'--tokens': 0 is not in the range"),
    (["serving", "tiny-moe", "--gamma", "0", "--out", "{out}"], {}, 2, "'--gamma': 0 is not in the range"),
    (["serving", "tiny-moe", "--url", "nourl", "--out", "{out}"], {}, 2, "'nourl' is not NAME=URL"),
    (["serving", "tiny-moe", "--draft", "prompt-lookup", "--out", "{out}"], {}, 2,
     "--draft prompt-lookup: mlx_lm.server drafts with a model only"),
    (["serving", "tiny-moe", "--prompts", ",", "--out", "{out}"], {}, 2, "name at least one prompt set"),
    (["serving", "tiny-moe", "--shared-prefix", "-1", "--out", "{out}"], {}, 2, "-1 is not in the range x>=0"),
    (["serving", "tiny-moe", "--fit", "/no/such", "--out", "{out}"], {}, 2, "'/no/such' does not exist"),
    (["serving", "--draft", "tiny-draft", "--out", "{out}"], {}, 2, "--draft goes with TARGET"),
    (["serving", "nope", "--out", "{out}"], {}, 1, "unknown model 'nope'"),
    (["serving", "--out", "{out}"], {}, 2, "name a TARGET model to launch mlx_lm.server with, or --url"),
    (["serving", "--url", "x=ftp://h:1", "--out", "{out}"], {}, 2, "expected NAME=http://HOST:PORT"),
    (["serving", "--url", "a=http://127.0.0.1:9", "--url", "a=http://127.0.0.1:10", "--out", "{out}"], {}, 2,
     "--url names must differ"),
    (["serving", "--url", "a=http://127.0.0.1:9", "--prompts", "/no/such.txt", "--out", "{out}"], {}, 2,
     "prompt file not found"),
    (["serving", "--url", "a=http://127.0.0.1:9", "--out", "{out}"], {}, 1, "does not answer (ConnectError)"),
    (["serving", "--url", "a=http://127.0.0.1:9", "--fit", "{corrupt}", "--out", "{out}"], {}, 1, "is corrupt"),
    (["serving", "--url", "a=http://127.0.0.1:9", "--fit", "{empty}", "--out", "{out}"], {}, 1,
     "results file not found"),
    (["serving", "--served-model", "m", "--out", "{out}"], {}, 2, "--served-model goes with --url"),
    (["serving", "{too_many_experts}", "--out", "{out}"], {}, 1, "routed to 8 experts"),
    (["serving", "{unbuildable}", "--out", "{out}"], {}, 2, "has no weights (no model*.safetensors)"),
    (["serving", "tiny-moe", "--out", "{out}"], {}, 2, "a server needs the model's files"),
]


def _folder(root, name, results=None):
    folder = root / name
    folder.mkdir()
    if results is not None:
        (folder / "results.json").write_text(results)
    return folder


def _config(root, name, text):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(text if isinstance(text, str) else json.dumps(text))
    return folder


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The placeholders of ``CASES``: results folders (this machine's, corrupt, foreign, ...),
    configs (bad ones), and a plain file."""
    root = tmp_path_factory.mktemp("bad-inputs")
    # The recorded quick run as if measured here (this machine's meta), and its dense sweep alone
    _, meta, _ = commands.open_store(root / "meta", lambda message: None)
    mine = {**json.loads(RECORDED.read_text()), "meta": meta}
    dense = {**mine, "sweeps": {k: v for k, v in mine["sweeps"].items() if k.startswith("tiny-dense")}}
    out, dense = _folder(root, "out", json.dumps(mine)), _folder(root, "dense", json.dumps(dense))
    moe = {"model_type": "qwen2_moe", "num_hidden_layers": 2, "vocab_size": 100, "hidden_size": 64,
           "num_experts": 4, "num_experts_per_tok": 8}
    (root / "file").write_text("a file, not a folder")
    runs = _folder(root, "runs")  # run's --out holds one folder per chip
    _folder(runs, hardware.detect().slug, "{half a file")
    return {
        "out": out, "dense": dense, "runs": runs, "file": root / "file",
        "pair_target": TINY_PAIR / "target", "pair_draft": TINY_PAIR / "draft",
        "empty": _folder(root, "empty"),
        "corrupt": _folder(root, "corrupt", "{half a file"),
        "newer": _folder(root, "newer", json.dumps(dict(mine, schema="mac-moesd/99"))),
        "foreign": _folder(root, "foreign", json.dumps(dict(mine, meta=dict(mine["meta"], chip_slug="apple-m9")))),
        "mistyped": _folder(root, "mistyped", json.dumps(dict(mine, sweeps="all of them"))),
        "nan": _folder(root, "nan", json.dumps(mine).replace('"median_s": ', '"median_s": NaN, "was": ', 1)),
        "not_results": _folder(root, "not_results", "[1, 2, 3]"),
        "too_many_experts": _config(root, "too_many_experts", moe),
        "not_json": _config(root, "not_json", "{"),
        "no_model_type": _config(root, "no_model_type", "{}"),
        "incomplete": _config(root, "incomplete", {"model_type": "qwen3", "hidden_size": 64}),
        "unbuildable": _config(root, "unbuildable", {"model_type": "qwen3", "hidden_size": 64,
                                                     "num_hidden_layers": 2, "vocab_size": 100}),
        "bad_vocab": _config(root, "bad_vocab", dict(moe, num_experts_per_tok=2, vocab_size="many")),
        "huge": _config(root, "huge", {"model_type": "qwen3", "hidden_size": 65536, "num_hidden_layers": 2,
                                       "intermediate_size": 65536, "num_attention_heads": 64,
                                       "num_key_value_heads": 8, "head_dim": 1024, "vocab_size": 3_000_000,
                                       "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                                       "max_position_embeddings": 4096, "rope_theta": 1e6}),
    }


def _snapshot(places):
    return {path: path.read_bytes() for folder in places.values() if folder.is_dir()
            for path in folder.rglob("results.json")}


def _too_long(*_):
    raise TimeoutError("a bad input started real work instead of being refused")


def test_the_table_covers_every_command():
    commands = {argv[0] for argv, *_ in CASES}
    assert set(cli.commands) - commands == {"info", "zoo", "selftest"} - commands
    assert len(CASES) >= 90


@pytest.mark.parametrize("argv, env, code, phrase", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_a_bad_input_is_one_line_and_changes_nothing(places, argv, env, code, phrase):
    before = _snapshot(places)
    args = [a.format(**places) for a in argv]
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(30)
    try:
        result = CliRunner().invoke(cli, args, env=env)
    finally:
        signal.alarm(0)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert (result.exit_code, len(errors)) == (code, 1), result.stderr + repr(result.exception)
    assert phrase in errors[0]
    assert result.stderr.rstrip().endswith(errors[0]) and "Traceback" not in result.stderr
    assert _snapshot(places) == before
