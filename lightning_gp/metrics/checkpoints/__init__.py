"""Shipped weights of the semantic leak test's classifier (a package so that importlib.resources finds them)."""
