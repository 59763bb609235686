"""Solvers turn a float weight (and, for some, statistics of its inputs) into a QWeight. Pure tensor maths, no I/O."""
