"""Parallelism for multi-rank serving: strategy grammar and the offline strategy analyzer."""
