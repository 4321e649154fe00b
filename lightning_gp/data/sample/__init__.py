"""Data files of the built-in Fashion-MNIST sample (a package so that importlib.resources finds them)."""
