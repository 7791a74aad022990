"""Embedding tables on the parameter servers."""
