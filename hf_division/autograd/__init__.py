"""What a training step keeps for backward: one compressed copy per saved tensor (the store, its
byte accounting) and the autograd Functions that keep and rebuild them.
"""
