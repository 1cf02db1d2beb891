def greet(name: str = "") -> str:
    """A greeting; without a name, for the world."""
    return f"Hello, {name}!"
