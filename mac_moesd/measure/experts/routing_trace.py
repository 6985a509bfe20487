"""Routing traces: the experts a real model chose on real text, saved by `routing --save-trace`
and replayed by `sweep --routing trace:FILE`.

Format ``mac-moesd-trace/1``, a NumPy ``.npz`` archive (``numpy.load(path)`` reads it):

- ``indices``: int16, shape (moe_layers, sequences, length, K), the top-k expert ids each MoE
  layer chose for each token of each routed sequence (layer order as the model runs them);
- ``experts`` (E) and ``top_k`` (K): int scalars; a trace replays only on a model with both equal;
- ``format``, ``model``, ``text``, ``token_ids``: strings saying what was routed and how.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mac_moesd.errors import BadInput, MacMoesdError

__all__ = ["FORMAT", "Trace", "interleave", "load_trace", "save_trace"]

FORMAT = "mac-moesd-trace/1"


@dataclass(frozen=True)
class Trace:
    indices: np.ndarray  # (moe_layers, sequences, length, K)
    experts: int
    top_k: int
    model: str
    text: str
    digest: str  # sha256 of the file, first 12 hex digits: which trace a results entry replayed

    @property
    def layers(self) -> int:
        return self.indices.shape[0]

    @property
    def sequences(self) -> int:
        return self.indices.shape[1]

    @property
    def length(self) -> int:
        return self.indices.shape[2]


def save_trace(path: Path, indices: np.ndarray, experts: int, top_k: int, model: str, text: str,
               token_ids: str) -> None:
    """Write a trace atomically (temporary file, then rename), so a failure leaves no half file."""
    path = Path(path)
    if indices.ndim != 4 or indices.shape[-1] != top_k:
        raise MacMoesdError(f"trace indices must be (layers, sequences, length, {top_k}), got {indices.shape}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez_compressed(handle, indices=indices.astype(np.int16), experts=np.int64(experts),
                                top_k=np.int64(top_k), format=FORMAT, model=model, text=text,
                                token_ids=token_ids)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: Path) -> None:
    """Refuse, before routing anything, a trace path whose folder does not exist."""
    if not Path(path).parent.is_dir():
        raise BadInput(f"--save-trace: folder {Path(path).parent} does not exist")


def load_trace(path: Path) -> Trace:
    """Read and validate a trace; BadInput saying what is wrong."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        with np.load(path, allow_pickle=False) as archive:
            fields = {k: archive[k] for k in archive.files}
    except FileNotFoundError:
        raise BadInput(f"routing trace not found: {path}") from None
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise BadInput(f"{path} is not a routing trace ({err})") from None
    if str(fields.get("format", "")) != FORMAT:
        raise BadInput(f"{path} is not a {FORMAT} routing trace (written by `mac-moesd routing --save-trace`)")
    indices = fields["indices"]
    experts, top_k = int(fields["experts"]), int(fields["top_k"])
    if indices.ndim != 4 or indices.shape[-1] != top_k or indices.size == 0:
        raise BadInput(f"{path}: indices of shape {indices.shape} do not hold top-{top_k} choices")
    if indices.min() < 0 or indices.max() >= experts:
        raise BadInput(f"{path}: expert ids outside 0..{experts - 1}")
    return Trace(indices=indices, experts=experts, top_k=top_k, model=str(fields["model"]),
                 text=str(fields["text"]), digest=hashlib.sha256(raw).hexdigest()[:12])


def interleave(traces: list[Trace]) -> np.ndarray:
    """The sequences of several traces of one model as one (layers, sequences, length, K) array,
    taken in turn (the first of each trace, then the second of each, ...), so that the first B
    sequences of the result mix the traces evenly whatever B is. Each sequence keeps its last
    ``length`` tokens, the shortest trace's length (the replay takes windows from the end), and
    the MoE layers every trace holds: a trace of a model routed as a slice holds its first layers."""
    if len({(t.experts, t.top_k) for t in traces}) != 1:
        raise MacMoesdError("traces of different expert counts or top-k cannot be interleaved: "
                            + ", ".join(f"{t.text} (E={t.experts}, K={t.top_k})" for t in traces))
    layers, length = min(t.layers for t in traces), min(t.length for t in traces)
    order = [(t, s) for s in range(max(t.sequences for t in traces)) for t in traces if s < t.sequences]
    return np.stack([t.indices[:layers, s, t.length - length:, :] for t, s in order], axis=1)
