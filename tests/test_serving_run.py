"""`run --serving`: the stage in the run's plan, its dry-run memory and time, and its skip on
random-weight models."""

import json
from pathlib import Path

from click.testing import CliRunner

from mac_moesd.cli import cli
from mac_moesd.pipeline import plans, stages


def test_dry_run_counts_weights_and_kv_for_the_largest_concurrency(tiny_pair):
    target, draft = tiny_pair
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--json", "--chip", "Apple M1", "--memory", "8",
                                      "--target", target, "--draft", draft, "--serving"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    stage = json.loads(result.stdout)["stages"][-1]
    assert stage["stage"] == "serving target" and stage["fits"]
    weights = sum(f.stat().st_size for d in (target, draft) for f in Path(d).glob("model*.safetensors"))
    assert stage["parts"]["weights"] == weights  # float16 as stored, on a GPU
    # KV per cached token, float16: target 2 layers x (K+V) x 2 KV heads x 16 dims x 2 B = 256 B; drafter
    # 1 layer: 128 B. The longest built-in prompt plus 128 tokens passes 256 slots: 512 slots a request,
    # 32 requests at the default concurrencies' largest.
    assert stage["parts"]["kv"] == 32 * 512 * (256 + 128)
    assert stage["peak_bytes"] == weights + stage["parts"]["kv"]
    # Two servers x two prompt sets x six concurrencies x (5 s warm-up + 20 s window), plus starts and loads.
    assert stage["eta_s"] >= 2 * 2 * 6 * 25


def test_random_weight_run_lists_serving_as_skipped_with_why():
    plan = plans.default_plan("cpu", quick=True)
    assert [s.label for s in stages.default_stages(plan, serving=True)][-1] == "serving"
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--json", "--chip", "Apple M1", "--memory", "8",
                                      "--serving"], standalone_mode=False)
    stage = json.loads(result.stdout)["stages"][-1]
    assert stage["stage"] == "serving" and "random weights" in stage["skipped"]
