"""Patterns fuser recognises, one module each.

Each module defines a :class:`fuser.pattern.Pattern` subclass instance named ``PATTERN``:
how the computation is spelled in graphs (its rules), when fusing it is exact (its checks),
the plans it offers the planner, and a float64 reference implementation.
"""
