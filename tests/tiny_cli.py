"""`mac-moesd` in a process of its own at the tests' sizes: the default run's plan and the quick
roofline are those of ``test_report.tiny_plan``, so a process-level test of `run` and `roofline`
takes seconds. Used as ``python tests/tiny_cli.py COMMAND ...``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_report import tiny_plan  # noqa: E402

from mac_moesd.pipeline import plans  # noqa: E402
from mac_moesd.measure.peaks import roofline  # noqa: E402

PLAN = tiny_plan()
plans.default_plan = lambda backend, quick, full=False: PLAN
roofline.QUICK = PLAN.roofline

from mac_moesd.cli import main  # noqa: E402

main()
