"""The primitives that wire the autograd Functions into module instances, and division's entries in
Transformers' attention interface; ``model_patches`` builds its families from them.
"""
