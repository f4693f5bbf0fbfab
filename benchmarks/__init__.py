"""Side-by-side measurements (ratios measured in one run, never timed assertions in tests)."""
