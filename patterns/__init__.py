"""Patterns fuser recognises, one module each.

Each module defines a :class:`fuser.pattern.Pattern` subclass instance named ``PATTERN``:
how the computation is spelled in graphs (its rules), when fusing it is exact (its checks),
the plans it offers the planner, and a float64 reference implementation.
"""

#: The implemented patterns, name -> module, in matching order: a region an earlier pattern
#: takes is not offered to later ones. Adding a pattern adds its line here (and its files).
PATTERN_MODULES = {
    "attention": "fuser.patterns.attention",
    "attention_kl": "fuser.patterns.attention_kl",
    "h2o": "fuser.patterns.h2o",
    "kda": "fuser.patterns.kda",
}

#: Patterns announced but not implemented yet: naming one in ``fuser.patterns`` or
#: ``fuser.plan`` is an error that says so.
PLANNED = ()
