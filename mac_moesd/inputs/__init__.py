"""What gets measured: model configs and checkpoints, built or loaded through mlx-lm."""
