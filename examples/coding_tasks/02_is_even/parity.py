def is_even(n: int) -> bool:
    """Whether n is even."""
    return n % 2 == 1
