def subtract(a: int, b: int) -> int:
    """a minus b."""
    return a + b
