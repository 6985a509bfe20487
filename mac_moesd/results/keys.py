"""Every key of a results file, built and parsed here and nowhere else (docs/design.md §7).

A document's key says what was measured, so that a later command finds it again and a resumed
one skips it: the same measurement must always get the same key, whichever command made it. The
models in a key are their resolved names (a folder's name, not the path given).
"""

from __future__ import annotations

from mac_moesd.results import schema

__all__ = [
    "DRAFTER_KINDS", "DRAFT_CHAINS", "chain_points", "chain_record", "chains_of", "MTP_HEAD", "PAIR_MODES", "PROMPT_LOOKUP", "drafter_kind", "pair_key", "pair_spec_key",
    "parse_point_key", "point_key", "prompt_set_text", "reject_key", "routing_document_key", "routing_key",
    "routing_key_model", "serving_key", "spec_document_key", "spec_key", "spec_key_parts", "sweep_key", "sweep_key_variant",
]

# The drafters --draft names without a model (their names in results keys); any other name is a
# drafter model, kind "model".
PROMPT_LOOKUP, MTP_HEAD = "prompt-lookup", "mtp-head"
DRAFTER_KINDS = (PROMPT_LOOKUP, MTP_HEAD)

# The mode a pair run measures each kind of drafter in: an MTP head with acceptance imposed
# (it is emulated), every other kind with its own drafts.
PAIR_MODES = {MTP_HEAD: "emulated-acceptance"}


def drafter_kind(draft: str) -> str:
    """The kind of drafter a --draft name is: ``prompt-lookup``, ``mtp-head`` or ``model``."""
    return draft if draft in DRAFTER_KINDS else "model"


def point_key(batch: int, tokens: int) -> str:
    """The key of a timed point: ``"<batch>x<tokens>"`` (B sequences of t new tokens each)."""
    return f"{batch}x{tokens}"


def parse_point_key(key: str) -> tuple[int, int]:
    """(batch, tokens) of a ``point_key``."""
    batch, tokens = key.split("x")
    return int(batch), int(tokens)


# A target's sweep entry (its larger slice's, where sliced) holds its drafters' chains timed after
# its verify (``measure.forward.draft_chain``), by drafter: ``points`` keyed ``point_key(batch,
# gamma)`` (gamma one-token steps), and ``skipped``: why a sweep timed none.
DRAFT_CHAINS = "draft_chains"


def chains_of(entry: dict, drafter: str) -> dict:
    """A sweep entry's record of ``drafter``'s chains (created empty where there is none)."""
    return entry.setdefault(DRAFT_CHAINS, {}).setdefault(drafter, {"points": {}})


def chain_record(entries: list[dict], drafter: str) -> tuple[dict, int | None]:
    """``drafter``'s chains after a verify of this target, and the target's layers they followed:
    from the deepest of a sweep's entries (its slices) that holds chains, else the deepest that
    says why it holds none; an empty record and None where none does either."""
    def record(entry: dict) -> dict:
        return entry.get(DRAFT_CHAINS, {}).get(drafter) or {}

    for wanted in ("points", "skipped"):
        holding = [e for e in entries if record(e).get(wanted)]
        if holding:
            entry = max(holding, key=lambda e: e.get("layers", 0))
            return record(entry), entry.get("layers")
    return {"points": {}}, None


def chain_points(record: dict) -> list[tuple[int, int, float]]:
    """(batch, gamma, median seconds of the chain) of a chain record, sorted."""
    return sorted((*parse_point_key(key), float(m["median_s"])) for key, m in record.get("points", {}).items())


def sweep_key(model: str, weight_format: str, context: int, layers: int, routing: str = "model",
              gather: str = "mlx-lm") -> str:
    """The key of a ``sweeps`` (or ``draft``) entry: ``"<model>|<format>|L<context>|layers<n>"``,
    ``weight_format`` ``q4``/``q8`` or the dtype. A forced routing or gather gets a key of its
    own (the defaults keep the keys of earlier files, which resume as before)."""
    key = f"{model}|{weight_format}|L{context}|layers{layers}"
    if routing != "model":
        key += f"|routing={routing}"
    if gather != "mlx-lm":
        key += f"|gather={gather}"
    return key


def sweep_key_variant(key: str) -> tuple[str, str]:
    """The routing and the gather a ``sweep_key`` was made with (``"model"`` and ``"mlx-lm"``
    where it names none)."""
    head, _, gather = key.partition("|gather=")
    return head.partition("|routing=")[2] or "model", gather or "mlx-lm"


def reject_key(vocab: int, gamma: int) -> str:
    """The key of a ``reject`` entry: ``"V<vocab>|gamma<gamma>"``."""
    return f"V{vocab}|gamma{gamma}"


def prompt_set_text(prompt_set: str) -> str:
    """How a routing document names a prompt set as its token source (its ``text``, and so its key)."""
    return f"prompt set {prompt_set}"


def routing_key(model: str, text: str) -> str:
    """The key of a ``routing`` document: ``"<model>|<text>"``, ``text`` its token source."""
    return f"{model}|{text}"


def routing_document_key(document: schema.RoutingDocument) -> str:
    """The ``routing_key`` a measured routing document is stored under: its model and token source."""
    return routing_key(document["model"], document["text"])


def routing_key_model(key: str) -> str:
    """The model of a ``routing_key``."""
    return key.split("|", 1)[0]


def spec_key(target: str, draft: str, mode: str, prompt_set: str | None = None) -> str:
    """The key of a spec document: ``"<target>|<draft>|<mode>[|<prompt set>]"``, so that every
    command that measures or reads a pair's SD (spec, run, serving, the report) finds the same
    document."""
    return "|".join([target, draft, mode] + ([prompt_set] if prompt_set else []))


def spec_key_parts(key: str) -> tuple[str, str, str, str | None]:
    """A ``spec_key``'s target, drafter, mode and prompt set (None: random ids)."""
    target, draft, mode, *prompt_set = key.split("|", 3)
    return target, draft, mode, prompt_set[0] if prompt_set else None


def spec_document_key(document: schema.SpecDocument, mode: str) -> str:
    """The ``spec_key`` a measured SD document is stored under: its resolved target and drafter,
    the mode it ran in, and the prompt set it decoded (none for random ids)."""
    prompts = document["prompts"]
    return spec_key(document["target"], document["draft"], mode, prompts["name"] if prompts.get("count") else None)


def pair_key(target: str, draft: str | None) -> str:
    """The key of a ``pairs`` record (and of a launched serving document): ``"<target>|<draft>"``
    (``"<target>|None"`` for a serving document without a drafter)."""
    return f"{target}|{draft}"


def pair_spec_key(target: str, draft: str, drafter_kind: str, prompt_set: str) -> str:
    """The ``spec_key`` of a pair run's SD on one prompt set, in the mode its drafter kind runs in."""
    return spec_key(target, draft, PAIR_MODES.get(drafter_kind, "real"), prompt_set)


def serving_key(urls: list[str], target: str | None, draft: str | None) -> str:
    """The key of a ``serving`` document: ``"url:<name>,..."`` for servers the user runs (by the
    names given them), else the ``pair_key`` of the launched pair."""
    if urls:
        return "url:" + ",".join(urls)
    assert target is not None  # launching servers needs a target (serving_stage.validate)
    return pair_key(target, draft)
