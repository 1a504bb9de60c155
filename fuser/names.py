"""Readable names for graph nodes, for reports: what the user called a value.

Dynamo names a graph's placeholders after where their values came from
(``l_self_modules_blocks_modules_0_modules_attn_buffers_causal_``) and de-duplicates other
nodes with numeric suffixes (``q_2``). Dynamo also records each placeholder's *source*, a chain
of ``torch._dynamo.source`` objects (``L['self']._modules['blocks']._modules['0']...``);
:func:`user_name` turns that chain into the dotted name a user writes (``blocks.0.attn.causal``)
and :func:`is_module_buffer` tells, from the source alone, whether a placeholder is a registered
module buffer.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch.fx as fx

# attribute dicts of nn.Module whose items are named by their key: ._modules['blocks'] -> blocks
_MODULE_DICTS = ("_modules", "_parameters", "_buffers")


def _source_of(node: fx.Node) -> Any:
    """The Dynamo source of a placeholder, wherever this torch version keeps it, or None."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        source = node.meta.get("fuser_source")
    if source is None:
        source = getattr(node, "_dynamo_source", None)
    return source


def _source_text(source: Any) -> Optional[str]:
    """The source's own text (``L['q']``): ``.name`` is a property in newer torch, a method
    in older ones."""
    name = getattr(source, "name", None)
    if callable(name):
        try:
            name = name()
        except Exception:
            return None
    return name if isinstance(name, str) and name else None


def _cls(source: Any, *names: str) -> bool:
    """Whether ``source`` is an instance of one of the ``torch._dynamo.source`` classes
    ``names`` (classes a torch version lacks are skipped)."""
    from torch._dynamo import source as sources

    classes = tuple(c for c in (getattr(sources, n, None) for n in names) if isinstance(c, type))
    return bool(classes) and isinstance(source, classes)


def _is_item(source: Any) -> bool:
    return _cls(source, "DictGetItemSource", "GetItemSource")


def _is_attr(source: Any, member: Optional[str] = None) -> bool:
    return _cls(source, "AttrSource") and (member is None or getattr(source, "member", None) == member)


def _key(index: Any) -> Optional[str]:
    if isinstance(index, (str, int)) and not isinstance(index, bool):
        return str(index)
    return None


def _dotted(source: Any) -> Optional[str]:
    """The dotted user name of a source chain, or None if the chain has a link this does not
    know (the caller then falls back to the source's text)."""
    parts: list[str] = []
    s = source
    while s is not None:
        if _is_item(s):
            key = _key(getattr(s, "index", None))
            if key is None:
                return None
            base = getattr(s, "base", None)
            if _is_attr(base) and base.member in _MODULE_DICTS:
                parts.append(key)  # ._modules['blocks'] / ._parameters['w'] / ._buffers['causal']
                s = base.base
            else:
                parts.append(f"[{key}]" if key.isdigit() else f"[{key!r}]")
                s = base
        elif _is_attr(s):
            parts.append(s.member)
            s = s.base
        elif _cls(s, "LocalSource"):
            name = getattr(s, "local_name", None)
            if not isinstance(name, str):
                return None
            if name != "self" or not parts:
                parts.append(name)
            break
        elif _cls(s, "GlobalSource"):
            name = getattr(s, "global_name", None)
            if not isinstance(name, str):
                return None
            parts.append(name)
            break
        elif _cls(s, "NNModuleSource") and getattr(s, "base", None) is not None:
            s = s.base  # a wrapper that only marks what kind of value its base is
        else:
            return None
    out = ""
    for p in reversed(parts):
        out += p if (not out or p.startswith("[")) else "." + p
    return out or None


def user_name(node: fx.Node) -> str:
    """A readable name for ``node``: what the user calls the value.

    For a Dynamo graph's placeholder, the dotted path of its source:
    ``L['self']._modules['blocks']._modules['0']._modules['attn']._buffers['causal']`` ->
    ``blocks.0.attn.causal``, ``L['q']`` -> ``q``, ``L['self']._modules['a']._parameters['w']``
    -> ``a.w``, ``L['xs'][1]`` -> ``xs[1]``; for a source chain it does not know, the source's
    own text (``L[...]...``). For any other node (or a placeholder without a source), the node's
    name without Dynamo's numeric de-duplication suffix (``q_2`` -> ``q``) unless nothing would
    be left.

    Args:
        node: a node of an FX graph.

    Returns:
        A non-empty string.
    """
    if node.op == "placeholder":
        source = _source_of(node)
        if source is not None:
            try:
                dotted = _dotted(source)
            except Exception:  # a source class of another torch version: use its text
                dotted = None
            text = dotted or _source_text(source)
            if text:
                return text
    stripped = re.sub(r"_\d+$", "", node.name)
    return stripped or node.name


def is_module_buffer(node: fx.Node) -> Optional[str]:
    """The dotted name of the module buffer a placeholder is, when its Dynamo source proves
    it (the source is an item of a module's ``_buffers``, e.g.
    ``L['self']._modules['attn']._buffers['causal']`` -> ``"attn.causal"``); else None.

    Never decided by the node's name: a parameter (``_parameters``), a plain input, a value
    computed from a buffer, or a placeholder without a source is not a buffer here.

    Args:
        node: a node of an FX graph (only placeholders can be buffers).

    Returns:
        The buffer's dotted name (as :func:`user_name` gives it), or None.
    """
    if node.op != "placeholder":
        return None
    source = _source_of(node)
    s = source
    # wrappers that only mark the kind of value (none sit on top of a buffer today)
    while s is not None and not _is_item(s) and _cls(s, "NNModuleSource") and getattr(s, "base", None) is not None:
        s = s.base
    if s is None or not _is_item(s):
        return None
    if not _is_attr(getattr(s, "base", None), "_buffers"):
        return None
    return user_name(node)
