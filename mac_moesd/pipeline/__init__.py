"""The orchestration layer: plans as data, the stages of each run, one runner for them all.

- ``plans``: what a run measures (``Plan`` for the zoo's models, ``PairPlan`` for a user's pair).
- ``runner``: the one stage runner (isolation, memory, progress, thermal pressure, resume).
- ``stages`` / ``pair_stages``: the stages of `run` and of `run --target/--draft`, as lists.
- ``estimate`` / ``estimate_cluster``: the same stages' memory and duration for `run --dry-run`
  (``--ranks``: sharded over several machines), nothing allocated.
- ``commands``: what each command of the command line calls; ``cli.py`` parses and prints.
"""
