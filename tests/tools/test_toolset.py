"""Toolset.of reads task.tools and task.environment as TRL's contract has them, and names the key of what it refuses."""

import pytest

from gspo_lab.tools import Toolset


def test_a_string_is_one_tool_not_a_list_of_characters():
    """task.tools=mod.fn given as a string: before, its characters were read as import paths ("cannot import 't'")."""
    toolset = Toolset.of("tests.tools.trl_style.multiply", None)
    assert toolset.names == ["multiply"]


def test_a_tool_without_a_schema_is_refused_naming_its_key():
    with pytest.raises(ValueError, match=r"^task.tools.1: tool 'undocumented' has no JSON schema"):
        Toolset.of(["tests.tools.trl_style.multiply", "tests.tools.trl_style.undocumented"], None)


def test_a_static_method_tool_keeps_its_first_parameter():
    """Bound as a method, a static method lost its first parameter from the schema's `required`."""
    (schema,) = Toolset.of(None, "tests.tools.trl_style.StaticTools").schemas()
    assert schema["function"]["parameters"]["required"] == ["word", "limit"]
