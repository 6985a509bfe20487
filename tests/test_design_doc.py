"""docs/design.md §7 against the record types of results/schema.py: every key a record declares is
named there, so the prose a user reads and the schema a writer is held to cannot drift apart."""

import re
import typing
from pathlib import Path

from mac_moesd.results import schema

DESIGN = Path(__file__).parent.parent / "docs" / "design.md"


def section_7() -> str:
    text = DESIGN.read_text()
    start = text.index("## §7 The results file")
    return text[start:text.index("\n## §8", start)]


def declared_keys(record, seen=None) -> dict[str, set[str]]:
    """Every key of every record reachable from ``record``, by record name."""
    seen = {} if seen is None else seen
    for inner in typing.get_args(record):
        declared_keys(inner, seen)
    if typing.is_typeddict(record) and record.__name__ not in seen:
        hints = typing.get_type_hints(record)
        seen[record.__name__] = set(hints)
        for hint in hints.values():
            declared_keys(hint, seen)
    return seen


def undocumented(record, prose: str) -> dict[str, list[str]]:
    """The keys of the records reachable from ``record`` that ``prose`` never names in backticks."""
    named = set(re.findall(r"`([^`]+)`", prose))
    words = named | {w for name in named for w in re.findall(r"[A-Za-z_][A-Za-z0-9_-]*", name)}
    return {name: sorted(keys - words) for name, keys in declared_keys(record).items() if keys - words}


def test_every_declared_key_is_named_in_section_7():
    assert undocumented(schema.ResultsFile, section_7()) == {}


def test_a_key_missing_from_the_prose_is_found():
    class Probe(typing.TypedDict, total=False):
        window_s: int  # named in §7
        a_key_nobody_wrote_up: int

    assert undocumented(Probe, section_7()) == {"Probe": ["a_key_nobody_wrote_up"]}
