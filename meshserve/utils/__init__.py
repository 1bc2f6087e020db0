"""Helpers every process uses that depend on nothing else of meshserve (process launching, cluster auth)."""
