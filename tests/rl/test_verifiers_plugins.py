"""``env.args.plugin_paths`` adds the user's folders in front of primerl's ``vf_plugins`` (which holds
the ``primerl-inprocess`` harness) instead of replacing it. No verifiers needed."""

import pytest

from primerl.rl.envs.verifiers_env import PLUGIN_DIR, plugin_dirs


def test_user_folders_come_first_and_the_default_stays(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert plugin_dirs(None) == [str(PLUGIN_DIR)]
    assert plugin_dirs([]) == [str(PLUGIN_DIR)]
    assert plugin_dirs([str(a), str(b)]) == [str(a), str(b), str(PLUGIN_DIR)]
    # listing the default folder too (as older configs did) keeps one copy, in the user's order
    assert plugin_dirs([str(PLUGIN_DIR), str(a), str(a)]) == [str(PLUGIN_DIR), str(a)]
    assert (PLUGIN_DIR / "primerl_inprocess.py").exists()  # the harness a user folder must not hide


@pytest.mark.parametrize("bad, needle", [("/nonexistent/plugins", "must be a list"),
                                         (["/nonexistent/plugins"], "is not a folder"),
                                         ([3], "must be a list")])
def test_bad_plugin_paths_name_the_key(bad, needle):
    with pytest.raises(ValueError, match=f"env.args.plugin_paths.*{needle}"):
        plugin_dirs(bad)
