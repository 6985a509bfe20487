"""Turn a MODEL argument into an mlx-lm model: random weights from a config, or a local checkpoint.

MODEL is a zoo name, a directory with config.json, a config.json path, or a Hugging Face repo id
already in the local cache (never downloaded). Its name, which results keys use, is the zoo
name, the folder's own name however the path spelled it, or the repo id (also for a cache
snapshot given by its path, whose own name is a revision hash). Every path ends in mlx-lm's own ``Model`` class;
we only choose the config, the dtype, the quantization and the layer slice.

Random weights are what a config alone asks for: a zoo name, a config.json, or a folder that holds
a config.json and no weight files at all. A folder that holds weights must hold all of them: a
shard its ``model.safetensors.index.json`` names but that is absent, weights only in a format
mlx-lm does not load (``pytorch_model.bin``, GGUF, ...), or a tensor the model expects that no
file holds is refused with what is missing, never filled with random values.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_model, quantize_model

from mac_moesd import mlxlm_compat
from mac_moesd.inputs import hfcache, zoo
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves
from mac_moesd.inputs.trees import flatten
from mac_moesd.errors import MacMoesdError
from mac_moesd.results import schema

__all__ = ["Built", "ModelSource", "Sources", "build", "footprint", "mlx_lm_quiet", "quantized_dtype",
           "resolve", "stored_format", "weights_folder"]

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GROUP_SIZE = 64  # mlx-lm's default quantization group


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a config, and the directory of its weights if it has them."""

    name: str
    config: dict
    weights_dir: Path | None = None
    stored_config: dict | None = None  # the config as its file or zoo entry holds it, before ``zoo.normalise``

    @property
    def has_weights(self) -> bool:
        return self.weights_dir is not None

    def identity(self) -> schema.ModelIdentity:
        """What tells two models of one name apart in a results file (``ResultsStore.claim``): a
        digest of the config as stored (so that a change to how the suite reads configs leaves
        the digests of earlier files alone), and whether its weights are stored or random."""
        config = json.dumps(self.stored_config or self.config, sort_keys=True, default=str).encode()
        return {"config_sha256": hashlib.sha256(config).hexdigest()[:16],
                "weights": "stored" if self.has_weights else "random"}

    def claim(self, store) -> None:
        """This model's name claimed in the results ``store`` (``ResultsStore.claim``)."""
        store.claim(self.name, self.identity())


@dataclass(frozen=True)
class Sources:
    """A configuration's target and drafter model, resolved once per command (``resolve``) and
    passed down, so every step measures the same folders and names them alike."""

    target: ModelSource
    draft: ModelSource | None  # None where no drafter model drafts (prompt lookup, an MTP head)

    def claim(self, store) -> None:
        """Both models' names claimed in the results ``store`` (``ResultsStore.claim``)."""
        if (self.draft is not None and self.draft.name == self.target.name
                and self.draft.identity() != self.target.identity()):
            raise MacMoesdError(f"the target and the drafter are different models both named {self.target.name}: "
                                "results name models by their folders, so rename one of the folders")
        for source in (self.target, self.draft):
            if source is not None:
                source.claim(store)


def resolve(model: str) -> ModelSource:
    """A MODEL argument as a ModelSource (see the module docstring for the accepted forms)."""
    path = Path(model).expanduser()
    if path.is_dir():
        stored, config = zoo.read_config(path / "config.json")
        return ModelSource(_named(path), config, weights_folder(path), stored)
    if path.suffix == ".json" or path.exists():
        stored, config = zoo.read_config(path)
        return ModelSource(_named(path.parent) or path.stem, config, stored_config=stored)
    if "/" in model:
        # A snapshot with all its weights first; a config-only one (random weights) otherwise.
        cached = hfcache.cached_model(model) or hfcache.cached_model(model, need_weights=False)
        if cached is None:
            raise MacMoesdError(
                f"{model!r} is not a directory and not in the local Hugging Face cache at "
                f"{hfcache.cache_root()} (mac-moesd never downloads; fetch it first, e.g. `hf download`)"
            )
        # Named by its repo id: the snapshot folder's own name is a revision hash.
        return replace(resolve(str(cached)), name=model)
    entry = zoo.by_name(model)
    return ModelSource(entry.name, zoo.normalise(entry.config), stored_config=entry.config)


def _named(folder: Path) -> str:
    """A folder's own name, also where it was given as ``.`` or ``..`` (symlinks kept: the
    name the user gave, not its target's); a Hugging Face cache snapshot's repo id, as the same
    model named by its repo id is called."""
    return hfcache.repo_id_of(folder) or Path(os.path.abspath(folder)).name


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _foreign_weights(folder: Path) -> list[str]:
    """Weight files mlx-lm does not load (it reads model*.safetensors only)."""
    prefixes = ("model", "pytorch_model", "consolidated")
    return sorted(p.name for p in folder.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".gguf")
        or (p.suffix in (".bin", ".pt", ".pth") and p.name.startswith(prefixes))))


def weights_folder(folder: Path) -> Path | None:
    """``folder`` when it holds complete weights for mlx-lm, None when it holds no weight file at
    all (a config alone: random weights). Refuses, naming what is missing, a folder whose index
    names shards it lacks, or whose only weights are in a format mlx-lm does not load."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as err:
            raise MacMoesdError(f"{index} cannot be read as a safetensors index ({err})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MacMoesdError(f"{folder} lacks {len(missing)} of the {len(shards)} weight files its "
                                f"model.safetensors.index.json names: {_listed(missing)}; fetch them again")
        return folder
    if glob.glob(str(folder / "model*.safetensors")):
        return folder
    foreign = _foreign_weights(folder)
    if foreign:
        raise MacMoesdError(f"{folder} holds weights mlx-lm does not load ({_listed(foreign)}): it reads "
                            "model*.safetensors; convert them with `mlx_lm.convert`")
    return None


def _check_then_load(model: nn.Module, name: str, weights: list, strict: bool = True) -> nn.Module:
    """Stands in for ``model.load_weights`` once: refuses weights that leave a tensor the model
    expects unset or of another shape, then loads them. Extra tensors are fine: a checkpoint
    also holds the layers past a slice."""
    del model.load_weights  # the instance attribute; the class's method stays
    given = dict(weights)
    expected = dict(flatten(model.parameters()))
    missing = sorted(expected.keys() - given.keys())
    if missing:
        raise MacMoesdError(f"{name}: its safetensors lack {len(missing)} of the {len(expected)} tensors "
                            f"the model expects ({_listed(missing)}); the weights are incomplete")
    for key, array in expected.items():
        if given[key].shape != array.shape:
            raise MacMoesdError(f"{name}: tensor {key} has shape {tuple(given[key].shape)} in its "
                                f"safetensors, {tuple(array.shape)} in the model its config describes")
    return type(model).load_weights(model, weights, strict=False)


def _load(folder: Path, name: str, config: dict | None = None) -> nn.Module:
    """mlx-lm's ``load_model``, lazily, with every tensor the (sliced) model expects checked to be
    in the weights: its ``strict=False``, needed for the layers past a slice, would otherwise
    leave a missing tensor at its random initialisation without a word."""
    def classes(config: dict):  # mlx-lm passes config= by name
        model_class, args_class = mlxlm_compat.model_classes(config)

        def make(args) -> nn.Module:
            model = model_class(args)
            setattr(model, "load_weights", functools.partial(_check_then_load, model, name))  # over the method
            return model

        return make, args_class

    with mlx_lm_quiet():
        model, _ = load_model(folder, lazy=True, model_config=config, strict=False, get_model_classes=classes)
    if "load_weights" in vars(model):  # mlx-lm loaded without calling it: nothing was checked
        raise mlxlm_compat.incompatible("loading a checkpoint", "load_model calling Model.load_weights")
    return model


def _param_count(module: nn.Module) -> int:
    if hasattr(module, "bits"):  # quantized: count the weights it packs, as mlx-lm does
        bias = module.bias.size if "bias" in module else 0
        return module.weight.size * 32 // module.bits + bias
    return sum(v.size for _, v in flatten(module.parameters()))


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in flatten(module.parameters()))


def footprint(model: nn.Module, config: dict) -> schema.Footprint:
    """Count parameters and bytes from shapes alone (works on a lazy, unallocated model)."""
    shape = zoo.expert_shape(config)
    counts = {"total": [0, 0], "expert": [0, 0], "embedding": [0, 0], "head": [0, 0]}
    moe_layers = set()
    for path, module in flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        n, b = _param_count(module), _nbytes(module)
        counts["total"][0] += n
        counts["total"][1] += b
        if isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
            kind = "expert"
            moe_layers.add(path.split(".switch_mlp")[0].split(".experts")[0])
        elif isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            kind = "embedding"
        elif path.endswith("lm_head"):
            kind = "head"
        else:
            continue
        counts[kind][0] += n
        counts[kind][1] += b
    experts, top_k = shape if shape else (None, None)
    return with_derived({
        "params_total": counts["total"][0],
        "params_expert": counts["expert"][0],
        "params_embedding": counts["embedding"][0],
        "params_head": counts["head"][0],
        "bytes_total": counts["total"][1],
        "bytes_expert": counts["expert"][1],
        "bytes_embedding": counts["embedding"][1],
        "bytes_head": counts["head"][1],
        "experts": experts,
        "top_k": top_k,
        "layers": len(model.layers),
        "moe_layers": len(moe_layers),
        "layer_kinds": cast(schema.LayerKinds, layer_kinds(model)),
    })


def with_derived(counted: schema.Footprint) -> schema.Footprint:
    """A footprint's counts with the four figures derived from them: ``params_dense`` (what every
    token uses: attention, norms, shared experts, router, head), ``params_active`` (the dense part
    plus K of E experts), ``bytes_dense_streamed`` (read once per forward whatever the tokens: all
    but routed experts and the embedding table, of which a forward reads only the rows it looks
    up, plus the table again when the head is tied to it) and ``bytes_per_expert`` (one expert
    summed over the MoE layers, what N(t) multiplies)."""
    f = counted
    dense = f["params_total"] - f["params_expert"] - f["params_embedding"]
    experts, top_k = f["experts"], f["top_k"]
    tied = f["bytes_embedding"] if f["params_head"] == 0 else 0
    return {**f, "params_dense": dense,
            "params_active": dense + f["params_expert"] * top_k // experts if experts and top_k else dense,
            "bytes_dense_streamed": f["bytes_total"] - f["bytes_expert"] - f["bytes_embedding"] + tied,
            "bytes_per_expert": f["bytes_expert"] / experts if experts else 0.0}


SEQUENCE_MIXERS = {"kv": "attention", "sliding": "sliding", "recurrent": "linear"}


def layer_kinds(model: nn.Module) -> dict[str, int]:
    """How many decoder layers mix the sequence each way (``attention``, ``sliding`` window,
    ``linear``: a recurrent state, GatedDeltaNet or Mamba2), read off the caches mlx-lm makes for
    the model, and how many have a routed-expert FFN (``moe``) or a dense one (``mlp``). Nemotron-H
    counts each block as a layer: its Mamba and attention blocks have no FFN, its FFN blocks no cache.
    ``per_position``: the linear layers whose state an SD rollback can keep per position (their
    layers call mlx-lm's shared recurrence functions); the others are re-forwarded."""
    kinds = {name: 0 for name in (*SEQUENCE_MIXERS.values(), "per_position", "moe", "mlp")}
    for leaf in leaves(make_prompt_cache(model)):
        kinds[SEQUENCE_MIXERS[leaf_kind(leaf)]] += 1
    if kinds["linear"] and mlxlm_compat.recurrence_sites(model):
        kinds["per_position"] = kinds["linear"]
    for layer in model.layers:
        modules = [m for _, m in layer.named_modules()]
        if any(isinstance(m, (SwitchLinear, QuantizedSwitchLinear)) for m in modules):
            kinds["moe"] += 1
        elif any(type(m).__name__.endswith("MLP") for m in modules):
            kinds["mlp"] += 1
    return kinds


@dataclass
class Built:
    """A model ready to run, with what it is and what it costs."""

    model: nn.Module
    config: dict  # the config it was built from, sliced to ``layers``
    source: ModelSource
    dtype: str
    bits: int | None
    layers: int
    layers_full: int
    footprint: schema.Footprint

    def materialise(self) -> None:
        """Allocate the weights one array at a time, layer by layer: mlx-lm initialises each
        weight in float32 before the cast and quantization, and one ``mx.eval`` over a whole
        model (or layer) runs those transients side by side. One at a time, only the largest
        array's transient comes on top of the weights (``memory.init_transient_bytes``)."""
        for layer in self.model.layers:
            for _, array in flatten(layer.parameters()):
                mx.eval(array)
        for _, array in flatten(self.model.parameters()):
            mx.eval(array)  # embedding, final norm, head; the layers' arrays are done already


@contextlib.contextmanager
def mlx_lm_quiet():
    """Send what mlx-lm prints (e.g. quantize_model's "[INFO] Quantized model ...") to stderr:
    stdout carries only our output, one JSON document with --json."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _random_routers(model: nn.Module, shape: tuple[int, int] | None) -> None:
    """Give zero-initialised routers random weights, as ``nn.Linear`` initialises its own. mlx-lm
    builds the routers of several families (DeepSeek, GLM-4.5, Nemotron-H, ...) as zeros, to be
    overwritten by a checkpoint; with random weights they would send every token to the same
    K experts, and every sweep and routing count would time the cheapest MoE there is."""
    if shape is None:
        return
    for _, module in model.named_modules():
        weight = module.get("weight") if isinstance(module, nn.Module) else None
        if (type(module).__name__.endswith("Gate") and isinstance(weight, mx.array) and weight.ndim == 2
                and weight.shape[0] == shape[0]):
            bound = weight.shape[1] ** -0.5
            module.weight = mx.random.uniform(-bound, bound, weight.shape, dtype=weight.dtype)


def default_dtype() -> str:
    """float16 on a GPU; float32 on MLX's CPU backend, whose gather_mm supports only float32."""
    return "float16" if mx.default_device() == mx.gpu else "float32"


def quantized_dtype(model: nn.Module) -> str:
    """The dtype a pre-quantized model computes in, read from its tensors: that of its quantization
    scales and biases; where its scales are not floating point (mxfp4, nvfp4: 8-bit exponents),
    that of its other floating-point parameters. The largest share wins."""
    sizes: dict[mx.Dtype, int] = {}
    for scale_dtypes_only in (True, False):
        for path, array in flatten(model.parameters()):
            if mx.issubdtype(array.dtype, mx.floating) and (
                    not scale_dtypes_only or path.endswith((".scales", ".biases"))):
                sizes[array.dtype] = sizes.get(array.dtype, 0) + array.size
        if sizes:
            break
    names = {v: k for k, v in DTYPES.items()}
    found = max(sizes, key=sizes.__getitem__) if sizes else None
    if found not in names:
        raise MacMoesdError(f"a pre-quantized model in {found} (known: {', '.join(DTYPES)})")
    return names[found]


def build(
    source: ModelSource,
    dtype: str | None = None,
    bits: int | None = None,
    layers: int | None = None,
    seed: int = 0,
) -> Built:
    """Build ``source`` lazily (no weights allocated) at ``dtype``, quantized to ``bits`` if given,
    keeping its first ``layers`` decoder layers. Call ``materialise`` after the memory check.
    A pre-quantized checkpoint runs as stored: its bits and dtype are its own (``quantized_dtype``),
    whatever ``dtype`` and ``bits`` ask."""
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise MacMoesdError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if bits not in (None, 4, 8):
        raise MacMoesdError(f"--bits must be 4 or 8, got {bits}")
    layers_full = int(source.config["num_hidden_layers"])
    layers = layers or layers_full
    if not 1 <= layers <= layers_full:
        raise MacMoesdError(f"--layers must be in 1..{layers_full} for {source.name}, got {layers}")
    config = zoo.slice_config(source.config, layers)
    mx.random.seed(seed)
    try:
        if source.weights_dir is not None:
            model = _load(source.weights_dir, source.name, config)
        else:
            model_class, args_class = mlxlm_compat.model_classes(config)
            model = model_class(args_class.from_dict(copy.deepcopy(config)))
            _random_routers(model, zoo.expert_shape(config))
    except (ValueError, TypeError, KeyError) as err:  # unsupported model_type, missing config keys
        raise MacMoesdError(f"cannot build {source.name} from its config: {err}") from None
    already_quantized = "quantization" in source.config and source.has_weights
    if already_quantized:
        # Weights as stored: the checkpoint's own bits and dtype are the format the report and fit use.
        bits = int(source.config["quantization"].get("bits", 4))
        dtype = quantized_dtype(model)
    else:
        model.set_dtype(DTYPES[dtype])
        if bits is not None:
            # On CPU, quantize from float32 (docs/design.md §6): float16 scales are 20-35x slower.
            # Its only print is the bits per weight, which the footprint records: dropped, so a
            # lazy build (zoo, dry run) says nothing.
            with contextlib.redirect_stdout(io.StringIO()):
                model, config = quantize_model(model, config, group_size=GROUP_SIZE, bits=bits)
    return Built(model, config, source, dtype, bits, layers, layers_full, footprint(model, config))



def stored_format(source: ModelSource) -> str | None:
    """The weight format a checkpoint holds ("4bit", "fp16", ...): its quantization bits, else the
    dtype most of its parameters have, read lazily (no weight is loaded). None without weights."""
    if source.weights_dir is None:
        return None
    if "quantization" in source.config:
        return f"{int(source.config['quantization'].get('bits', 4))}bit"
    model = _load(source.weights_dir, source.name)
    sizes: dict[mx.Dtype, int] = {}
    for _, array in flatten(model.parameters()):
        sizes[array.dtype] = sizes.get(array.dtype, 0) + array.size
    names = {mx.float32: "fp32", mx.float16: "fp16", mx.bfloat16: "bf16"}
    return names.get(max(sizes, key=sizes.__getitem__), str(max(sizes, key=sizes.__getitem__)))


def describe_zoo() -> list[dict]:
    """One row per zoo model: shape, threshold, parameters and bytes (built lazily, nothing allocated)."""
    from mac_moesd.analysis import theory

    rows = []
    for entry in zoo.ZOO:
        fp = build(ModelSource(entry.name, entry.config), dtype="float16").footprint
        shape = zoo.expert_shape(entry.config)
        rho = theory.sparsity(*shape) if shape else None
        rows.append({
            "name": entry.name,
            "role": entry.role,
            "arch": entry.model_type,
            "experts": shape[0] if shape else None,
            "top_k": shape[1] if shape else None,
            "rho": rho,
            "threshold_tokens": theory.saturation_threshold(rho) if rho else None,
            "layers": entry.config["num_hidden_layers"],
            "params_total": fp["params_total"],
            "params_active": fp["params_active"],
            "params_expert": fp["params_expert"],
            "bytes": {f: fp["params_total"] * b for f, b in theory.WEIGHT_FORMATS.items()},
            "source": entry.source,
        })
    return rows
