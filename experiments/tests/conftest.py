"""The package tests' small-model fixture, shared rather than copied (experiments may depend on tests/,
never the reverse)."""

from tests.conftest import small_overrides  # noqa: F401 - a fixture, found by name
