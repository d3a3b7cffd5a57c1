"""The pydantic models the structured-output scripts ask for (instructor, pydantic-ai):
a flat one, and a nested one with a list (whose schema has ``$defs``). Needs pydantic,
which every client that takes a model brings."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["People", "Person", "Weather"]


class Weather(BaseModel):
    """A weather report."""

    city: str = Field(description="the city")
    temperature_c: int = Field(description="the temperature in degrees Celsius")


class Person(BaseModel):
    name: str
    age: int


class People(BaseModel):
    """Everyone the text names."""

    people: list[Person]
