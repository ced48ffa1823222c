"""The math of DIVISION and ActNN: pure tensor functions (no autograd, no policy, no execution
plan) and the format of a compressed tensor.

Everything here runs on any device and is the reference the kernels are tested against.
"""
