"""Evaluation on held-out rows: batched decoding and the task's metrics (evaluate.py), the evaluations before,
during and after training (held_out.py), and mean@k, pass@k, maj@k (at_k.py)."""
