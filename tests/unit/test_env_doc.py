"""docs/env.md against fasthorovod.config.Config: every FASTHOROVOD_* variable Config reads has a row
with Config's default (a former name, config.ALIASES, is named in its variable's row instead), the
table has no row for a variable Config does not read, and every Horovod variable Config falls back
to is named there."""
import dataclasses
import pathlib
import re

import pytest

from fasthorovod.config import ALIASES, PREFIX, Config

ENV_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "env.md"


class _Recorder(dict):
    """An empty environment that records every variable asked for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return default

    def __getitem__(self, key):
        self.asked.add(key)
        raise KeyError(key)

    def __contains__(self, key):
        self.asked.add(key)
        return False


def _variables_config_reads():
    env = _Recorder()
    Config.from_env(env)
    return env.asked


def _table_rows(cell=2):
    """{variable: a cell (2: default, 3: meaning)} of env.md's table (the first column's variable,
    *wire* marks aside)."""
    rows = {}
    for line in ENV_MD.read_text().splitlines():
        match = re.match(r"\|\s*`(FASTHOROVOD_[A-Z0-9_]+)`[^|]*\|([^|]*)\|([^|]*)\|", line)
        if match:
            assert match.group(1) not in rows, f"docs/env.md has two rows for {match.group(1)}"
            rows[match.group(1)] = match.group(cell).strip()
    return rows


def _documented_default(cell):
    """The default a row gives: the first `value` in its cell, or None for 'unset...'."""
    if cell.startswith("unset"):
        return None
    match = re.match(r"`([^`]*)`", cell)
    assert match, f"default cell {cell!r} starts neither with `VALUE` nor with 'unset'"
    return match.group(1)


def _spelled(value):
    """A default as the environment spells it (a flag: 1 or 0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_the_recorder_sees_what_config_reads():
    read = _variables_config_reads()
    assert {PREFIX + "NUM_LANES", PREFIX + "NUM_PROXIES", PREFIX + "IFACE",
            "HOROVOD_STALL_CHECK_TIME_SECONDS"} <= read


def test_env_md_documents_exactly_the_variables_config_reads():
    former = set(ALIASES.values())
    read = {name for name in _variables_config_reads() if name.startswith(PREFIX) and name not in former}
    documented = set(_table_rows())
    assert read - documented == set(), "read by Config but not in docs/env.md"
    assert documented - read == set(), "in docs/env.md but not read by Config"


def test_every_variable_is_a_field_of_config():
    fields = {field.name for field in dataclasses.fields(Config)}
    for name in _table_rows():
        assert name[len(PREFIX):].lower() in fields, f"{name} names no field of Config"


@pytest.mark.parametrize("name, former", sorted(ALIASES.items()))
def test_a_former_name_is_named_in_its_variables_row(name, former):
    assert former in _variables_config_reads()
    assert f"`{former}`" in _table_rows(cell=3)[name], f"docs/env.md's {name} row does not name {former}"


@pytest.mark.parametrize("name", sorted(_table_rows()))
def test_env_md_gives_configs_default(name):
    field = next(f for f in dataclasses.fields(Config) if f.name == name[len(PREFIX):].lower())
    documented = _documented_default(_table_rows()[name])
    expected = None if field.default is None else _spelled(field.default)
    assert documented == expected, f"docs/env.md gives {name} the default {documented!r}, Config {expected!r}"


def test_horovods_variables_config_falls_back_to_are_documented():
    text = ENV_MD.read_text()
    for name in sorted(v for v in _variables_config_reads() if not v.startswith(PREFIX)):
        assert f"`{name}" in text, f"Config reads {name}; docs/env.md does not say so"


def test_horovods_gloo_timeout_is_not_read_and_env_md_says_so():
    """FASTHOROVOD_TIMEOUT_SECONDS defaults to the same 30 s as HOROVOD_GLOO_TIMEOUT_SECONDS but does
    not follow it (jobs raise Gloo's timeout for long broadcasts; the proxies' bound stays short)."""
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" not in _variables_config_reads()
    assert Config.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "600"}).timeout_seconds == 30.0
    row = next(line for line in ENV_MD.read_text().splitlines() if line.startswith("| `FASTHOROVOD_TIMEOUT_SECONDS`"))
    assert "`HOROVOD_GLOO_TIMEOUT_SECONDS` is not read" in row
