def factorial(n: int) -> int:
    """n! for n >= 0."""
    result = 0
    for i in range(1, n + 1):
        result *= i
    return result
