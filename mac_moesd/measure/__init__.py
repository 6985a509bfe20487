"""Measurements on this machine, one sub-package per thing measured.

From the bottom: ``clock`` (timers, the watchdog), ``caches`` (copies, rollback and its audit),
``decoding`` (the SD loop and its drafters) beside ``experts`` (routing capture and control),
``forward`` (the sweep of timed forward passes), and on top, independent of each other, ``sd``
(SD against plain decode), ``peaks`` (the roofline), ``server`` (a served workload) and
``cluster`` (sweeps over mlx.distributed ranks).
"""
