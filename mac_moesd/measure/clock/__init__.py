"""Timers, their statistics, and the watchdog that stops a hung measurement."""
