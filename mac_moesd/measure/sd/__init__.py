"""Speculative decoding measured against plain decode, its round's parts, and its audit."""
