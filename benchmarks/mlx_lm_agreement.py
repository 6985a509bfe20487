"""Batch-1 decode speed from our sweep against `python -m mlx_lm.benchmark` (goal: within 5%).

Saves a random-weight model (with a word-level tokenizer) to a temporary folder, runs mlx-lm's
benchmark on it (prompt P, generating G tokens: contexts P..P+G), and times our pipelined and
synchronous T_T(1,1) at the mid context P + G/2 over the same folder. On Linux both use the same BLAS (LD_PRELOAD for
mlx-lm's process when we loaded OpenBLAS). Prints tokens/s both ways and their ratio.

    python benchmarks/mlx_lm_agreement.py [--model tiny-moe] [--prompt 64] [--generate 128]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)

from mac_moesd.machine import blas, metadata
from mac_moesd.inputs import localmodel, models
from mac_moesd.measure.clock import timing
from mac_moesd.results import ResultsStore
from mac_moesd.measure.forward.sweep import SweepConfig, run_sweep

TRIAL = re.compile(r"Trial \d+:\s+prompt_tps=([\d.]+), generation_tps=([\d.]+)")


def mlx_lm_generation_tps(folder: Path, prompt: int, generate: int, trials: int) -> list[float]:
    env = dict(os.environ)
    if blas.preload():
        env["LD_PRELOAD"] = blas.preload()
    cmd = [sys.executable, "-m", "mlx_lm.benchmark", "--model", str(folder), "-p", str(prompt),
           "-g", str(generate), "-n", str(trials)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return [float(m.group(2)) for m in TRIAL.finditer(out)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--generate", type=int, default=128)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        built = models.build(models.resolve(args.model))
        built.materialise()
        localmodel.save_model_folder(built, folder)
        theirs = statistics.median(mlx_lm_generation_tps(folder, args.prompt, args.generate, args.trials))
        store = ResultsStore(Path(tmp) / "results.json", metadata.collect())
        cfg = SweepConfig(model=str(folder), batches=(1,), tokens=(1,),
                          context=args.prompt + args.generate // 2,
                          budget=timing.Budget(seconds_per_point=5.0, target_ci=0.005))
        doc = run_sweep(cfg, store, None)
    sync = 1.0 / doc["points"][0]["median_s"]
    pipelined = 1.0 / doc["points"][0]["pipelined"]["median_s"]
    print(f"model {args.model}: prompt {args.prompt}, generate {args.generate}, BLAS {blas.describe('cpu')['name']}")
    print(f"mlx_lm.benchmark generation:        {theirs:.1f} tokens/s (median of {args.trials} trials)")
    print(f"mac-moesd pipelined decode at B=1:  {pipelined:.1f} tokens/s (context {cfg.context})")
    print(f"mac-moesd synchronous 1/T_T(1,1):   {sync:.1f} tokens/s (CV {doc['points'][0]['cv']:.1%})")
    print(f"ratio pipelined / mlx-lm: {pipelined / theirs:.3f}  goal within 5%")
    print(f"ratio synchronous / mlx-lm: {sync / theirs:.3f}  (the difference is graph construction)")


if __name__ == "__main__":
    main()
