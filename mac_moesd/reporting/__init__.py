"""What users read: terminal renderings, the per-chip report and figures, cross-chip comparison."""
