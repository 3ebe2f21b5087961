"""Views (placeholder docstring, written at the end)."""
