"""Command-line command groups."""
