"""Everything that touches files: loading, container formats, writers."""
