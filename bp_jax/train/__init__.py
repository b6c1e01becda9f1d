"""Training: the generic loop (`loop.train`), optimiser, checkpoints, and the stages of train.py.

Kept import-light: the stage registry (`stages.STAGES`) imports each stage's module on first use.
"""
