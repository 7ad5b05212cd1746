"""The built-in task plugins (the package gpg_vl_tasks). Each registers itself when imported; the registry
imports one on first use, from the table of built-ins in gpg_vl/config/names.py (`TASK_BUILTINS`)."""
