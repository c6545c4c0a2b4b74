"""PLACEHOLDER while being written (helper C)."""
def count_flops(*a, **k): raise NotImplementedError
