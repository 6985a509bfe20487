"""Measurements on this machine: timer, roofline, T_T(B,t) sweeps, routing, speculative decoding."""
