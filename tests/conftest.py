import json
from pathlib import Path

import pytest

from mac_moesd.measure.clock import timing

# The smallest budget the timer accepts: enough to exercise every code path in seconds (decode
# chains of 8, not 32: the suite checks what is recorded, not how long a chain should be).
TINY_BUDGET = timing.Budget(warmup=0, min_repeats=3, max_repeats=3, seconds_per_point=0.01, per_visit=1,
                            decode_chain=8)


@pytest.fixture
def config_dir(tmp_path):
    """Write a config dict as <tmp>/<name>/config.json and return the folder."""

    def write(config: dict, name: str = "model"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return write


TINY_PAIR = Path(__file__).parent / "data" / "tiny-pair"


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[str, str]:
    """The committed trained pair (``tools/train_tiny_pair.py``): folders of a mixtral MoE target
    (16 experts, top-2) and a llama drafter in mlx-lm's format, sharing one BPE tokenizer with a
    chat template. Returns (target folder, drafter folder) as strings, as a CLI takes them."""
    return str(TINY_PAIR / "target"), str(TINY_PAIR / "draft")


@pytest.fixture(autouse=True)
def results_written_hold_their_declared_types(request):
    """After every test, each results file it wrote under its ``tmp_path`` passes the check a
    later command's load makes (``results.validate``): a writer whose output the schema declares
    otherwise would make the suite refuse its own file on the next command. And every key it
    holds is declared by a record of ``results.schema``: a key a writer newly adds fails here
    until the schema says what it is. Tests that write invalid files on purpose carry
    ``invalid_results``."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None or request.node.get_closest_marker("invalid_results"):
        return
    from mac_moesd.results import schema, validate

    for path in Path(tmp).rglob("results.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("schema") in schema.READS:
            problem = validate.first_problem(schema.upgrade(data))
            assert problem is None, f"{path} as written fails its load-time check: {problem}"
            undeclared = validate.undeclared_keys(schema.upgrade(data))
            assert not undeclared, f"{path} holds keys results.schema does not declare: {undeclared[:5]}"
