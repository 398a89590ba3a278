"""Pruning techniques that shrink layers, and the prune → check → recover flow they share."""
