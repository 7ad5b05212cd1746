"""docs/configuration.md is generated from the settings schema: it must be what scripts/gen_config_docs.py
writes now, and writing it must not need torch or transformers."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_config_docs  # noqa: E402


def test_configuration_reference_is_what_the_generator_writes():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == gen_config_docs.render(), (
        "docs/configuration.md differs from the schema (gpg_vl/config/schema.py): run "
        "`python scripts/gen_config_docs.py` and commit the page")


def test_every_key_of_train_and_eval_has_a_row_with_its_meaning():
    from gpg_vl.config.keys import declared, key_of
    from gpg_vl.config.schema import EvalSchema, TrainSchema

    rows = gen_config_docs.table_rows(gen_config_docs.render())
    for schema in (TrainSchema, EvalSchema):
        for name, item in declared(schema):
            if name == "trainer":  # eval.yaml accepts a task's trainer.* and ignores it
                continue
            assert key_of(item) is not None and key_of(item).help, f"{name} has no meaning (meta) in the schema"
            assert any(row.startswith(f"| `{name}` |") for row in rows), name


def test_the_generator_imports_neither_torch_nor_transformers():
    code = ("import sys, runpy; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'gen_config_docs.py')!r}, run_name='gen'); "
            "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
