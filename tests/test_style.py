"""Code reads as docs/architecture.md and the style guide ask: a docstring says what and why in at most
15 lines and points to docs/ for the rest (the rules read from DeepSpeed's and PyTorch's source, the
measurements). Click commands are exempt: their docstrings are the `--help` users read."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 15


def is_click_command(node):
    for deco in getattr(node, "decorator_list", []):
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
            return True
    return False


def long_docstrings(root=ROOT / "zerocalc"):
    """`path:name (lines)` for each docstring spanning more than MAX_LINES source lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in nodes:
            if ast.get_docstring(node) is None or is_click_command(node):
                continue
            expr = node.body[0]
            lines = expr.end_lineno - expr.lineno + 1
            if lines > MAX_LINES:
                found[f"{path.relative_to(ROOT).as_posix()}:{getattr(node, 'name', '<module>')}"] = lines
    return found


def test_no_docstring_runs_over_15_lines():
    found = long_docstrings()
    assert not found, "shorten these docstrings (move the detail to docs/): " + ", ".join(
        f"{k} ({v} lines)" for k, v in sorted(found.items()))


def test_click_commands_are_what_is_exempt():
    # estimate and plan keep their long --help text; the check must see them as commands
    tree = ast.parse((ROOT / "zerocalc" / "cli.py").read_text(encoding="utf-8"))
    commands = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and is_click_command(n)}
    assert {"estimate_cmd", "plan_cmd"} <= commands
