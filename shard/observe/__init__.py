"""Watching a run: metrics.jsonl, TensorBoard, pictures, profiles."""
