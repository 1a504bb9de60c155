"""Differential soundness fuzzing of the fuser backend (issue 8, "Never wrong").

- :mod:`.grammar` samples random attention / attention-KL programs (:class:`~.grammar.Spec`)
  and renders them to readable Python source;
- :mod:`.runner` compiles a rendered program with ``backend="fuser"`` and compares it with
  eager PyTorch (float64 oracle, own-dtype eager, gradients, NaN positions, side effects,
  exceptions, recompile counts against Inductor);
- :mod:`.minimise` shrinks a failing program feature by feature;
- :mod:`.fuzz` is the command line (``python -m tests.soundness.fuzz --count N --seed S``);
- ``test_fuzz.py`` is the fixed-seed budget run in CI, plus self-tests of the harness.
"""
