"""bert-ablate: DeepSpeed configs in, a comparison table and plots out (see cli.py)."""
