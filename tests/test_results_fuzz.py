"""Results files damaged every way a reader can meet one (cut short, a key deleted, a value of
another type, a null, a non-finite number, a huge file) through `report`, `compare` and `fit`:
never a traceback, always exit 0 or a one-line error, and a file that was refused left as it was."""

import copy
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from mac_moesd.cli import cli

RECORDED = Path(__file__).parent.parent / "reports" / "example-linux-cpu-amd-epyc" / "results.json"
REPLACEMENTS = {"a string": "x", "a list": [], "an object": {}, "-1": -1, "0": 0, "null": None, "1e308": 1e308}

pytestmark = [pytest.mark.slow, pytest.mark.invalid_results]


def _paths(value, prefix=()):
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield prefix + (key,)
        yield from _paths(item, prefix + (key,))


def damaged(base: dict, rng: random.Random) -> tuple[str, list]:
    """``base`` with one to three values deleted or replaced, as JSON text, and what was done."""
    doc = copy.deepcopy(base)
    done = []
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(list(_paths(doc)))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        how = rng.choice(["delete", *REPLACEMENTS])
        if how == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = REPLACEMENTS[how]
        done.append((path, how))
    return json.dumps(doc), done


def _files(base: dict, text: str) -> list[tuple[str, str]]:
    rng = random.Random(0)
    cut = [(f"cut at {n}", text[:n]) for n in (0, 1, len(text) // 3, len(text) - 1)]
    fuzzed = [(str(done), damaged_text) for damaged_text, done in (damaged(base, rng) for _ in range(40))]
    nan = text.replace('"ridge_flop_per_byte": ', '"ridge_flop_per_byte": NaN, "was": ', 1)
    huge = json.dumps(dict(base, padding="x" * (64 << 20)))  # 64 MiB of a key nobody reads
    return cut + fuzzed + [("NaN", nan), ("Infinity", nan.replace("NaN", "Infinity", 1)), ("huge", huge)]


def test_damaged_results_files_never_end_in_a_traceback(tmp_path):
    text = RECORDED.read_text()
    base = json.loads(text)
    for index, (what, content) in enumerate(_files(base, text)):
        folder = tmp_path / str(index)
        folder.mkdir()
        path = folder / "results.json"
        path.write_text(content)
        for command in (["report", folder], ["compare", folder, "--out", folder / "compare"], ["fit", folder]):
            result = CliRunner().invoke(cli, [str(a) for a in command])
            case = f"{command[0]} on {what}: {result.stderr}"
            assert result.exception is None or isinstance(result.exception, SystemExit), (case, result.exc_info)
            assert result.exit_code in (0, 1), case
            if result.exit_code:
                errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
                assert len(errors) == 1 and "left untouched" in errors[0], case
                assert path.read_text() == content, case  # refused: never rewritten
            elif command[0] != "fit":  # fit writes its fit back into a file it could read
                assert path.read_text() == content, case
