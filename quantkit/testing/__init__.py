"""Fixtures for tests and benchmarks: tiny seeded models and packed weights. The package itself never imports
this (tests/test_architecture_imports.py checks); it ships so that bench/ scripts and users' own tests can."""
