"""Each record of the results file is declared once: the TypedDict in results/schema.py is the
record, and the code that produces or reads one uses it, with no class of its own beside it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "mac_moesd"


def annotated_fields(node: ast.ClassDef) -> dict[str, str]:
    return {n.target.id: ast.unparse(n.annotation) for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def schema_records(package: Path) -> dict[str, dict[str, str]]:
    tree = ast.parse((package / "results" / "schema.py").read_text())
    return {n.name: annotated_fields(n) for n in tree.body if isinstance(n, ast.ClassDef)}


def twins(package: Path) -> list[str]:
    """Classes outside results/ that repeat a schema record: its name, or fields that are all the
    record's, at least two of them with the record's very annotation."""
    records = schema_records(package)
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "results":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            fields = annotated_fields(node)
            for name, record in records.items():
                same = [f for f, annotation in fields.items() if record.get(f) == annotation]
                if node.name == name or (len(same) >= 2 and set(fields) <= set(record)):
                    found.append(f"{path.relative_to(package)}: {node.name} ~ schema.{name}")
    return found


def test_no_record_is_declared_beside_its_schema_record():
    assert twins(PACKAGE) == []


def test_the_check_finds_a_twin(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "schema.py").write_text(
        "class Drift(TypedDict, total=False):\n    before_s: float\n    after_s: float\n    flagged: bool\n"
        "class Window(TypedDict, total=False):\n    batch: int\n")
    (tmp_path / "timing.py").write_text(
        "@dataclass\nclass Change:\n    before_s: float\n    after_s: float\n"
        "class Window:\n    rows: list\n"
        "class Unrelated:\n    before_s: float\n    label: str\n")
    assert twins(tmp_path) == ["timing.py: Change ~ schema.Drift", "timing.py: Window ~ schema.Window"]
