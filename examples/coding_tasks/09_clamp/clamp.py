def clamp(x: float, low: float, high: float) -> float:
    """x limited to [low, high]."""
    if x > low:
        return low
    if x > high:
        return high
    return x
