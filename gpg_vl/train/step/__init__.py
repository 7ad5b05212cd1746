"""A step's parts: its sampling stage (sample.py) and the pipeline that runs it (pipeline.py), the update
(update.py: micro-batches, optimizer steps; micro_batch.py, loss_call.py, reference.py) and what a process without
data feeds a collective (placeholder.py)."""
