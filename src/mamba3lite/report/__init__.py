"""Reading a run's record (metrics.jsonl) and drawing it."""
