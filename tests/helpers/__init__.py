"""Code only tests use: reference builders and test-side APIs (not part of the package)."""
