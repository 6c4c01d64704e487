"""edge-agent --help groups its flags by concern: every setting in exactly one group."""

import argparse
from collections import Counter

from edge.config import EdgeSettings
from shared.cli import add_settings_flags


def test_every_edge_setting_is_in_one_help_group() -> None:
    grouped = Counter(name for names in EdgeSettings.help_groups.values() for name in names)
    assert set(grouped) == set(EdgeSettings.model_fields)
    assert max(grouped.values()) == 1


def test_help_lists_each_flag_under_its_group() -> None:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, EdgeSettings)
    titles = {group.title: [a.dest for a in group._group_actions] for group in parser._action_groups}
    for title, names in EdgeSettings.help_groups.items():
        assert titles[title] == list(names) or set(titles[title]) == set(names)
