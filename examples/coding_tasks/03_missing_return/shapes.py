def area(width: float, height: float) -> float:
    """The area of a rectangle."""
    result = width * height
