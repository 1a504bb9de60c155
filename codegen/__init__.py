"""Triton code generation: Jinja templates of kernels, rendering, loading and launching.

``render`` turns a template into a source file and module; ``launch`` holds the helpers every
kernel family shares; ``variants`` the causal/mask/fill vocabulary of the attention-like
families; ``predicate`` index-mask formulas; each kernel family (``attention``, ...) has one module with its config
table and the Python entry points that allocate outputs and launch its kernels.
"""
