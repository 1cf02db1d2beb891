def count_vowels(text: str) -> int:
    """How many vowels (a, e, i, o, u, any case) text holds."""
    return sum(1 for ch in text if ch in "aeiou")
