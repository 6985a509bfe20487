from mac_moesd.units import GiB, MiB, gib, human_bytes


def test_human_bytes_switches_to_mib_below_one_gib():
    assert human_bytes(1.5 * GiB) == "1.5 GiB"
    assert human_bytes(GiB) == "1.0 GiB"
    # 0.1 GiB would read '0.1 GiB': below 1 GiB the figure is MiB, one decimal fewer
    assert human_bytes(300 * MiB) == "300 MiB"
    assert human_bytes(1.5 * GiB, places=2) == "1.50 GiB"
    assert human_bytes(300.4 * MiB, places=2) == "300.4 MiB"


def test_gib_always_in_gib_and_unknown_is_na():
    assert gib(512 * MiB) == "0.5 GiB"
    assert gib(48 * GiB) == "48.0 GiB"
    assert gib(None) == "n/a"
