"""primerl.runtime.registry: lookup order (built-ins, entry points, "module:Attr"), errors, double registration."""

import sys

import pytest

from primerl.runtime.config import ConfigError
from primerl.runtime.registry import Registry


def _fresh(tmp_path, monkeypatch, builtin_modules=()):
    monkeypatch.syspath_prepend(str(tmp_path))
    return Registry("widget", "things.widget", builtin_modules, "primerl_test.widgets")


def test_unknown_name_lists_registered(tmp_path, monkeypatch):
    r = _fresh(tmp_path, monkeypatch)
    r.register("alpha", object())
    r.register("beta", object())
    with pytest.raises(ConfigError) as e:
        r.get("gamma")
    assert str(e.value) == "things.widget: unknown widget 'gamma'; registered: alpha, beta"


def test_register_as_decorator_and_builtin_module_imported_on_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "widget_builtin_mod.py").write_text(
        "from primerl_registry_under_test import R\n"
        "@R.register('round')\n"
        "class Round:\n"
        "    pass\n")
    r = _fresh(tmp_path, monkeypatch, ("widget_builtin_mod",))
    monkeypatch.setitem(sys.modules, "primerl_registry_under_test", type(sys)("primerl_registry_under_test"))
    sys.modules["primerl_registry_under_test"].R = r
    monkeypatch.delitem(sys.modules, "widget_builtin_mod", raising=False)
    assert "widget_builtin_mod" not in sys.modules
    cls = r.get("round")
    assert cls.__name__ == "Round" and cls.__module__ == "widget_builtin_mod"
    assert r.names() == ["round"]


def test_module_colon_attr_is_imported_and_registered(tmp_path, monkeypatch):
    (tmp_path / "widget_plugin_mod.py").write_text("class Square:\n    sides = 4\n")
    r = _fresh(tmp_path, monkeypatch)
    monkeypatch.delitem(sys.modules, "widget_plugin_mod", raising=False)
    cls = r.get("widget_plugin_mod:Square")
    assert cls.sides == 4
    assert "widget_plugin_mod:Square" in r.names()
    assert r.get("widget_plugin_mod:Square") is cls
    with pytest.raises(ConfigError, match=r"things.widget: 'widget_plugin_mod:Circle': module 'widget_plugin_mod' "
                                          r"has no attribute 'Circle'"):
        r.get("widget_plugin_mod:Circle")
    with pytest.raises(ConfigError, match="no module named 'no_such_widget_mod'"):
        r.get("no_such_widget_mod:X")


def test_entry_point_group_from_a_dist_info_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "widget_ep_mod.py").write_text("class Star:\n    points = 5\n")
    dist = tmp_path / "widget_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: widget-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[primerl_test.widgets]\nstar = widget_ep_mod:Star\n")
    r = _fresh(tmp_path, monkeypatch)
    monkeypatch.delitem(sys.modules, "widget_ep_mod", raising=False)
    assert r.names() == ["star"]            # listed before it is loaded
    assert r.get("star").points == 5
    with pytest.raises(ConfigError, match="registered: star$"):
        r.get("moon")


def test_double_registration_refused(tmp_path, monkeypatch):
    r = _fresh(tmp_path, monkeypatch)
    a, b = object(), object()
    r.register("one", a)
    r.register("one", a)                     # the same object again: a module imported twice
    with pytest.raises(ValueError, match="'one' is registered already"):
        r.register("one", b)
    assert r.get("one") is a
