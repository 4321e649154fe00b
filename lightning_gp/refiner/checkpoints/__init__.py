"""Shipped checkpoints of Refiner's evaluation network (a package so that importlib.resources finds them)."""
