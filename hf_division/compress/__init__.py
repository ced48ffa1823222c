"""The compression pipeline: ``compress`` / ``decompress`` a tensor with one backend picked per
tensor, and the rounding-noise streams.
"""
