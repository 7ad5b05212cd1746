"""The code's shape: no function in gpg_vl/ over 80 lines or over 10 parameters (self / cls not counted), no module
over 600 lines (one that grows past it is split along its concerns), the family protocol (models/family.py) at most
500, `train` at most 40 lines, and no engine name in the trainer's stages (engines own their settings and checks)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpg_vl"
MAX_LINES, MAX_PARAMETERS, MAX_TRAIN_LINES = 80, 10, 40
MAX_MODULE_LINES, MAX_FAMILY_LINES = 600, 500

def functions():
    """(path relative to gpg_vl/, qualified name, node) of every function and method."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        relative = path.relative_to(PACKAGE).as_posix()
        yield from ((relative, name, node) for name, node in _defined(tree))


def _defined(node, prefix=""):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{child.name}", child
            yield from _defined(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _defined(child, f"{prefix}{child.name}.")


def parameters(node) -> int:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in names if n not in ("self", "cls")])


def lines(node) -> int:
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - start + 1


def test_no_function_is_over_80_lines_or_10_parameters():
    over = []
    for path, name, node in functions():
        if lines(node) > MAX_LINES or parameters(node) > MAX_PARAMETERS:
            over.append(f"gpg_vl/{path}:{node.lineno} {name}: {lines(node)} lines, {parameters(node)} parameters")
    assert not over, "over the limits (80 lines, 10 parameters):\n" + "\n".join(over)


def test_no_module_is_over_600_lines_and_the_family_protocol_stays_small():
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
             for path in sorted(PACKAGE.rglob("*.py"))}
    over = [f"gpg_vl/{path}: {lines} lines" for path, lines in sizes.items() if lines > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)
    assert sizes["models/family.py"] <= MAX_FAMILY_LINES, "models/family.py holds the protocol alone"


def test_train_reads_in_40_lines():
    train = next(node for path, name, node in functions() if path == "train/loop.py" and name == "train")
    assert lines(train) <= MAX_TRAIN_LINES


def test_the_trainer_stages_name_no_engine():
    """Engines own their settings and checks: no rollout.vllm key and no HFEngine in the trainer's stages."""
    for name in ("loop.py", "setup.py", "step_log.py", "step/sample.py", "step/update.py", "step/micro_batch.py",
                 "step/loss_call.py", "step/reference.py", "eval/evaluate.py"):
        tree = ast.parse((PACKAGE / "train" / name).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import)
                  for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {"vllm", "HFEngine", "VLLMEngine"} & names, name
        assert not {m for m in modules if m.startswith("gpg_vl.rollout.") and m != "gpg_vl.rollout.engine"
                    and m not in ("gpg_vl.rollout.types", "gpg_vl.rollout.multiturn.trajectory")}, name  # neutral
