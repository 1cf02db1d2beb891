"""Tools and schemas the constrained-reply tests share: three tool shapes (a nested model with
a pattern, a bounded list, two integers), a response-format model and a prompt for each tool."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field


class Address(BaseModel):
    city: Annotated[str, Field(max_length=24)]
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]  # llguidance's \d is Unicode


def ship(address: Address, priority: Literal["low", "normal", "high"], weight_kg: float) -> str:
    """Ship a parcel to an address."""
    return f"shipped {weight_kg} kg to {address.city} ({priority})"


Label = Annotated[str, Field(max_length=16)]


def tag(labels: Annotated[list[Label], Field(min_length=1, max_length=3)], count: int) -> str:
    """Tag an item with labels."""
    return f"{count}: {', '.join(labels)}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class City(BaseModel):
    name: Annotated[str, Field(max_length=20)]
    country: Annotated[str, Field(max_length=20)]
    is_capital: bool


TOOL_PROMPTS = [  # one for each tool
    "Ship a 2.5 kg parcel to Paris, 75001, with high priority.",
    "Tag this photo with 'beach' and 'sunset'.",
    "What is 17 plus 25?",
]
