"""lm-eval task configs (YAML) and their data loaders; see quantgate.eval.evaluate."""
