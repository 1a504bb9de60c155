import pytest

from fuser.options import ALL_PATTERNS, FuserOptionError, Options, resolve


def test_defaults_and_passthrough(monkeypatch):
    for var in ("FUSER_ENABLED", "FUSER_PATTERNS", "FUSER_AUTOTUNE", "FUSER_PLAN", "FUSER_INTERPRET", "FUSER_DEBUG_DIR"):
        monkeypatch.delenv(var, raising=False)
    opts, rest = resolve({"max_autotune": True, "fuser.autotune": True})
    assert opts.autotune and opts.enabled and opts.patterns == ALL_PATTERNS
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
