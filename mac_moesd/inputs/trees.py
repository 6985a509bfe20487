"""MLX's ``tree_flatten`` as the list of (path, leaf) it returns without a ``destination``: mlx
annotates it as a list or a dict, so typed callers take it from here."""

from __future__ import annotations

from typing import Any, Callable

from mlx.utils import tree_flatten

__all__ = ["flatten"]


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """(path, leaf) pairs of ``tree``, as ``tree_flatten`` gives them."""
    flat = tree_flatten(tree, is_leaf=is_leaf)
    assert isinstance(flat, list)  # a dict only where a destination is given
    return flat
