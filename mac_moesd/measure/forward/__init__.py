"""Forward passes of MoE and dense models timed across batch sizes and token counts."""
