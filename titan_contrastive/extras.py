"""The one line said when a package of an optional extra (pyproject.toml's `[hf]`, `[data]`, ...)
cannot be imported: missing, it is named with the extra that installs it; installed but failing
on import (a version another package does not accept), its own error is given, since installing
the extra again would change nothing."""

from __future__ import annotations


def import_failure(error: ImportError, who: str, extra: str) -> str:
    """`who needs <package>: pip install -e '.[extra]'` for a missing module, else `who` with the
    import's own error on one line."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        return f"{who} needs {error.name.split('.')[0]}: pip install -e '.[{extra}]'"
    said = " ".join(str(error).split())
    return (
        f"{who}: an installed package failed to import ({said}); fix that installation (pip check tells what conflicts)"
    )
