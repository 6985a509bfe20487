"""Run by tests/test_distributed.py under `mlx.launch -n 2`: for each (model, mode), this rank's
logits of the sharded model on fixed tokens, written by rank 0 as OUT/<model>-<mode>.npy (or the
one-line refusal as .txt). Every split goes through the library's own sharding."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.measure.cluster.distributed import shard_built

out = Path(sys.argv[1])
cases = json.loads(sys.argv[2])  # [[config path, mode], ...]
group = mx.distributed.init(strict=True, backend="ring")
for path, mode in cases:
    source = models.resolve(path)
    name = f"{Path(path).parent.name}-{mode}"
    try:
        built, how = shard_built(models.build(source, "float32", seed=0), mode, group)
    except MacMoesdError as err:
        if group.rank() == 0:
            (out / f"{name}.txt").write_text(str(err))
        continue
    built.materialise()
    tokens = mx.array(np.random.default_rng(1).integers(0, source.config["vocab_size"], (2, 5)))
    logits = built.model(tokens)
    mx.eval(logits)
    if group.rank() == 0:
        np.save(out / f"{name}.npy", np.array(logits))
        (out / f"{name}.how").write_text(how)
