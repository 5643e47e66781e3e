"""Downstream benchmarks through lm-evaluation-harness (an optional extra): our `LM` (`harness.py`), the
offline standard tasks (`tasks.py`), multiple-choice scoring with state reuse (`state_reuse.py`) and the
in-training evaluator (`in_loop.py`). Importing this package imports nothing heavy."""
