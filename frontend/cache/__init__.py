"""The response cache and the submit path that uses it."""
