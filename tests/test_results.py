import json

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.results import SCHEMA, ResultsBusy, ResultsStore, load_results, write_atomic

META = {"chip_slug": "apple-m3-max-40c", "backend": "metal", "versions": {"mlx": "0.32.4"},
        "blas": {"name": "n/a"}, "time": "t0", "command": "mac-moesd sweep x"}


def test_new_store_writes_schema_and_meta(tmp_path):
    store = ResultsStore(tmp_path / "r" / "results.json", META)
    entry = store.entry("sweeps", "k", {"model": "m"})
    entry["points"]["1x1"] = {"median_s": 1.0}
    store.save()
    data = load_results(tmp_path / "r" / "results.json")
    assert data["schema"] == SCHEMA
    assert data["meta"]["chip_slug"] == "apple-m3-max-40c"
    assert data["sweeps"]["k"]["points"]["1x1"]["median_s"] == 1.0
    assert not list((tmp_path / "r").glob(".*tmp"))  # the temp file was renamed away


def test_reopen_keeps_points(tmp_path):
    path = tmp_path / "results.json"
    store = ResultsStore(path, META)
    store.entry("sweeps", "k", {})["points"]["1x1"] = {"median_s": 1.0}
    store.save()
    again = ResultsStore(path, {**META, "time": "t1"})
    assert again.entry("sweeps", "k", {})["points"] == {"1x1": {"median_s": 1.0}}
    assert again.data["meta"]["last_run"]["time"] == "t1"


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "corrupt"),
    ("[1, 2]", "not a mac-moesd results file"),
    (json.dumps({"schema": "mac-moesd/0", "meta": {}}), "schema 'mac-moesd/0'"),
])
def test_bad_files_are_reported_and_left_untouched(tmp_path, content, fragment):
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(MacMoesdError, match=fragment):
        ResultsStore(path, META)
    assert path.read_text() == content


@pytest.mark.parametrize("change", [{"chip_slug": "apple-m1-8c"}, {"backend": "cpu"},
                                    {"versions": {"mlx": "0.1"}}])
def test_results_from_another_machine_refuse_to_merge(tmp_path, change):
    path = tmp_path / "results.json"
    ResultsStore(path, META).save()
    before = path.read_text()
    with pytest.raises(MacMoesdError, match="measured elsewhere"):
        ResultsStore(path, {**META, **change})
    assert path.read_text() == before


HOLD = ("import sys; from pathlib import Path; from mac_moesd.results import WriterLock; "
        "WriterLock.take(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()")


@pytest.fixture
def held_by_another_process(tmp_path):
    """A results file whose writer's lock another process holds until the test ends."""
    import subprocess
    import sys

    path = tmp_path / "results.json"
    write_atomic(path, {"schema": SCHEMA, "meta": META})
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield path, holder.pid
    holder.stdin.close()
    holder.wait(timeout=30)


def test_a_file_another_process_is_writing_is_refused_and_left_untouched(held_by_another_process):
    path, pid = held_by_another_process
    before = path.read_text()
    with pytest.raises(ResultsBusy, match=rf"being written by another mac-moesd process \(pid {pid}: .*--out"):
        ResultsStore(path, META)
    assert path.read_text() == before


def test_cli_commands_on_a_busy_file(held_by_another_process):
    from click.testing import CliRunner

    from mac_moesd.cli import cli

    path, _ = held_by_another_process
    before = path.read_text()
    result = CliRunner().invoke(cli, ["sweep", "tiny-moe", "--batch", "1", "--tokens", "1", "--context", "8",
                                      "--out", str(path.parent)])
    assert result.exit_code != 0 and "being written by another mac-moesd process" in result.output
    assert path.read_text() == before


def test_the_lock_goes_with_the_process_that_held_it(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "results.json"
    subprocess.run([sys.executable, "-c", HOLD, str(path)], input="", text=True, check=True, capture_output=True)
    first = ResultsStore(path, META)  # free again once the holder has exited
    ResultsStore(path, META).save()  # and a process may open its own file twice
    first.save()
    del first  # the last store of the file let go: another process may take it
    subprocess.run([sys.executable, "-c", HOLD, str(path)], input="", text=True, check=True, capture_output=True)


def test_fit_on_a_busy_file_prints_its_fit_and_says_it_was_not_saved(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    from mac_moesd.cli import cli

    path = tmp_path / "results.json"
    shutil.copy(Path(__file__).parent / "data" / "results_quick_cpu.json", path)
    before = path.read_text()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = CliRunner().invoke(cli, ["fit", str(path), "--json"])
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert result.exit_code == 0, result.output
    assert "the fit was not saved" in result.output and '"chosen"' in result.output
    assert path.read_text() == before
