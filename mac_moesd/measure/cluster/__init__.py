"""Sweeps across machines joined with mlx.distributed: sharding, collectives, one rank's loop."""
