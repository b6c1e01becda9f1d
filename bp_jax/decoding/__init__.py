"""Decoding: sampling, the jitted loops, buckets, compiled programs, the engine."""
