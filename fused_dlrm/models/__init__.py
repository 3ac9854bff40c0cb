"""Models built around the project's sharded modules."""
