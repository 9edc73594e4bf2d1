"""Shared-memory regions that clients register (system and CUDA)."""
