"""Helper modules the tests share (runs, fixtures, out-of-tree tasks and engines); imported as `helpers.<module>`
(pytest puts tests/ on the path), or loaded by path from a run (`task.name=tests/helpers/vowel_task.py:Vowels`)."""
