"""torpor.environment: the one table of the variables the Python package reads. Oracles: the
package's source text (no other module touches os.environ) and the parsing rules options.cpp
documents for its kill switches (set to anything but 0, false, no, off, in any case)."""

import ast
import pathlib

import pytest

from conftest import REPO
import torpor
from torpor import environment

PACKAGE = REPO / "python" / "torpor"


def _environment_reads(path: pathlib.Path) -> list[str]:
    """`os.environ` / `os.getenv` / `os.putenv` uses in one module, as 'line: text'."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_only_the_environment_module_reads_the_environment():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 10, modules
    readers = {str(p.relative_to(PACKAGE)): _environment_reads(p) for p in modules}
    assert readers.pop("environment.py"), "the table module reads the environment"
    assert {m: r for m, r in readers.items() if r} == {}


def test_every_name_a_module_asks_for_is_in_the_table():
    names = {v.name for v in environment.VARIABLES}
    asked = set()
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "environment"
                and node.func.attr in ("text", "is_set", "enabled", "variable", "prepended_path")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                asked.add(node.args[0].value)
    assert asked and asked <= names, asked - names
    with pytest.raises(KeyError):
        environment.text("TORPOR_NOT_A_VARIABLE")


@pytest.mark.parametrize(
    "value, on",
    [(None, False), ("", False), ("0", False), ("False", False), (" no ", False), ("OFF", False)]
    + [("1", True), ("yes", True), ("true", True), ("anything", True)],
)
def test_a_flag_parses_as_the_c_options_kill_switches(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TORPOR_VLLM", raising=False)
    else:
        monkeypatch.setenv("TORPOR_VLLM", value)
    assert environment.enabled("TORPOR_VLLM") is on


def test_exact_rows_alloc_conf_and_path_lists(monkeypatch):
    # torch_memory_saver's get_bool_env_var (csrc/utils.h at 4a43c97): five texts on, five off,
    # anything else an error (it exits the process)
    for on in ("1", "true", "TRUE", "yes", "YES"):
        monkeypatch.setenv("TMS_INIT_ENABLE", on)
        assert environment.enabled("TMS_INIT_ENABLE"), on
    for off in ("0", "false", "FALSE", "no", "NO", ""):
        monkeypatch.setenv("TMS_INIT_ENABLE", off)
        assert not environment.enabled("TMS_INIT_ENABLE"), off
    monkeypatch.setenv("TMS_INIT_ENABLE", "True")
    with pytest.raises(torpor.InvalidArgument, match="TMS_INIT_ENABLE='True' is neither on"):
        environment.enabled("TMS_INIT_ENABLE")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64, expandable_segments : True")
    assert environment.alloc_conf_true("expandable_segments")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert not environment.alloc_conf_true("expandable_segments")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with environment.prepended_path("PYTHONPATH", "/shim"):
        assert environment.text("PYTHONPATH") == "/shim"
    assert not environment.is_set("PYTHONPATH"), "an unset variable comes back unset"
    monkeypatch.setenv("PYTHONPATH", "/a")
    with environment.prepended_path("PYTHONPATH", "/shim"):
        assert environment.text("PYTHONPATH").split(":") == ["/shim", "/a"]
    assert environment.text("PYTHONPATH") == "/a"
