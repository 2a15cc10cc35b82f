"""ddp_lib.notebook keeps nbdistributed 0.1.0's magic names and arguments (no kernel needed)."""

from importlib.metadata import version

from nbdistributed.magic import DistributedMagic as Vanilla

from ddp_lib.notebook.magics import DistributedMagics


def _options(func) -> dict[str, object]:
    return {s: a.default for a in func.parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def test_pinned_nbdistributed_version():
    assert version("nbdistributed") == "0.1.0"


def test_magic_names_match_nbdistributed():
    ours, theirs = DistributedMagics.magics, Vanilla.magics
    wanted_line = {"dist_init", "sync", "dist_status", "dist_mode", "dist_shutdown", "dist_reset"}
    assert wanted_line <= theirs["line"].keys() and wanted_line <= ours["line"].keys()
    assert {"distributed", "rank"} <= theirs["cell"].keys() and {"distributed", "rank"} <= ours["cell"].keys()


def test_arguments_are_a_superset_of_nbdistributed():
    for name in ("dist_init", "dist_mode", "dist_reset"):
        theirs, ours = _options(getattr(Vanilla, name)), _options(getattr(DistributedMagics, name))
        assert theirs.keys() <= ours.keys(), name
    assert _options(DistributedMagics.dist_init)["-n"] == _options(Vanilla.dist_init)["-n"] == 2
    assert {"--timeout", "--master-port"} <= _options(DistributedMagics.dist_init).keys()


def test_rank_spec_parsing():
    p = DistributedMagics._parse_ranks
    assert p("0", 4) == [0] and p("0,2", 4) == [0, 2] and p("1-3", 4) == [1, 2, 3] and p(" 3, 0 ", 4) == [0, 3]
