"""Run plans: validate first, then write atomically, with progress."""
