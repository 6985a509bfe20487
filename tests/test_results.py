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
                                    {"versions": {"mlx": "0.1"}}, {"blas": {"name": "openblas"}},
                                    {"blas": {"name": "n/a", "threads": 1}},
                                    {"cluster": {"ranks": 2, "backend": "ring", "parallel": "tensor"}}])
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
    assert result.exit_code == 1 and "being written by another mac-moesd process" in result.stderr
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


@pytest.mark.slow  # several whole fits, or a fit in another process: seconds each
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


@pytest.fixture
def earlier(tmp_path):
    """A results file written before, and its bytes."""
    path = tmp_path / "results.json"
    store = ResultsStore(path, META)
    store.put("sweeps", "k", {"points": {"1x1": {"median_s": 1.0}}})
    del store
    return path, path.read_bytes()


def _no_temp_left(path):
    return not list(path.parent.glob(f".{path.name}.*.tmp"))


@pytest.mark.parametrize("where, err, said", [
    ("fsync", OSError(28, "No space left on device"), "No space left on device"),  # the disk filled
    ("mkstemp", PermissionError(13, "Permission denied"), "Permission denied"),  # a read-only folder
])
def test_a_write_that_fails_leaves_the_earlier_file_as_it_was(earlier, monkeypatch, where, err, said):
    import os
    import tempfile

    path, before = earlier
    store = ResultsStore(path, META)
    store.section("sweeps")["k"]["points"]["2x1"] = {"median_s": 2.0}

    def fail(*args, **kwargs):
        raise err

    monkeypatch.setattr(os if where == "fsync" else tempfile, where, fail)
    with pytest.raises(MacMoesdError, match=f"cannot write .*results.json: {said}; an earlier file there is unchanged"):
        store.save()
    assert path.read_bytes() == before and _no_temp_left(path)


FILL_UP = """
import json, resource, signal, sys
from mac_moesd.errors import MacMoesdError
from mac_moesd.results import ResultsStore
path, meta, limit = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
store = ResultsStore(path, meta)
store.section("sweeps")["k"]["points"].update({f"{b}x1": {"median_s": 1.0} for b in range(2, 2000)})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write itself fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    store.save()
except MacMoesdError as err:
    print(err)
"""


def test_a_write_the_kernel_refuses_midway_leaves_the_earlier_file(earlier):
    import json
    import subprocess
    import sys

    # The kernel stops the new file at a size limit (RLIMIT_FSIZE), partly written, as a disk
    # that fills during the write does: no function of ours is replaced.
    path, before = earlier
    out = subprocess.run([sys.executable, "-c", FILL_UP, str(path), json.dumps(META), str(4096)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cannot write" in out.stdout and "File too large; an earlier file there is unchanged" in out.stdout
    assert path.read_bytes() == before and _no_temp_left(path)


def test_an_interrupted_write_leaves_the_earlier_file_and_goes_up(earlier, monkeypatch):
    import os

    path, before = earlier
    store = ResultsStore(path, META)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.save()
    assert path.read_bytes() == before and _no_temp_left(path)


def test_a_folder_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch):
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(MacMoesdError, match="cannot write results to .*: Permission denied"):
        ResultsStore(tmp_path / "out" / "results.json", META)


def test_a_lock_file_that_cannot_be_opened_is_one_line(earlier, monkeypatch):
    import os

    path, before = earlier
    opened = os.open

    def refuse_the_lock(name, *args, **kwargs):
        if str(name).endswith(".lock"):
            raise PermissionError(13, "Permission denied")
        return opened(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_the_lock)
    with pytest.raises(MacMoesdError, match="cannot write beside .*results.json: Permission denied"):
        ResultsStore(path, META)
    assert path.read_bytes() == before


def test_a_filesystem_without_locks_is_written_unlocked(earlier, monkeypatch):
    import errno
    import fcntl

    from mac_moesd.results import WriterLock

    path, _ = earlier

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    store = ResultsStore(path, META)
    store.put("sweeps", "k2", {"points": {}})
    assert WriterLock._held[path.resolve()][0] == -1  # no descriptor held
    store.close()
    assert path.resolve() not in WriterLock._held
    assert "k2" in load_results(path)["sweeps"]


def test_a_name_is_claimed_by_one_model_and_another_of_that_name_refused(tmp_path):
    store = ResultsStore(tmp_path / "r.json", META)
    random_weights = {"config_sha256": "0123456789abcdef", "weights": "random"}
    store.claim("my-moe", random_weights)
    store.claim("my-moe", dict(random_weights))  # the same model again
    with pytest.raises(MacMoesdError, match=r"another model named my-moe \(random weights, where this "
                                            r"one's are stored\).*--out"):
        store.claim("my-moe", {**random_weights, "weights": "stored"})
    with pytest.raises(MacMoesdError, match=r"another model named my-moe \(another config\)"):
        store.claim("my-moe", {**random_weights, "config_sha256": "fedcba9876543210"})
    assert store.data["models"] == {"my-moe": random_weights}
