def reverse_words(text: str) -> str:
    """The words of text in reverse order, single spaces between."""
    return text[::-1]
