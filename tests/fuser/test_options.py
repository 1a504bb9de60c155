import pytest
import torch

from fuser.options import ALL_PATTERNS, FuserOptionError, Options, resolve


def test_defaults_and_passthrough(monkeypatch):
    for var in ("FUSER_ENABLED", "FUSER_PATTERNS", "FUSER_AUTOTUNE", "FUSER_PLAN", "FUSER_INTERPRET", "FUSER_DEBUG_DIR",
                "FUSER_CUDA_GRAPHS"):
        monkeypatch.delenv(var, raising=False)
    opts, rest = resolve({"max_autotune": True, "fuser.autotune": True})
    assert opts.autotune and opts.enabled and opts.patterns == ALL_PATTERNS and not opts.cuda_graphs
    assert rest == {"max_autotune": True}


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(FuserOptionError, match=r"unknown fuser option 'fuser.autotun'.*fuser\.autotune"):
        resolve({"fuser.autotun": True})


@pytest.mark.parametrize("value", ["maybe", 3])
def test_bad_boolean(value):
    with pytest.raises(FuserOptionError, match="boolean"):
        resolve({"fuser.enabled": value})


def test_unknown_pattern():
    with pytest.raises(FuserOptionError, match="unknown pattern"):
        resolve({"fuser.patterns": "attention,flash"})


@pytest.mark.parametrize("value", ["mamba", "attention,mamba", ["h2o", "mamba"], {"mamba"}])
def test_planned_pattern_is_an_error_that_says_so(value, monkeypatch):
    # before a pattern exists, asking for it must not silently fuse nothing
    import fuser.patterns as package

    monkeypatch.setattr(package, "PLANNED", ("mamba",), raising=False)
    with pytest.raises(FuserOptionError, match=r"mamba is not implemented in this version of fuser yet; implemented: "
                                               r"attention, attention_kl, h2o, kda"):
        resolve({"fuser.patterns": value})


def test_one_registry():
    # the pattern list, the default option and the plan choices all come from patterns/__init__.py
    import fuser.patterns as package
    from fuser import registry

    assert ALL_PATTERNS == registry.names() == tuple(package.PATTERN_MODULES)
    assert not set(registry.planned()) & set(ALL_PATTERNS)
    for name in ALL_PATTERNS:
        pattern = registry.load(name)
        assert pattern.name == name and pattern.plan_choices
        assert registry.plan_choices()[name] == dict(pattern.plan_choices)
    assert [p.name for p in registry.enabled(reversed(ALL_PATTERNS))] == list(ALL_PATTERNS)  # matching order


def test_env_and_precedence(monkeypatch):
    monkeypatch.setenv("FUSER_AUTOTUNE", "1")
    monkeypatch.setenv("FUSER_PLAN", "attention.backward=atomic_dq, attention.impl=fuser")
    opts, _ = resolve(None)
    assert opts.autotune
    assert opts.forced("attention", "backward") == "atomic_dq"
    opts, _ = resolve({"fuser.autotune": False})
    assert not opts.autotune


def test_max_autotune_mode_turns_autotune_on(monkeypatch):
    monkeypatch.delenv("FUSER_AUTOTUNE", raising=False)
    assert resolve(None, mode="max-autotune")[0].autotune
    assert not resolve({"fuser.autotune": False}, mode="max-autotune")[0].autotune
    assert not resolve(None, mode="reduce-overhead")[0].autotune


@pytest.mark.parametrize("options,mode,want", [
    (None, None, False),
    (None, "default", False),
    (None, "reduce-overhead", True),
    (None, "max-autotune", True),
    (None, "max-autotune-no-cudagraphs", False),
    ({"triton.cudagraphs": True}, None, True),
    ({"triton.cudagraphs": False}, "reduce-overhead", False),  # options= wins over the mode, as in Inductor
])
def test_cuda_graphs_follows_inductors_setting(options, mode, want):
    opts, rest = resolve(options, mode)
    assert opts.cuda_graphs is want
    assert rest == (options or {})  # still Inductor's: passed through


def test_cuda_graphs_from_inductors_config():
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"triton.cudagraphs": True}):
        assert resolve(None)[0].cuda_graphs
        assert resolve(None, mode="max-autotune-no-cudagraphs")[0].cuda_graphs  # that mode sets no value: the config's
        assert not resolve({"triton.cudagraphs": False})[0].cuda_graphs
    assert not resolve(None)[0].cuda_graphs


@pytest.mark.parametrize("value,mode,want", [(True, None, True), ("1", None, True), (False, "reduce-overhead", False),
                                            ("auto", "reduce-overhead", True), ("AUTO", None, False)])
def test_cuda_graphs_option_overrides_inductors_setting(value, mode, want):
    assert resolve({"fuser.cuda_graphs": value}, mode)[0].cuda_graphs is want


def test_cuda_graphs_option_from_the_environment(monkeypatch):
    monkeypatch.setenv("FUSER_CUDA_GRAPHS", "1")
    assert resolve(None)[0].cuda_graphs
    monkeypatch.setenv("FUSER_CUDA_GRAPHS", "sometimes")
    with pytest.raises(FuserOptionError, match="FUSER_CUDA_GRAPHS.*True, False or 'auto'"):
        resolve(None)


def test_plan_syntax():
    with pytest.raises(FuserOptionError, match="key=value"):
        resolve({"fuser.plan": "attention.backward"})
    with pytest.raises(FuserOptionError, match="<pattern>.<choice>"):
        resolve({"fuser.plan": {"backward": "atomic_dq"}})
    assert resolve({"fuser.plan": {"attention.impl": "sdpa"}})[0].plan == (("attention.impl", "sdpa"),)


def test_interpret_option():
    assert resolve({"fuser.interpret": False})[0].interpret == "off"
    assert resolve({"fuser.interpret": "auto"})[0].interpret == "auto"
    assert Options().interpret == "auto"


def test_interpret_values_and_interpret_cpu(monkeypatch):
    monkeypatch.delenv("FUSER_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve({"fuser.interpret": True})[0].interpret == "on"
    assert resolve({"fuser.interpret": True})[0].interpret_cpu
    assert not resolve({"fuser.interpret": False})[0].interpret_cpu
    assert not resolve(None)[0].interpret_cpu  # "auto" without TRITON_INTERPRET: Inductor
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve(None)[0].interpret_cpu  # "auto" follows TRITON_INTERPRET
    assert not resolve({"fuser.interpret": False})[0].interpret_cpu
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("FUSER_INTERPRET", "1")
    assert resolve(None)[0].interpret_cpu
    with pytest.raises(FuserOptionError, match="True, False or 'auto'"):
        resolve({"fuser.interpret": "sometimes"})


@pytest.mark.parametrize("options,message", [
    ({"fuser.patterns": 3}, r"fuser.patterns takes a list of pattern names or a comma-separated string"),
    ({"fuser.patterns": [1, 2]}, r"fuser.patterns takes a list"),
    ({"fuser.plan": 3}, r"fuser.plan takes a dict or a 'key=value,key=value' string"),
    ({"fuser.debug_dir": 3}, r"fuser.debug_dir takes a directory path"),
    ({"fuser.autotune": [True]}, r"takes a boolean"),
])
def test_wrong_types_are_option_errors(options, message):
    with pytest.raises(FuserOptionError, match=message):
        resolve(options)


@pytest.mark.parametrize("plan,message", [
    ("attention.bwd=two_kernel", r"attention has no choice 'bwd'; valid keys for attention: attention.impl, attention.backward"),
    ("atention.backward=two_kernel", r"unknown pattern 'atention'.*valid keys: attention.impl, attention.backward, "
                                     r"attention_kl.impl, attention_kl.split_k, attention_kl.backward"),
    ("h2o.impl=flash", r"h2o.impl takes one of: fuser, inductor"),
    ("kda.backward=two_kernel", r"kda has no choice 'backward'; valid keys for kda: kda.impl, kda.plan"),
    ("kda.plan=parallel_scan", r"kda.plan takes one of: recurrent, chunk, parallel"),
    ("attention.backward=three_kernel", r"attention.backward takes one of: two_kernel, atomic_dq, autotune"),
    ("attention.impl=flash", r"attention.impl takes one of: fuser, sdpa, inductor"),
    ("attention_kl.impl=sdpa", r"attention_kl.impl takes one of: fuser, inductor"),
    ("attention_kl.backward=autotune", r"attention_kl.backward takes one of: two_kernel, atomic_dq"),
    ("attention_kl.split_k=0", r"takes one of: 1, auto, <positive integer>"),
    ("attention_kl.split_k=two", r"takes one of: 1, auto, <positive integer>"),
])
def test_plan_entries_are_checked_against_the_choices(plan, message):
    with pytest.raises(FuserOptionError, match=message):
        resolve({"fuser.plan": plan})


def test_valid_plan_entries():
    opts = resolve({"fuser.plan": {"attention.impl": "inductor", "attention.backward": "autotune",
                                   "attention_kl.split_k": 4, "attention_kl.backward": "atomic_dq"}})[0]
    assert opts.forced("attention_kl", "split_k") == "4" and opts.forced("attention", "impl") == "inductor"
    assert resolve({"fuser.plan": "attention_kl.split_k=auto"})[0].forced("attention_kl", "split_k") == "auto"
    assert resolve({"fuser.plan": "attention_kl.split_k=08"})[0].forced("attention_kl", "split_k") == "8"


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FUSER_PLAN", "attention.bwd=two_kernel")
    with pytest.raises(FuserOptionError, match=r"environment variable FUSER_PLAN=.*has no choice 'bwd'"):
        resolve(None)


def test_debug_dir_must_be_a_directory(tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    with pytest.raises(FuserOptionError, match="is not a directory"):
        resolve({"fuser.debug_dir": str(a_file)})
    with pytest.raises(FuserOptionError, match="which is not a directory"):
        resolve({"fuser.debug_dir": str(a_file / "sub")})
    assert resolve({"fuser.debug_dir": tmp_path / "new" / "dir"})[0].debug_dir == str(tmp_path / "new" / "dir")
    assert not (tmp_path / "new").exists()  # created on first use, not by resolving


def test_option_error_is_a_value_error_dynamo_passes_through():
    err = FuserOptionError("fuser.plan: bad")
    assert isinstance(err, ValueError)
    assert isinstance(err, torch._dynamo.exc.ShortenTraceback)
    assert err.remove_dynamo_frames() is err and str(err) == "fuser.plan: bad"
