"""vlmdoctor: profiler-driven diagnosis of vision-language-model training."""

__version__ = "0.1.0"

#: version of the report JSON layout; bump when a field changes meaning or moves
SCHEMA_VERSION = 1

from vlmdoctor.invisible import kept as _kept  # noqa: E402

with _kept():  # rich draws from Python's `random` when imported: imported here, in a user's process invisibly
    import rich.style  # noqa: E402, F401


def __getattr__(name: str):
    """`vlmdoctor.Doctor` and `vlmdoctor.DoctorCallback`, imported on first use (torch and transformers are heavy);
    the import leaves the user's random streams as it found them (a library imported then may draw)."""
    if name in ("Doctor", "DoctorCallback"):
        with _kept():
            if name == "Doctor":
                from vlmdoctor.own.api import Doctor as found  # deferred: the recorder imports torch
            else:
                from vlmdoctor.own.callback import DoctorCallback as found  # deferred: transformers
        return found
    raise AttributeError(f"module 'vlmdoctor' has no attribute {name!r}")
