"""What a run reports, fed by numbers: telemetry, metrics rows, progress, MFU.

What a run reports, fed by numbers: per-step telemetry gathered from the ranks, metrics rows
and their writers (JSONL, CSV, TensorBoard, W&B), the progress line, FLOPs and MFU.
"""
