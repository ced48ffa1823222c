"""Division in the training loops people use: Transformers' Trainer (and any subclass), TRL,
Accelerate, ``hf-division run`` for unmodified scripts, and the command line.
"""
