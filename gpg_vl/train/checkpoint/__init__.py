"""A run's folder and its checkpoints: what a checkpoint folder holds and where the newest intact one is
(folder.py), writing one atomically (save.py), continuing a run from one (resume.py), and the output folder that
one run holds (outdir.py). The modules import folder.py alone of each other: no circle."""
