"""What division does to a model, measured: exact bytes held for backward, gradient fidelity, bits
per module for a budget (auto-precision, budget mode).
"""
